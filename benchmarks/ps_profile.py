"""Where a ParameterServerStrategy step goes at 512 samples per worker step, and what 2 cores can do.

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/ps_profile.py [--workloads W1,W3] [--steps 40]

Two parts (every process 1 thread):

* ``ceiling``: the pure compute rate of one training process (forward, backward and a local
  optimizer step on 512 samples; W3's table with ``sparse=True``; no parameter server), alone and
  with two such processes side by side (what the 2 training processes of "ps 2w+1s 512/step" could
  reach if communication and the server cost nothing).
* ``profile``: the "ps 2w+1s 512/step" job of ``ps_w3.py`` with timers: on each worker the wall time
  of the row pulls (forward pre-hook), forward+backward without them, the push round trip
  (``optimizer.step()``: encode, send, server, answer, copy-in), and the CPU seconds the worker
  and the server spent per worker step; on the server, the time in the push handler (decode, apply,
  answer encode) and under its lock.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads

PER_STEP = 512


def _compute_rate(name: str, steps: int, barrier=None) -> tuple[float, float]:
    torch.set_num_threads(1)
    model, loss_fn, make_optimizer, make_batch, _ = workloads.make(name)
    if hasattr(model, "table"):
        model.table.sparse = True
    optimizer = make_optimizer(model.parameters())
    x, y = make_batch(PER_STEP)

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    if barrier is not None:
        barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    samples = PER_STEP * steps
    return samples / (time.perf_counter() - start), samples / (time.process_time() - cpu)


def _side_by_side(args: tuple) -> tuple[float, float]:
    name, steps, barrier = args
    return _compute_rate(name, steps, barrier)


def ceiling(name: str, steps: int) -> dict:
    ones = [_compute_rate(name, steps) for _ in range(3)]
    ctx = mp.get_context("spawn")
    twos = []
    for _ in range(3):
        barrier = ctx.Manager().Barrier(2)
        with ctx.Pool(2) as pool:
            rates = pool.map(_side_by_side, [(name, steps, barrier)] * 2)
            twos.append((sum(r[0] for r in rates), sum(r[1] for r in rates)))
    median = statistics.median
    return {
        "one": median(r[0] for r in ones),
        "one_cpu": median(r[1] for r in ones),
        "two": median(r[0] for r in twos),
        "two_cpu": median(r[1] for r in twos),
    }


def _profile_rank(name: str, steps: int) -> dict:

    import spread

    torch.set_num_threads(1)
    strategy = spread.ParameterServerStrategy()
    try:
        with strategy.scope():
            model, loss_fn, make_optimizer, make_batch, _ = workloads.make(name)
            if hasattr(model, "table"):
                model.table.sparse = True
            optimizer = make_optimizer(model.parameters())
        x, y = make_batch(PER_STEP)
        timers = {"pull_rows": 0.0, "push": 0.0}
        client = strategy.client
        for method in ("pull_rows", "push"):
            original = getattr(client, method)

            def timed(*a, _original=original, _key=method, **k):
                t = time.perf_counter()
                try:
                    return _original(*a, **k)
                finally:
                    timers[_key] += time.perf_counter() - t

            setattr(client, method, timed)
        phases = {"step": 0.0, "fwd_bwd": 0.0, "opt_step": 0.0}

        def step() -> None:
            optimizer.zero_grad()
            t0 = time.perf_counter()
            strategy.run(lambda: loss_fn(model(x), y).backward())
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            phases["fwd_bwd"] += t1 - t0
            phases["opt_step"] += t2 - t1
            phases["step"] += t2 - t0

        for _ in range(5):
            step()
        for d in (timers, phases):
            d.update(dict.fromkeys(d, 0.0))
        server = _server_process(strategy.cluster.cluster["ps"][0])
        applied0, server_cpu0 = strategy.server_stats()[0]["applied"], _cpu(server)
        cpu0 = time.process_time()
        for _ in range(steps):
            step()
        cpu = time.process_time() - cpu0
        applied, server_cpu = strategy.server_stats()[0]["applied"] - applied0, _cpu(server) - server_cpu0
        per = {k: 1e3 * v / steps for k, v in {**phases, **timers}.items()}
        per["compute_ms"] = per["fwd_bwd"] - per["pull_rows"]
        per["cpu_ms"] = 1e3 * cpu / steps
        per["rate"] = PER_STEP * steps / phases["step"]
        per["server_cpu_ms_per_push"] = 1e3 * server_cpu / max(applied, 1)
        return per
    finally:
        strategy.close()


def _server_process(address: str):
    """The job's parameter server: the sibling process listening on ``address``'s port."""
    import psutil

    port = int(address.rsplit(":", 1)[1])
    for proc in psutil.Process(os.getppid()).children():
        try:
            if any(c.laddr and c.laddr.port == port and c.status == "LISTEN" for c in proc.net_connections()):
                return proc
        except psutil.Error:
            continue
    raise RuntimeError("no parameter-server process found among this job's processes")


def _cpu(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def profile(name: str, steps: int) -> dict:
    from spread.testing import run_ps_job

    results = run_ps_job(_profile_rank, 2, 1, args=(name, steps), timeout=900)
    failed = [r.describe() for r in results if not r.ok]
    if failed:
        raise RuntimeError("\n".join(failed))
    workers = [r.value for r in results[:2]]
    out = {k: statistics.mean(w[k] for w in workers) for k in workers[0]}
    out["rate"] = sum(w["rate"] for w in workers)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1,W3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--parts", default="ceiling,profile")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{os.cpu_count()} cores; torch {torch.__version__}; 1 thread/process; {PER_STEP} samples/step")
    for name in a.workloads.split(","):
        steps = a.steps if name == "W1" else a.steps * 5
        if "ceiling" in a.parts:
            c = ceiling(name, steps)
            print(
                f"{name} compute only: 1 process {c['one']:.0f} samples/s "
                f"({c['one_cpu']:.0f} per CPU-second); "
                f"2 side by side {c['two']:.0f} ({c['two_cpu']:.0f} per CPU-second of each, summed: what 2 "
                f"free cores would give)"
            )
        if "profile" in a.parts:
            p = profile(name, steps)
            print(
                f"{name} ps 2w+1s 512/step: {p['rate']:.0f} samples/s; per worker step (ms): "
                f"total {p['step']:.2f} = fwd+bwd {p['fwd_bwd']:.2f} (row pulls {p['pull_rows']:.2f}, "
                f"compute {p['compute_ms']:.2f}) + optimizer.step {p['opt_step']:.2f} "
                f"(push round trip {p['push']:.2f}); worker CPU {p['cpu_ms']:.2f}; "
                f"server CPU {p['server_cpu_ms_per_push']:.2f} per push"
            )


if __name__ == "__main__":
    main()
