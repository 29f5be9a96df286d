"""Copy the ranks' output to the launcher's own stdout/stderr, one line at a time, tagged by rank.

Why a thread per pipe and not a select loop: each pump is a dozen lines, blocks only on its own pipe,
and needs no platform-specific polling; a launcher has at most a few dozen pipes. Why line-buffered:
two ranks writing at once must not interleave inside a line, so a pump holds a partial line until its
newline arrives (or the pipe closes, when the partial line is flushed with a newline added). Output is
decoded as UTF-8 with ``errors="replace"``, so a rank that writes binary garbage cannot crash the relay.

Imports nothing heavy: ``spread run`` must start fast.
"""

from __future__ import annotations

import codecs
import os
import sys
import threading
from typing import IO

# A "line" longer than this is relayed in pieces rather than buffered without bound.
_MAX_PENDING = 1 << 16
_CHUNK = 1 << 16


class OutputRelay:
    """Relays the pipes of many ranks to ``sys.stdout`` / ``sys.stderr`` under one lock.

    The destination stream is looked up at write time, so redirecting ``sys.stdout`` (as pytest's
    ``capsys`` does) redirects the relay too. A closed or broken destination (``spread run | head``)
    is dropped silently while the pipes keep being drained, so ranks never block on a full pipe.
    """

    def __init__(self, *, prefix: bool) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._broken: set[str] = set()

    def start(self, rank: int | str, pipe: IO[bytes], stream: str) -> threading.Thread:
        """Start a daemon thread copying ``pipe`` to ``sys.<stream>`` until EOF; returns the thread."""
        thread = threading.Thread(
            target=self._pump, args=(rank, pipe, stream), name=f"spread-relay-{rank}-{stream}", daemon=True
        )
        thread.start()
        return thread

    def note(self, message: str) -> None:
        """Write one launcher message (``spread run: ...``) to stderr, never inside a rank's line."""
        self.write("stderr", f"spread run: {message}\n")

    def write(self, stream: str, text: str) -> None:
        """Write ``text`` to ``sys.<stream>`` and flush, under the relay's lock."""
        if stream in self._broken:
            return
        with self._lock:
            target = getattr(sys, stream, None)
            if target is None:
                return
            try:
                try:
                    target.write(text)
                except UnicodeEncodeError:  # e.g. an ASCII-only locale: degrade, do not die
                    encoding = getattr(target, "encoding", None) or "ascii"
                    target.write(text.encode(encoding, errors="replace").decode(encoding))
                target.flush()
            except (OSError, ValueError):  # reader went away, or the stream was closed
                self._broken.add(stream)

    def _pump(self, rank: int | str, pipe: IO[bytes], stream: str) -> None:
        tag = (f"[{rank}] " if isinstance(rank, str) else f"[rank {rank}] ") if self.prefix else ""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        fd = pipe.fileno()
        try:
            while True:
                try:
                    chunk = os.read(fd, _CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                text = decoder.decode(chunk)
                if not self.prefix:
                    if text:
                        self.write(stream, text)
                    continue
                pending += text
                complete, sep, rest = pending.rpartition("\n")
                if sep:
                    pending = rest
                    self.write(stream, "".join(f"{tag}{line}\n" for line in complete.split("\n")))
                if len(pending) >= _MAX_PENDING:
                    self.write(stream, f"{tag}{pending}\n")
                    pending = ""
            pending += decoder.decode(b"", final=True)
            if pending:  # the partial last line of a rank that exited without a newline
                self.write(stream, f"{tag}{pending}\n" if self.prefix else pending)
        finally:
            pipe.close()
