"""TensorFlow's asynchronous ParameterServerStrategy on ``benchmarks/ps_staleness.py``'s job, one worker
stopped for 2 s: the TensorFlow row of that benchmark (run by it, one run per call; never imported by
``spread``). Importing this module loads neither TensorFlow nor torch.

    python benchmarks/tf_ps_staleness.py --data digits.npz --stop-at 17 [--epochs 6]

The ``.npz`` (written by ``ps_staleness.py`` with torch: the same digits split and permutation and
the same initial weights as spread's job) is all a TensorFlow process reads. The job: two servers,
two workers and a chief that only coordinates (``tf.distribute.ParameterServerStrategy`` +
``ClusterCoordinator``); the 64-64-10 ReLU MLP as plain ``tf.Variable``s, placed round-robin on the
servers; each scheduled function is one step of 32 samples from the worker's own shuffled copy of the
1400 training samples: gradient of the mean cross-entropy, then torch's SGD with momentum
(``buf = 0.9 buf + g; w -= 0.1 buf``) read-modify-written on the servers' variables without locks,
as TensorFlow's asynchronous training does. ``ceil(epochs * 1400 / 32)`` steps are scheduled at
once; when ``2 * stop_at`` steps have finished (the workers share them about evenly, so worker 1 is
near its ``stop_at``-th step), the chief SIGSTOPs worker 1 and a child sends SIGCONT 2 s later. Then
the chief waits for every step and prints validation accuracy on the other 397 samples.

Process handling is ``tf_baselines.py``'s: TF_CONFIG, thread settings (intra=1, inter=2 everywhere;
servers run ``tf_baselines.run_ps_server``), process groups with a parent-death signal, watchdogs,
killing everything when done or after ``--timeout``. Output: one JSON line, ``{"accuracy", ...}``, or
``{"error", "role"}`` with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_baselines as tfb  # no TensorFlow, no torch at import

LR, MOMENTUM, PER_STEP, TRAIN = 0.1, 0.9, 32, 1400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help=".npz from ps_staleness.py")
    ap.add_argument("--stop-at", type=int, required=True, help="worker 1's step to stop at (about)")
    ap.add_argument("--stop-seconds", type=float, default=2.0)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300, help="hard limit for the whole job, seconds")
    ap.add_argument("--role", choices=["launcher", "chief", "worker", "ps"], default="launcher")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--stop-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.threads, a.inter = 1, 2  # tf_baselines' settings (servers with inter=1 hang here)
    return a


def _child_argv(a: argparse.Namespace, role: str, index: int, out: str, stop_pid: int = 0) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--data", a.data, "--stop-at", str(a.stop_at)]
    argv += ["--stop-seconds", str(a.stop_seconds), "--epochs", str(a.epochs), "--timeout", str(a.timeout)]
    return [*argv, "--role", role, "--index", str(index), "--out", out, "--stop-pid", str(stop_pid)]


def launch(a: argparse.Namespace) -> int:
    """Servers, workers, then the chief (told worker 1's pid); wait for the chief (bounded); kill all."""
    start = time.monotonic()
    if not tfb.tensorflow_available():
        print(json.dumps({"error": "tensorflow not installed", "role": None}), flush=True)
        return 1
    order = tfb.roles("ps", 2, 2)
    configs = tfb.tf_configs("ps", 2, 2, tfb.free_ports(len(order)))
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, _frame):
        tfb._kill_all(procs)
        raise SystemExit(128 + signum)

    for s in old:
        signal.signal(s, on_signal)
    error = failed = None
    with tempfile.TemporaryDirectory(prefix="spread-tf-stale-") as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            for role, index in order:
                log = os.path.join(tmp, f"{role}{index}.log")
                stop_pid = procs["worker1"][0].pid if role == "chief" else 0
                with open(log, "w") as logf:
                    p = subprocess.Popen(
                        _child_argv(a, role, index, out, stop_pid),
                        env=tfb.child_env(configs[(role, index)], a.threads),
                        stdin=subprocess.DEVNULL,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        preexec_fn=tfb._preexec,
                    )
                procs[f"{role}{index}"] = (p, log)
            while True:
                for label, (p, _log) in procs.items():
                    rc = p.poll()
                    if rc is not None and (rc != 0 or label != "chief0"):
                        error, failed = f"{label} exited with status {rc}", label
                        break
                if error or procs["chief0"][0].poll() == 0:
                    break
                if time.monotonic() - start > a.timeout:
                    running = [lbl for lbl, (p, _) in procs.items() if p.poll() is None]
                    error = f"no result within {a.timeout:.0f} s; still running: {', '.join(running)}"
                    break
                time.sleep(0.2)
        finally:
            tfb._kill_all(procs)
            for s, h in old.items():
                signal.signal(s, h)
        if error or not os.path.exists(out):
            for label, (_p, log) in procs.items():
                if failed is None or label == failed:
                    sys.stderr.write(f"[tf_ps_staleness {label}] last lines:\n{tfb._tail(log)}\n")
            print(json.dumps({"error": error or "finished without a result", "role": failed}), flush=True)
            return 1
        with open(out) as f:
            record = json.load(f)
    record["wall_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(record), flush=True)
    return 0


def run_chief(a: argparse.Namespace) -> None:
    import numpy as np

    tf = tfb._import_tf(a)
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    d = np.load(a.data)
    x_train, y_train = d["x"][:TRAIN], d["y"][:TRAIN]
    names = ("kernel0", "bias0", "kernel1", "bias1")
    with strategy.scope():  # round-robin over the two servers
        weights = [tf.Variable(d[k], name=k) for k in names]
        velocity = [tf.Variable(np.zeros_like(d[k]), name=f"{k}_momentum") for k in names]
        done = tf.Variable(0, dtype=tf.int64, name="steps_done")

    def dataset_fn():
        data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        return data.shuffle(TRAIN, reshuffle_each_iteration=True).repeat().batch(PER_STEP)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def worker_fn(it):
        xb, yb = next(it)
        with tf.GradientTape() as tape:
            logits = tf.nn.relu(xb @ weights[0] + weights[1]) @ weights[2] + weights[3]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        grads = tape.gradient(loss, weights)
        for w, v, g in zip(weights, velocity, grads, strict=True):
            buf = MOMENTUM * v + g  # torch's SGD momentum, no dampening, no Nesterov
            v.assign(buf)
            w.assign_sub(LR * buf)
        done.assign_add(1)
        return loss

    steps = math.ceil(a.epochs * TRAIN / PER_STEP)
    started = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(worker_fn, args=(iterator,))
    stopped_after = None
    threshold = min(2 * a.stop_at, steps - 2)
    while True:
        seen = int(done.read_value().numpy())
        if seen >= threshold:
            os.kill(a.stop_pid, signal.SIGSTOP)
            subprocess.Popen(["sh", "-c", f"sleep {a.stop_seconds}; kill -CONT {a.stop_pid}"])
            stopped_after = seen
            break
        time.sleep(0.01)
    coordinator.join()
    took = time.perf_counter() - started
    k0, b0, k1, b1 = (w.numpy() for w in weights)
    x_val, y_val = d["x"][TRAIN:], d["y"][TRAIN:]
    logits = np.maximum(x_val @ k0 + b0, 0) @ k1 + b1
    accuracy = float((logits.argmax(1) == y_val).mean())
    record = {
        "accuracy": accuracy,
        "steps": steps,
        "steps_done": int(done.numpy()),
        "stopped_after": stopped_after,
        "train_s": round(took, 2),
    }
    with open(a.out, "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    os._exit(0)  # the coordinator's threads would keep the interpreter alive


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.role == "launcher":
        return launch(a)
    tfb._watchdog(a.timeout + 30, f"{a.role}{a.index}")
    if a.role == "chief":
        run_chief(a)
    else:
        tfb.run_ps_server(a, a.role)
    return 0


if __name__ == "__main__":
    sys.exit(main())
