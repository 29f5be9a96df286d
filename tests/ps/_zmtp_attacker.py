"""A peer without the job token speaking raw ZMTP 3.0 (what a libzmq socket would never send): it
completes a NULL-mechanism greeting, then sends PARTS parts of SIZE MiB, each flagged "more", and never
the last one, so ZeroMQ keeps them all for the message it waits to complete. Prints ``sent`` once
every byte went out, or ``dropped`` when the server closed the connection first; then holds the
connection open until killed.

    python _zmtp_attacker.py PORT PARTS SIZE_MIB
"""

from __future__ import annotations

import socket
import struct
import sys
import time


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def main() -> None:
    port, parts, mib = (int(a) for a in sys.argv[1:4])
    sock = socket.create_connection(("127.0.0.1", port))
    chunk = b"x" * (1 << 20)
    try:
        sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        ready = b"\x05READY" + _property(b"Socket-Type", b"DEALER")
        sock.sendall(b"\x04" + bytes([len(ready)]) + ready)  # a short command
        for _ in range(parts):
            sock.sendall(b"\x03" + struct.pack(">Q", mib << 20))  # a long part, more to come
            for _ in range(mib):
                sock.sendall(chunk)
        print("sent", flush=True)
    except OSError:
        print("dropped", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
