"""One measured configuration for ``plan_validation.py``: median step time of a workload under a strategy.

Run as every rank of a job (``spread run -n N``) or as one process for in-process strategies. The
loop is the custom-loop path users write: ``distribute_dataset``, ``strategy.run``, optimizer step.
The chief writes ``{"step_seconds": median, "steps": [...]}`` as JSON to ``--output`` (under a
parameter-server job, the chief's own steps: each worker steps on its share of the global batch;
with ``--sync-dir`` the training tasks start their timed steps together, see
:func:`_wait_for_each_other`, and each leaves its timed window there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_families as workloads
from torch import nn

import spread


def _units(workload: str) -> tuple[type[nn.Module], ...] | str:
    """One unit per top-level block of a chain, as the planner predicts ShardedStrategy; else the model."""
    model = workloads.make(workload)[0]
    if not isinstance(model, nn.Sequential):
        return "model"
    return tuple(dict.fromkeys(type(block) for block in model if any(True for _ in block.parameters())))


def _strategy(args: argparse.Namespace) -> spread.Strategy:
    if args.strategy == "one_device":
        return spread.OneDeviceStrategy()
    if args.strategy == "mirrored":
        return spread.MirroredStrategy(num_replicas=args.replicas)
    if args.strategy == "central_storage":
        return spread.CentralStorageStrategy(num_replicas=args.replicas)
    if args.strategy == "multi_worker_mirrored":
        return spread.MultiWorkerMirroredStrategy(communication=args.communication)
    if args.strategy == "parameter_server":
        return spread.ParameterServerStrategy()
    if args.strategy == "pipeline":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return spread.PipelineStrategy(
            stages=args.stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            replicas=world // args.stages,
        )
    if args.strategy == "sharded":
        return spread.ShardedStrategy(shard=args.shard, units=_units(args.workload))
    raise SystemExit(f"validation worker: strategy {args.strategy!r} is not measured by this worker")


def _wait_for_each_other(folder: str, rank: int, tasks: int, timeout: float = 120.0) -> None:
    """Start the timed steps of every training task of an asynchronous job at the same moment.

    Nothing synchronises them (no collective, no barrier in an asynchronous parameter-server job),
    and their start times differ by seconds of importing torch when processes outnumber cores: the
    chief's steps then ran partly with fewer tasks competing for the cores, and measured 128-286 ms
    for one configuration across three rounds. A file per task in a folder all of them see.
    """
    Path(folder, f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(folder).glob("ready-*"))) < tasks:
        if time.monotonic() > deadline:
            raise SystemExit(f"validation worker: rank {rank}: the other training tasks never got ready")
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--communication", default="auto")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--shard", default="parameters")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    # steps untimed: a fresh process keeps speeding up past its first steps (one device at 2 threads,
    # 5 steps after 2 vs after 12, three interleaved rounds: CNN 292 vs 242 ms, LSTM 92 vs 80,
    # recommender 51 vs 43, ResNet 90 vs 79); the planner predicts the steady step of a long job
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--output", required=True)
    parser.add_argument("--sync-dir", default=None, help="parameter servers: start timing together")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    strategy = _strategy(args)
    try:
        with strategy.scope():
            model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(args.workload)
            optimizer = make_optimizer(model.parameters())
        x, y = make_batch(global_batch * (args.steps + args.warmup))
        data = strategy.distribute_dataset((x, y), global_batch, shuffle=False, prefetch=2)

        def replica_step(batch):
            inputs, targets = batch
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            return loss.detach()

        times: list[float] = []
        step_ends: list[float] = []  # monotonic, one per timed step
        timed_from = last_step_end = 0.0
        tasks_time_together = bool(args.sync_dir) and isinstance(strategy, spread.ParameterServerStrategy)
        for i, batch in enumerate(data):
            if i == args.warmup and isinstance(strategy, spread.MultiWorkerMirroredStrategy):
                strategy.collectives.barrier()  # ShardedStrategy too (a subclass)
            elif i == args.warmup and isinstance(strategy, spread.PipelineStrategy):
                strategy.world.barrier()
            elif i == args.warmup and tasks_time_together:
                _wait_for_each_other(args.sync_dir, strategy.rank, strategy.num_workers)
                timed_from = time.monotonic()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if args.strategy == "pipeline":
                strategy.train_step(model, *batch, loss_fn)
            else:
                strategy.run(replica_step, args=(batch,))
            optimizer.step()
            times.append(time.perf_counter() - start)
            last_step_end = time.monotonic()  # not after the loop: the data's end is no step
            if i >= args.warmup:
                step_ends.append(last_step_end)
        measured = times[args.warmup :]
        if tasks_time_together:
            # system-wide clock (Linux CLOCK_MONOTONIC): windows of different processes compare
            window = {"start": timed_from, "end": last_step_end, "steps": len(measured), "ends": step_ends}
            Path(args.sync_dir, f"window-{strategy.rank}.json").write_text(json.dumps(window))
        if strategy.is_chief:
            with open(args.output, "w") as f:
                json.dump({"step_seconds": statistics.median(measured), "steps": measured}, f)
    finally:
        strategy.close()


if __name__ == "__main__":
    main()
