"""A peer without the job token calling a gRPC server: CALLS concurrent calls to ``/spread.ps/echo``,
each with a request body of SIZE MiB and no session, over plaintext HTTP/2 (``plaintext``) or over
TLS with another job's identity (``other-tls``). Before the servers spoke TLS, gRPC read each body
whole before the session check refused it. Prints the status codes the calls ended with, comma
separated (``UNAVAILABLE`` when no connection was accepted), then exits.

    python _grpc_attacker.py PORT MODE CALLS SIZE_MIB
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from spread.ps import grpc_transport as grpc_rpc


def main() -> None:
    port, mode = sys.argv[1], sys.argv[2]
    calls, mib = int(sys.argv[3]), int(sys.argv[4])
    target = f"127.0.0.1:{port}"
    options = [("grpc.enable_http_proxy", 0), ("grpc.max_send_message_length", -1)]
    if mode == "plaintext":
        channel = grpc.insecure_channel(target, options=options)
    else:
        options.append(("grpc.ssl_target_name_override", grpc_rpc.TLS_NAME))
        channel = grpc.secure_channel(target, grpc_rpc.channel_credentials("another job's token"), options)
    echo = channel.unary_unary(f"/{grpc_rpc.SERVICE}/echo", _registered_method=False)
    body = b"x" * (mib << 20)
    futures = [echo.future(body, timeout=60) for _ in range(calls)]
    codes = set()
    for future in futures:
        try:
            future.result()
            codes.add("OK")
        except grpc.RpcError as exc:
            codes.add(exc.code().name)
    channel.close()
    print(",".join(sorted(codes)), flush=True)


if __name__ == "__main__":
    main()
