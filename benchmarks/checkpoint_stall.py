"""How long a backup holds up training: spread's synchronous backups, spread's asynchronous backups
(the default) and torch DCP's ``async_save`` called directly, in the same run, on W2.

    python benchmarks/checkpoint_stall.py [--rounds 3] [--steps 12] [--every 3] [--quick]

2 processes x 1 thread, MultiWorkerMirrored (``--strategy sharded``: ShardedStrategy, optimizer
state split), ``Trainer.fit`` on W2 (GPT decoder, AdamW: about 64 MB of weights and moments), a backup
every ``--every`` steps. The stall of one backup is the time the training loop spends in it on the
slowest rank:

* ``spread sync``: ``BackupAndRestore(async_save=False)``: the gather, serialisation, fsyncs and
  atomic commit, then the ranks' agreement;
* ``spread async``: ``BackupAndRestore()`` (``async_save=True``): confirming the previous backup,
  the host copy of the state, the agreement; the write runs on a background thread;
* ``DCP async_save``: a callback calling ``torch.distributed.checkpoint.async_save`` on the model's
  and optimizer's ``state_dict`` (over a gloo group of its own, as torch recommends), waiting for
  the previous one's future first: DCP's own staging (a CPU copy) and planning.

Each round runs every mode once, in a rotating order; ratios to ``spread sync`` are paired by round.
Also printed: the background write's own duration (what the synchronous stall mostly is).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import spread
from spread.callbacks import BackupAndRestore, Callback
from spread.testing import run_ranks

MODES = ("spread sync", "spread async", "DCP async_save")


class _TimedBackup(BackupAndRestore):
    """BackupAndRestore, timing each backup on the training thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []

    def _save(self) -> bool:
        started = time.perf_counter()
        stop = super()._save()
        self.stalls.append(time.perf_counter() - started)
        return stop


class _DcpAsyncSave(Callback):
    """Calls ``dcp.async_save`` every ``every`` steps; at most one in flight (the previous future is
    waited for first, as spread does)."""

    def __init__(self, directory: str, every: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.directory, self.every, self.group = directory, every, group
        self.stalls: list[float] = []
        self.future = None

    def on_train_batch_end(self, step: int, logs=None) -> None:
        trainer = self.trainer
        if trainer.global_step % self.every:
            return
        started = time.perf_counter()
        if self.future is not None:
            self.future.result()
        state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
        self.future = dcp.async_save(
            state, checkpoint_id=f"{self.directory}/step-{trainer.global_step}", process_group=self.group
        )
        self.stalls.append(time.perf_counter() - started)

    def on_train_end(self, logs=None) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


def _job(rounds: int, steps: int, every: int, quick: bool, kind: str) -> dict:
    torch.set_num_threads(1)
    if kind == "sharded":
        strategy = spread.ShardedStrategy(shard="optimizer")
    else:
        strategy = spread.MultiWorkerMirroredStrategy()
    dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    stalls: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    writes: list[float] = []
    try:
        with strategy.scope():
            model, loss_fn, make_optimizer, batch, global_batch = workloads.make("W2", quick=quick)
            optimizer = make_optimizer(model.parameters())
        data = batch(global_batch * steps)
        trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy)
        trainer.fit(data, epochs=1, global_batch_size=global_batch, verbose=0)  # warm-up, untimed
        for r in range(rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                with tempfile.TemporaryDirectory() as directory:
                    if mode == "DCP async_save":
                        callback: Callback = _DcpAsyncSave(directory, every, dcp_group)
                    else:
                        callback = _TimedBackup(
                            directory, save_freq=every, async_save=mode == "spread async", keep=2
                        )
                    strategy.collectives.barrier()
                    trainer.fit(
                        data, epochs=1, global_batch_size=global_batch, callbacks=[callback], verbose=0
                    )
                    stalls[mode].append(callback.stalls)  # type: ignore[attr-defined]
                    if mode == "spread async":
                        writer = strategy._async_checkpoints._writer
                        if writer is not None and writer.last_write_seconds is not None:
                            writes.append(writer.last_write_seconds)
        return {"stalls": stalls, "writes": writes}
    finally:
        dist.destroy_process_group(dcp_group)
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--strategy", choices=("mirrored", "sharded"), default="mirrored")
    parser.add_argument("--quick", action="store_true", help="tiny W2 (smoke test; meaningless timings)")
    args = parser.parse_args()
    results = run_ranks(
        _job,
        2,
        args=(args.rounds, args.steps, args.every, args.quick, args.strategy),
        timeout=1800,
        env={"OMP_NUM_THREADS": "1"},
    )
    # per mode, per round: the stall of each backup on the slowest rank
    per_round: dict[str, list[float]] = {}
    every_backup: dict[str, list[float]] = {}
    for mode in MODES:
        for r in range(args.rounds):
            backups = [
                max(rank["stalls"][mode][r][i] for rank in results)
                for i in range(len(results[0]["stalls"][mode][r]))
            ]
            per_round.setdefault(mode, []).append(statistics.median(backups))
            every_backup.setdefault(mode, []).extend(backups)
    print(
        f"W2, {args.strategy}, 2 x 1 thread, a backup every {args.every} of {args.steps} steps, "
        f"{args.rounds} rounds"
    )
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    sync = per_round["spread sync"]
    for mode in MODES:
        values = per_round[mode]
        ratios = [v / s for v, s in zip(values, sync, strict=True)]
        ms = [round(v * 1e3, 1) for v in values]
        spread_ms = (min(every_backup[mode]) * 1e3, max(every_backup[mode]) * 1e3)
        print(
            f"  {mode:15} stall per backup {statistics.median(values) * 1e3:8.1f} ms  "
            f"(rounds {ms}; every backup {spread_ms[0]:.1f}-{spread_ms[1]:.1f} ms)  "
            f"/ sync {statistics.median(ratios):.3f} (rounds {[round(x, 3) for x in ratios]})"
        )
    writes = results[0]["writes"]
    if writes:
        print(
            "  background write of a spread async backup (chief): "
            f"median {statistics.median(writes) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
