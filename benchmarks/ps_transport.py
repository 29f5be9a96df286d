"""Transport candidates for the parameter servers: push and pull of a 4 MB float32 tensor on loopback.

Candidates, each with its server in a second process (1 thread each):
  spread-zmq spread.ps.zmq_transport (the default): pyzmq ROUTER/DEALER, multipart wire frames
            sent without copying, HMAC token proof in every message
  spread-grpc spread.ps.grpc_transport: the same API on grpcio (generic handlers, wire frames as
            raw bytes, HMAC token proof in the call metadata, mutual TLS keyed by the token)
  grpc      grpcio generic handlers with raw-bytes (de)serializers carrying the same wire frames and
            a token proof in the call metadata (no protobuf codegen, no pickle)
  torch_rpc torch.distributed.rpc with TensorPipe (pickles Python arguments: not allowed for spread)

push = client sends 4 MB, server answers with a few bytes; pull = the reverse; echo = both;
ping = an empty request and answer (the per-call latency that small sparse updates pay).
Prints median (min-max) milliseconds per call and effective GB/s (payload bytes / time).

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/ps_transport.py --reps 7 --calls 20
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import time

NUMEL = 1 << 20  # 4 MB of float32


def _threads() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# -- spread's socket transport --------------------------------------------------------------------
def _handlers(stored):
    return {
        "push": lambda meta, t: ({"ok": True}, {}),
        "pull": lambda meta, t: ({}, {"x": stored}),
        "echo": lambda meta, t: ({}, t),
        "ping": lambda meta, t: ({}, {}),
    }


def _client_ops(call, x):
    return {
        "push": lambda: call("push", {}, {"x": x}),
        "pull": lambda: call("pull", {}, {}),
        "echo": lambda: call("echo", {}, {"x": x}),
        "ping": lambda: call("ping", {}, {}),
    }


# -- spread's gRPC transport ----------------------------------------------------------------------
def _spread_grpc_server(token: str, conn) -> None:
    _threads()
    import torch

    from spread.ps.grpc_transport import GrpcServer as RpcServer

    server = RpcServer("bench", _handlers(torch.randn(NUMEL)), token=token).start()
    conn.send(server.address)
    conn.recv()  # until the client is done
    server.stop()


def bench_spread_grpc(reps: int, calls: int) -> dict[str, list[float]]:
    import torch

    from spread.ps.grpc_transport import GrpcClient as RpcClient

    token = secrets.token_hex(8)
    with _server_process(_spread_grpc_server, token) as (address, _):
        client = RpcClient(address, peer="bench server", token=token)
        x = torch.randn(NUMEL)
        out = _time_ops(_client_ops(lambda m, meta, t: client.call(m, meta, t), x), reps, calls)
        client.close()
    return out


# -- spread's ZeroMQ transport --------------------------------------------------------------------
def _spread_zmq_server(token: str, conn) -> None:
    _threads()
    import torch

    from spread.ps.zmq_transport import ZmqServer as RpcServer

    server = RpcServer("bench", _handlers(torch.randn(NUMEL)), token=token).start()
    conn.send(server.address)
    conn.recv()  # until the client is done
    server.stop()


def bench_spread_zmq(reps: int, calls: int) -> dict[str, list[float]]:
    import torch

    from spread.ps.zmq_transport import ZmqClient as RpcClient

    token = secrets.token_hex(8)
    with _server_process(_spread_zmq_server, token) as (address, _):
        client = RpcClient(address, peer="bench server", token=token)
        x = torch.randn(NUMEL)
        out = _time_ops(_client_ops(lambda m, meta, t: client.call(m, meta, t), x), reps, calls)
        client.close()
    return out


# -- gRPC ------------------------------------------------------------------------------------------
_PROOF_KEY = "spread-job-proof"


def _grpc_server(token: str, conn) -> None:
    _threads()
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import torch

    from spread.ps.wire import decode, encode

    proof = hashlib.sha256(token.encode()).hexdigest()

    def wrap(fn):
        def handle(request, context):
            if dict(context.invocation_metadata()).get(_PROOF_KEY) != proof:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong job token")
            return encode(*fn(*decode(request)))

        return grpc.unary_unary_rpc_method_handler(handle)

    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    server = grpc.server(ThreadPoolExecutor(4), options=options)
    methods = {name: wrap(fn) for name, fn in _handlers(torch.randn(NUMEL)).items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("spread.Bench", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(f"127.0.0.1:{port}")
    conn.recv()
    server.stop(0).wait()


def bench_grpc(reps: int, calls: int) -> dict[str, list[float]]:
    import grpc
    import torch

    from spread.ps.wire import decode, encode

    token = secrets.token_hex(8)
    metadata = ((_PROOF_KEY, hashlib.sha256(token.encode()).hexdigest()),)
    with _server_process(_grpc_server, token) as (address, _):
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        channel = grpc.insecure_channel(address, options=options)

        def call(method, meta, tensors):
            stub = channel.unary_unary(f"/spread.Bench/{method}")
            return decode(stub(encode(meta, tensors), timeout=60, metadata=metadata))

        out = _time_ops(_client_ops(call, torch.randn(NUMEL)), reps, calls)
        channel.close()
    return out


@contextlib.contextmanager
def _server_process(target, token):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(token, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise TimeoutError("the benchmark server did not start within 120 s")
        yield parent.recv(), proc
        parent.send("done")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()


# -- torch.distributed.rpc ------------------------------------------------------------------------
_STORED = None


def _rpc_push(t):
    return True


def _rpc_pull():
    return _STORED


def _rpc_echo(t):
    return t


def _torch_rpc_worker(rank: int, port: int, reps: int, calls: int, conn) -> None:
    _threads()
    import torch
    import torch.distributed.rpc as rpc

    global _STORED
    _STORED = torch.randn(NUMEL)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        x = torch.randn(NUMEL)
        ops = {
            "push": lambda: rpc.rpc_sync("w1", _rpc_push, args=(x,)),
            "pull": lambda: rpc.rpc_sync("w1", _rpc_pull),
            "echo": lambda: rpc.rpc_sync("w1", _rpc_echo, args=(x,)),
            "ping": lambda: rpc.rpc_sync("w1", _rpc_push, args=(None,)),
        }
        conn.send(_time_ops(ops, reps, calls))
    rpc.shutdown()


def bench_torch_rpc(reps: int, calls: int) -> dict[str, list[float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_torch_rpc_worker, args=(r, port, reps, calls, child)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        if not parent.poll(300):
            raise TimeoutError("torch rpc benchmark gave no result within 300 s")
        result = parent.recv()
        for p in procs:
            p.join(60)
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _time_ops(ops, reps: int, calls: int) -> dict[str, list[float]]:
    out = {}
    for name, op in ops.items():
        for _ in range(5):
            op()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(calls):
                op()
            times.append((time.perf_counter() - start) / calls * 1e3)
        out[name] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    candidates = ["spread-zmq", "spread-grpc", "grpc", "torch_rpc"]
    ap.add_argument("--only", choices=candidates, default=None)
    a = ap.parse_args()
    _threads()
    runs = {
        "spread-grpc": bench_spread_grpc,
        "spread-zmq": bench_spread_zmq,
        "grpc": bench_grpc,
        "torch_rpc": bench_torch_rpc,
    }
    print(f"4 MB float32; {a.reps} reps x {a.calls} calls; median (min-max) ms per call; payload GB/s")
    for name, fn in runs.items():
        if a.only and name != a.only:
            continue
        result = fn(a.reps, a.calls)
        for op, times in result.items():
            med = statistics.median(times)
            payload = 4 * NUMEL * {"echo": 2, "ping": 0}.get(op, 1)
            print(
                f"{name:11s} {op:5s} {med:7.2f} ms ({min(times):.2f}-{max(times):.2f})  "
                f"{payload / med / 1e6:5.2f} GB/s"
            )


if __name__ == "__main__":
    main()
