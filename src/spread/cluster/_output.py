"""Copy the ranks' output to the launcher's own stdout/stderr, one line at a time, tagged by rank.

One thread per rank reads both of its pipes, so what a rank printed comes out in the order it printed
it: with a thread per pipe, a rank's traceback on stderr could be relayed before the line it had
printed (and flushed) on stdout just before failing. The ranks run with ``PYTHONUNBUFFERED=1``, so a
line reaches its pipe when it is written. When both pipes hold data at one wake-up, which was written
first is unknown; a line printed before a failure is the order that matters (``python`` on a terminal
and torchrun, whose ranks share the terminal, keep it). So at each wake-up stderr is read first and
relayed last, after everything stdout holds by then: whatever the rank wrote to stdout before the
stderr bytes just read is in its pipe already. (Reading stdout first was not enough: ``print`` writes
the line and its newline in two writes, and a rank failing between the relay's stdout read and its
stderr read had its traceback relayed while the line still waited for its newline.) Output a rank
writes to both streams within one wake-up of the relay may still come stream by stream.

Why line-buffered: two ranks writing at once must not interleave inside a line, so a pipe's partial
line is held until its newline arrives (or the pipe closes, when the partial line is flushed with a
newline added). Output is decoded as UTF-8 with ``errors="replace"``, so a rank that writes binary
garbage cannot crash the relay.

When the launcher's stdout is a terminal (``live``), a carriage return in a rank's stdout is a progress
bar redrawing its line (tqdm, Keras-style bars): the latest frame is shown at once, in place, under the
rank's tag, cut to the terminal's width (a frame that wraps cannot be redrawn: its first row would stay
on screen), and any other line first ends the bar's line. torch tags its own tracebacks and log lines
``[rankN]:`` once a process group exists; under our ``[rank N] `` tag that is said twice, so it goes.

Imports nothing heavy: ``spread run`` must start fast.
"""

from __future__ import annotations

import codecs
import os
import re
import selectors
import shutil
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

    def start(self, rank: int | str, stdout: IO[bytes], stderr: IO[bytes]) -> threading.Thread:
        """Start a daemon thread copying a rank's ``stdout`` and ``stderr`` pipes to ``sys.stdout`` and
        ``sys.stderr`` until both reach EOF; returns the thread."""
        thread = threading.Thread(
            target=self._pump, args=(rank, stdout, stderr), name=f"spread-relay-{rank}", daemon=True
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
            if bar:  # a frame wider than the terminal wraps, and "\r" redraws only its last row
                text = "\r" + text.lstrip("\r")[: max(1, _terminal_columns() - 1)]
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

    def _pump(self, rank: int | str, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        pipes = {"stdout": _Pipe(self, rank, "stdout", stdout), "stderr": _Pipe(self, rank, "stderr", stderr)}
        selector = selectors.DefaultSelector()
        try:
            for pipe in pipes.values():
                os.set_blocking(pipe.fd, False)
                selector.register(pipe.fd, selectors.EVENT_READ)
            while pipes:
                selector.select()
                # stderr read first and relayed last, stdout read ready or not: see the module's doc
                errors = pipes["stderr"].take() if "stderr" in pipes else None
                output = pipes["stdout"].take() if "stdout" in pipes else None
                for name, chunk in (("stdout", output), ("stderr", errors)):
                    if chunk is None:  # nothing written yet (or the pipe is gone)
                        continue
                    if chunk:
                        pipes[name].forward(chunk)
                    else:  # end of file
                        selector.unregister(pipes[name].fd)
                        pipes.pop(name).close()
        finally:
            selector.close()
            for pipe in pipes.values():
                pipe.close()


class _Pipe:
    """One pipe of a rank: its decoder, and the partial line it holds until the newline comes."""

    def __init__(self, relay: OutputRelay, rank: int | str, stream: str, pipe: IO[bytes]) -> None:
        self.relay, self.rank, self.stream, self.pipe = relay, rank, stream, pipe
        self.fd = pipe.fileno()
        self.tag = (f"[{rank}] " if isinstance(rank, str) else f"[rank {rank}] ") if relay.prefix else ""
        self.live = relay.live and relay.prefix and stream == "stdout"
        self.me = (rank, stream)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""

    def _lines(self, text: str) -> str:
        if isinstance(self.rank, int):  # torch's "[rankN]: " for this very rank repeats our tag
            rank = self.rank
            text = _TORCH_TAG.sub(lambda m: "" if int(m.group(1)) == rank else m.group(0), text)
        return "".join(f"{self.tag}{_last_frame(line) if self.live else line}\n" for line in text.split("\n"))

    def take(self) -> bytes | None:
        """What the pipe holds now, without relaying it: ``b""`` at end of file, None when empty."""
        try:
            return os.read(self.fd, _CHUNK)
        except BlockingIOError:  # nothing written yet
            return None
        except OSError:
            return b""

    def forward(self, chunk: bytes) -> None:
        """Relay bytes read from this pipe (complete lines now, a partial line when it completes)."""
        self._relay(self.decoder.decode(chunk))

    def _relay(self, text: str) -> None:
        relay, stream, tag = self.relay, self.stream, self.tag
        if not relay.prefix:
            if text:
                relay.write(stream, text)
            return
        self.pending += text
        complete, sep, rest = self.pending.rpartition("\n")
        if sep:
            self.pending = rest
            relay.write(stream, self._lines(complete), owner=self.me)
        if self.live and "\r" in self.pending and (frame := _last_frame(self.pending)):
            # a bar redrew its line: show its latest frame now, in place (a frame cut by the pipe is
            # redrawn whole by the next chunk)
            relay.write(stream, f"\r{tag}{frame}", owner=self.me, bar=True)
            self.pending = self.pending[self.pending.rindex("\r") :]
        if len(self.pending) >= _MAX_PENDING:
            relay.write(stream, f"{tag}{self.pending}\n", owner=self.me)
            self.pending = ""

    def close(self) -> None:
        """Relay the partial last line of a rank that exited without a newline; close the pipe."""
        if self.pipe.closed:
            return
        self.pending += self.decoder.decode(b"", final=True)
        if self.pending:
            text = self._lines(self.pending) if self.relay.prefix else self.pending
            self.relay.write(self.stream, text, owner=self.me)
            self.pending = ""
        self.pipe.close()


def _last_frame(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns: its last non-empty frame."""
    frames = [frame for frame in line.split("\r") if frame]
    return frames[-1] if frames else ""


def _terminal_columns() -> int:
    """The launcher's terminal width (``COLUMNS`` when set), read at each frame: windows are resized."""
    return shutil.get_terminal_size().columns


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
