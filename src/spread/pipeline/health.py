"""Find which stage died when a pipeline transfer or collective fails.

Why: when stage 2 of 3 is killed, stage 1 sees its connection to stage 2 close, but stage 0 only
sees stage 1 go away (stage 1 exits because of stage 2). To name the stage that actually died, every
rank keeps a heartbeat counter in the job's rendezvous store (a background thread adds 1 every
``interval`` seconds), and a rank that gives up writes what it found before it exits. The diagnosis
after a failure reads every counter twice, ``4 * interval`` apart: a rank whose counter stopped and
that wrote no report is dead (or frozen); reports of ranks that gave up are followed to their cause.
If the store itself is unreachable, its host (rank 0 under ``spread run``) is the one that died.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

_PREFIX = "pipeline/health"


class Heartbeat:
    """Beats for this rank; diagnoses peers after a failure. ``store`` None disables both."""

    def __init__(
        self,
        store: dist.Store | None,
        rank: int,
        world_size: int,
        *,
        interval: float = 0.5,
        store_host_rank: int | None = 0,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval = interval
        self.store_host_rank = store_host_rank
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            store.add(self._beat_key(rank), 1)
            self._thread = threading.Thread(target=self._run, name=f"spread-heartbeat-{rank}", daemon=True)
            self._thread.start()

    @staticmethod
    def _beat_key(rank: int) -> str:
        return f"{_PREFIX}/beat/{rank}"

    @staticmethod
    def _report_key(rank: int) -> str:
        return f"{_PREFIX}/report/{rank}"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self._beat_key(self.rank), 1)  # type: ignore[union-attr]
            except Exception:  # the store host is gone; the diagnosis says so
                return

    def report(self, dead_ranks: list[int] | None) -> None:
        """Say, before exiting, that this rank left on purpose (and whom it found dead)."""
        if self.store is None:
            return
        try:
            self.store.set(self._report_key(self.rank), ",".join(str(r) for r in dead_ranks or []) or "-")
        except Exception:
            pass

    def diagnose(self, suspects: list[int] | None = None) -> list[int]:
        """Ranks that died (or froze), best effort; ``suspects`` is the answer when nothing is known."""
        fallback = sorted(set(suspects or []))
        if self.store is None:
            return fallback
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = {r: self.store.add(self._beat_key(r), 0) for r in others}
            time.sleep(4 * self.interval)
            after = {r: self.store.add(self._beat_key(r), 0) for r in others}
            reports = {}
            for r in others:
                if self.store.check([self._report_key(r)]):
                    reports[r] = self.store.get(self._report_key(r)).decode()
        except Exception:
            if self.store_host_rank is not None and self.store_host_rank != self.rank:
                return [self.store_host_rank]
            return fallback
        stopped = {r for r in others if after[r] == before[r] and r not in reports}
        for text in reports.values():
            stopped.update(int(x) for x in text.split(",") if x not in ("", "-"))
        stopped.discard(self.rank)
        return sorted(stopped) or fallback

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
