"""Copy the ranks' output to the launcher's own stdout/stderr, one line at a time, tagged by rank.

Why a thread per pipe and not a select loop: each pump is a dozen lines, blocks only on its own pipe,
and needs no platform-specific polling; a launcher has at most a few dozen pipes. Why line-buffered:
two ranks writing at once must not interleave inside a line, so a pump holds a partial line until its
newline arrives (or the pipe closes, when the partial line is flushed with a newline added). Output is
decoded as UTF-8 with ``errors="replace"``, so a rank that writes binary garbage cannot crash the relay.

When the launcher's stdout is a terminal (``live``), a carriage return in a rank's stdout is a progress
bar redrawing its line (tqdm, Keras-style bars): the latest frame is shown at once, in place, under the
rank's tag, and any other line first ends the bar's line. torch tags its own tracebacks and log lines
``[rankN]:`` once a process group exists; under our ``[rank N] `` tag that is said twice, so it goes.

Imports nothing heavy: ``spread run`` must start fast.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading
from typing import IO

# A "line" longer than this is relayed in pieces rather than buffered without bound.
_MAX_PENDING = 1 << 16
_CHUNK = 1 << 16
_TORCH_TAG = re.compile(r"^\[rank(\d+)\]: ?", re.MULTILINE)


class OutputRelay:
    """Relays the pipes of many ranks to ``sys.stdout`` / ``sys.stderr`` under one lock.

    The destination stream is looked up at write time, so redirecting ``sys.stdout`` (as pytest's
    ``capsys`` does) redirects the relay too. A closed or broken destination (``spread run | head``)
    is dropped silently while the pipes keep being drained, so ranks never block on a full pipe.
    """

    def __init__(self, *, prefix: bool, live: bool | None = None) -> None:
        self.prefix = prefix
        self.live = _stdout_is_terminal() if live is None else live
        self._lock = threading.Lock()
        self._broken: set[str] = set()
        self._bar_owner: object = None  # the pump whose live bar line is on the terminal, unterminated

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

    def write(self, stream: str, text: str, *, owner: object = None, bar: bool = False) -> None:
        """Write ``text`` to ``sys.<stream>`` and flush, under the relay's lock.

        ``bar``: ``text`` redraws the live bar line of pump ``owner`` (no newline). Text of another pump
        first ends that line; the owner's next lines start by redrawing it (its last frame).
        """
        if stream in self._broken:
            return
        with self._lock:
            target = getattr(sys, stream, None)
            if target is None:
                return
            if self._bar_owner is not None and self._bar_owner != owner:
                text = "\n" + text
            elif self._bar_owner is not None and not bar:
                text = "\r" + text
            self._bar_owner = owner if bar else None
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
        live = self.live and self.prefix and stream == "stdout"
        me = (rank, stream)

        def lines(text: str) -> str:
            if isinstance(rank, int):  # torch's "[rankN]: " for this very rank repeats our tag
                text = _TORCH_TAG.sub(lambda m: "" if int(m.group(1)) == rank else m.group(0), text)
            return "".join(f"{tag}{_last_frame(line) if live else line}\n" for line in text.split("\n"))

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
                    self.write(stream, lines(complete), owner=me)
                if live and "\r" in pending and (frame := _last_frame(pending)):
                    # a bar redrew its line: show its latest frame now, in place (a frame cut by the
                    # pipe is redrawn whole by the next chunk)
                    self.write(stream, f"\r{tag}{frame}", owner=me, bar=True)
                    pending = pending[pending.rindex("\r") :]
                if len(pending) >= _MAX_PENDING:
                    self.write(stream, f"{tag}{pending}\n", owner=me)
                    pending = ""
            pending += decoder.decode(b"", final=True)
            if pending:  # the partial last line of a rank that exited without a newline
                self.write(stream, lines(pending) if self.prefix else pending, owner=me)
        finally:
            pipe.close()


def _last_frame(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns: its last non-empty frame."""
    frames = [frame for frame in line.split("\r") if frame]
    return frames[-1] if frames else ""


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
