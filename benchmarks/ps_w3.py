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
MWMS all-reduces its dense gradient.

TensorFlow's ParameterServerStrategy runs in the same invocation when ``tensorflow`` is importable
(``benchmarks/tf_baselines.py``, one subprocess job per row; ``--no-tf`` skips it): 1 server + 2
workers + a chief that only coordinates (4 processes, 1 intra-op thread each, servers 2 inter-op
threads), async steps scheduled over the workers, bytes = TCP payload of the server process per step:
  tf ps 2w+1s           256 samples per worker step (as our "ps 2w+1s": 2 training processes x 256)
  tf ps 2w+1s 512/step  512 samples per worker step (as "ps 2w+1s 512/step" and the TF anchor)
  tf ps ... keras-emb   W3 with the table looked up by calling the Keras ``Embedding`` layer (Keras 3
                        reads the whole table to a tensor first); the other W3 rows use
                        ``tf.nn.embedding_lookup`` on the table variable (rows gathered on the server)
TF's samples/s is the median over repetitions of (steps of both workers x samples per step / time);
ours sums the two processes' medians. Ratios spread / TF are printed under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
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


# (label, samples per worker step (None: the global batch), W3 table lookup) of the TF rows
TF_ROWS = (("tf ps 2w+1s", "half", "lookup"), ("tf ps 2w+1s 512/step", None, "lookup"))
TF_W3_EXTRA = (("tf ps 2w+1s keras-emb", "half", "keras"),)
# which spread row each TF row is compared with
TF_PAIRS = {"tf ps 2w+1s": "ps 2w+1s", "tf ps 2w+1s 512/step": "ps 2w+1s 512/step"}


def tf_ps_rows(name: str, reps: int, steps: int, quick: bool, timeout: float = 600) -> list[tuple[str, dict]]:
    """TensorFlow's ParameterServerStrategy on workload ``name``, one ``tf_baselines.py`` job per row;
    a row that fails carries ``error`` (the role that failed) instead of rates."""
    import tf_baselines

    if not tf_baselines.tensorflow_available():
        return []
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_baselines.py")
    half = (64 if quick else GLOBAL_BATCH) // 2
    rows = []
    for label, per, embedding in TF_ROWS + (TF_W3_EXTRA if name == "W3" else ()):
        cmd = [sys.executable, script, "--mode", "ps", "--workload", name, "--reps", str(reps)]
        cmd += ["--steps", str(steps), "--embedding", embedding, "--timeout", str(timeout)]
        cmd += (["--per-step", str(half)] if per == "half" else []) + (["--quick"] if quick else [])
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout + 60, stdin=subprocess.DEVNULL
            )
            records = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
            record = records[-1] if records else {"error": f"no output (exit {proc.returncode})"}
            if proc.returncode != 0 and "error" not in record:
                record = {"error": f"exit {proc.returncode}"}
            if "error" in record:
                sys.stderr.write(f"{label} {name}: {record['error']}\n{proc.stderr[-2000:]}\n")
        except subprocess.TimeoutExpired:
            record = {"error": f"tf_baselines.py ran past {timeout + 60:.0f} s"}
        if "error" in record:
            rows.append((name, {"label": label, "error": f"{record['error']} (role {record.get('role')})"}))
            continue
        summary = {"samples_s": record["median"], "min": record["min"], "max": record["max"]}
        rows.append((name, {"label": label, **summary, "bytes": record["bytes_per_step"]}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny models: a smoke test, meaningless timings")
    ap.add_argument("--workloads", default="W3,W1")
    ap.add_argument("--no-tf", action="store_true", help="skip TensorFlow's rows even if it is installed")
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
        if not a.no_tf:
            rows += tf_ps_rows(name, a.reps, a.steps, a.quick)
    import tf_baselines

    if a.no_tf:
        print("tensorflow: skipped (--no-tf)")
    elif not tf_baselines.tensorflow_available():
        print(
            "tensorflow: not installed; its ParameterServerStrategy is skipped (anchor: W1 ~2,250 samples/s)"
        )
    print(f"{'workload':8s} {'config':22s} {'samples/s':>10s} {'(min-max)':>16s} {'MB/step/worker':>15s}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:8s} {r['label']:22s} failed: {r['error']}")
            continue
        print(
            f"{name:8s} {r['label']:22s} {r['samples_s']:10.0f} ({r['min']:6.0f}-{r['max']:6.0f})"
            f" {r['bytes'] / 1e6:15.3f}"
        )
    for line in tf_ratios(rows):
        print(line)


def tf_ratios(rows: list[tuple[str, dict]]) -> list[str]:
    """``spread / TF`` lines for each TF row that has a spread counterpart in the same run."""
    by_key = {(name, r["label"]): r for name, r in rows}
    lines = []
    for (name, label), r in by_key.items():
        ours = by_key.get((name, TF_PAIRS.get(label, "")))
        if ours is None or "error" in r or "error" in ours:
            continue
        lines.append(
            f"{name} spread {ours['label']} / {label}: {ours['samples_s'] / r['samples_s']:.2f}x samples/s, "
            f"bytes/step {ours['bytes'] / 1e6:.3f} vs {r['bytes'] / 1e6:.3f} MB"
        )
    return lines


if __name__ == "__main__":
    main()
