"""W3 (sparse: 1M x 64 embedding + small MLP) and W1 (dense MLP) under ParameterServerStrategy and
under MultiWorkerMirroredStrategy, in one run: samples/s and bytes moved per step.

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/ps_w3.py [--reps 5] [--steps 5] [--quick]

Configurations (every process 1 thread; 2 training processes each way):
  mwms x2      MultiWorkerMirroredStrategy, 2 ranks, global batch 512 (256 per rank)
  ps 2w+1s     ParameterServerStrategy async: chief + 1 worker (256 samples per step each) + 1 server
  ps 2w+2s     the same with 2 servers (the table split by rows)
  ps 2w+1s 512/step  1 server, each worker steps on 512 samples (the TF anchor's configuration:
               TF's ParameterServerStrategy, 1 server + 2 workers, 512 samples per worker step)

samples/s is the sum over the 2 training processes of each one's median rate (async workers do not
wait for each other). Bytes per step: PS, what one worker sent and received per step (counted on the
wire); MWMS, the gradient bytes each rank all-reduces per step (ring all-reduce puts
2(n-1)/n of that on the wire). For the PS runs the W3 table has ``sparse=True`` gradients (rows only);
MWMS all-reduces its dense gradient. TensorFlow's ParameterServerStrategy is run when ``tensorflow``
is importable (not installed here: skipped, the anchors' figure is quoted instead).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads

GLOBAL_BATCH = 512


def _timed(step, reps: int, steps: int, per_step_samples: int) -> list[float]:
    for _ in range(3):
        step()
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(per_step_samples * steps / (time.perf_counter() - start))
    return rates


def _loop(
    strategy,
    name: str,
    reps: int,
    steps: int,
    quick: bool,
    sparse_table: bool,
    on_ready=None,
    full_batch=False,
):
    with strategy.scope():
        model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name, quick=quick)
        if sparse_table and hasattr(model, "table"):
            model.table.sparse = True  # row gradients: what a parameter server wants
        optimizer = make_optimizer(model.parameters())
    x, y = make_batch(global_batch)
    per = global_batch if full_batch else global_batch // 2
    rank = 0 if full_batch else max(strategy.rank, 0)
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def replica_step():
        loss_fn(model(x), y).backward()

    def step():
        optimizer.zero_grad()
        strategy.run(replica_step)
        optimizer.step()

    if on_ready is not None:
        on_ready()  # after set-up: the initial variable transfer is not a step's traffic
    return model, _timed(step, reps, steps, per)


def _mwms_rank(name: str, reps: int, steps: int, quick: bool) -> dict:
    import spread

    torch.set_num_threads(1)
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        model, rates = _loop(strategy, name, reps, steps, quick, sparse_table=False)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"rates": rates, "bytes_per_step": grad_bytes}
    finally:
        strategy.close()


def _ps_rank(name: str, reps: int, steps: int, quick: bool, full_batch: bool = False) -> dict:
    import spread

    torch.set_num_threads(1)
    strategy = spread.ParameterServerStrategy()
    try:
        start = {}
        _model, rates = _loop(
            strategy,
            name,
            reps,
            steps,
            quick,
            sparse_table=True,
            full_batch=full_batch,
            on_ready=lambda: start.update(steps=strategy.local_step, bytes=strategy.bytes_moved()),
        )
        moved = strategy.bytes_moved() - start["bytes"]
        return {"rates": rates, "bytes_per_step": moved / max(strategy.local_step - start["steps"], 1)}
    finally:
        strategy.close()


def _summary(results: list, label: str) -> dict:
    medians = [statistics.median(r["rates"]) for r in results]
    mins = [min(r["rates"]) for r in results]
    maxs = [max(r["rates"]) for r in results]
    return {
        "label": label,
        "samples_s": sum(medians),
        "min": sum(mins),
        "max": sum(maxs),
        "bytes": statistics.median(r["bytes_per_step"] for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny models: a smoke test, meaningless timings")
    ap.add_argument("--workloads", default="W3,W1")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from spread.testing import run_ps_job, run_ranks

    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores; torch {torch.__version__}; 1 thread/process"
    )
    rows = []
    for name in a.workloads.split(","):
        mwms = run_ranks(_mwms_rank, 2, args=(name, a.reps, a.steps, a.quick), timeout=900)
        rows.append((name, _summary(mwms, "mwms x2")))
        for servers, full in ((1, False), (2, False), (1, True)):
            args = (name, a.reps, a.steps, a.quick, full)
            results = run_ps_job(_ps_rank, 2, servers, args=args, timeout=900)
            failed = [r.describe() for r in results if not r.ok]
            if failed:
                raise RuntimeError("\n".join(failed))
            label = f"ps 2w+{servers}s" + (" 512/step" if full else "")
            rows.append((name, _summary([r.value for r in results[:2]], label)))
    try:
        import tensorflow  # noqa: F401

        print("tensorflow is installed, but its PS run is not wired into this script yet")
    except ImportError:
        print(
            "tensorflow: not installed; its ParameterServerStrategy is skipped (anchor: W1 ~2,250 samples/s)"
        )
    print(f"{'workload':8s} {'config':18s} {'samples/s':>10s} {'(min-max)':>16s} {'MB/step/worker':>15s}")
    for name, r in rows:
        print(
            f"{name:8s} {r['label']:18s} {r['samples_s']:10.0f} ({r['min']:6.0f}-{r['max']:6.0f})"
            f" {r['bytes'] / 1e6:15.3f}"
        )


if __name__ == "__main__":
    main()
