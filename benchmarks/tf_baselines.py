"""TensorFlow baselines for spread's benchmarks: W1 and W3 under TensorFlow's own strategies.

Run as a subprocess by ``benchmarks/ps_w3.py`` and ``benchmarks/throughput.py`` (``spread bench``) when
``tensorflow`` is importable (``pip install tensorflow-cpu==2.21.0``, or the ``bench`` extra); never
imported by ``spread`` itself. Importing this module loads neither TensorFlow nor torch.

    python benchmarks/tf_baselines.py --mode mwms --workload W1 [--workers 2] [--reps 7 --steps 5]
    python benchmarks/tf_baselines.py --mode ps --workload W3 [--per-step 256] [--embedding lookup]

* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (RING), ``--workers`` processes x 1 thread,
  a custom step (``strategy.run`` in a ``tf.function``; Keras ``fit`` fails under MWMS here, see the
  anchors), global batch = the workload's (512), each worker steps on its shard, as spread's MWMS.
* ``ps``: ``tf.distribute.ParameterServerStrategy`` + ``ClusterCoordinator``: ``--ps`` servers,
  ``--workers`` workers and a chief that only coordinates; asynchronous: each scheduled function is one
  step of ``--per-step`` samples on some worker. Servers run intra=1, inter=2 (inter=1 hangs here).
  Bytes per step: the TCP payload in and out of the server processes (``ss -tinp``) over the timed
  repetitions, divided by the steps.

Same model shapes, initial dense weights, synthetic data and SGD (lr 0.01, no momentum) as
``benchmarks/workloads.py``: this launcher builds the torch workload once, saves the batch and dense
weights to a temporary ``.npz`` that every TensorFlow process loads, so no process imports both
frameworks. W3's table is a Keras ``Embedding`` (initialised N(0, 1) like torch's, not copied: 256
MB); ``--embedding lookup`` (default) looks rows up with ``tf.nn.embedding_lookup`` on the table's
variable, so the gather runs on the server and only rows travel; ``--embedding keras`` calls the Keras
layer, which in Keras 3 converts the whole table to a tensor first. The gradient is ``IndexedSlices``
either way and is applied with ``scatter_sub`` on the server.

Every process pins OMP/MKL threads and TF's intra/inter-op threads; every process has a hard watchdog;
the launcher puts each one in its own process group with a parent-death signal, kills them all when
done or after ``--timeout`` seconds, and names the role that failed. Output: one JSON line per figure
on stdout: ``{"figure", "mode", "workload", "unit", "median", "min", "max", "rates", "reps", ...}``, or
``{"figure", "error", "role"}`` (exit status 1) on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spread.testing.ps_jobs import free_ports  # no torch, no TensorFlow: fine in every child

HERE = os.path.dirname(os.path.abspath(__file__))
LR = 0.01
_PR_SET_PDEATHSIG = 1


def tensorflow_available() -> bool:
    """Whether ``tensorflow`` can be imported here (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's options, and the internal ``--role/--index`` a child process runs with."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["mwms", "ps"], required=True)
    ap.add_argument("--workload", type=str.upper, choices=["W1", "W3"], default="W1")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ps", type=int, default=1, help="parameter servers (--mode ps)")
    ap.add_argument(
        "--per-step",
        type=int,
        default=None,
        help="samples per worker step (--mode ps; default: global batch)",
    )
    ap.add_argument("--embedding", choices=["lookup", "keras"], default="lookup", help="W3 table lookup")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--inter", type=int, default=None, help="inter-op threads (default: mwms 1, ps 2)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="steps per repetition (ps: per worker)")
    ap.add_argument("--quick", action="store_true", help="tiny models (workloads.make(quick=True))")
    ap.add_argument("--timeout", type=float, default=300, help="hard limit for the whole job, seconds")
    ap.add_argument("--role", choices=["launcher", "chief", "worker", "ps"], default="launcher")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.inter is None:
        a.inter = 1 if a.mode == "mwms" else 2
    if a.mode == "mwms" and a.workload != "W1":
        ap.error("--mode mwms runs W1 only (W3's 256 MB dense all-reduce is not a TF baseline worth timing)")
    if a.workers < 1 or a.ps < 1 or a.reps < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--workers, --ps, --reps and --steps must be >= 1, --warmup >= 0")
    return a


def roles(mode: str, workers: int, ps: int) -> list[tuple[str, int]]:
    """Processes in start order: servers first, then workers, then the chief (coordinator)."""
    if mode == "mwms":
        return [("worker", i) for i in range(workers)]
    return [("ps", i) for i in range(ps)] + [("worker", i) for i in range(workers)] + [("chief", 0)]


def tf_configs(mode: str, workers: int, ps: int, ports: list[int]) -> dict[tuple[str, int], dict]:
    """``TF_CONFIG`` of every process, on 127.0.0.1 with the given ports (one per process)."""
    procs = roles(mode, workers, ps)
    if len(ports) != len(procs) or len(set(ports)) != len(ports):
        raise ValueError(f"need {len(procs)} distinct ports for {procs}, got {ports}")
    cluster: dict[str, list[str]] = {}
    for (role, _), port in zip(procs, ports, strict=True):
        cluster.setdefault(role, []).append(f"127.0.0.1:{port}")
    return {(r, i): {"cluster": cluster, "task": {"type": r, "index": i}} for r, i in procs}


def figure_name(a: argparse.Namespace) -> str:
    if a.mode == "mwms":
        return f"TensorFlow MultiWorkerMirrored {a.workers} x {a.threads} thread, {a.workload}"
    per = a.per_step or "global batch"
    emb = f", embedding {a.embedding}" if a.workload == "W3" else ""
    return f"TensorFlow ParameterServer {a.workers}w+{a.ps}s, {per}/step, {a.workload}{emb}"


def child_argv(a: argparse.Namespace, role: str, index: int, data: str, out: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--mode", a.mode, "--workload", a.workload]
    argv += ["--workers", str(a.workers), "--ps", str(a.ps), "--embedding", a.embedding]
    argv += ["--threads", str(a.threads), "--inter", str(a.inter), "--warmup", str(a.warmup)]
    argv += ["--reps", str(a.reps), "--steps", str(a.steps), "--timeout", str(a.timeout)]
    argv += ["--per-step", str(a.per_step)] if a.per_step else []
    argv += ["--quick"] if a.quick else []
    return [*argv, "--role", role, "--index", str(index), "--data", data, "--out", out]


def child_env(tf_config: dict, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["TF_CONFIG"] = json.dumps(tf_config)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[key] = str(threads)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ----------------------------------------------------------------------------------------------------
# launcher: data, processes, supervision


def _write_data(a: argparse.Namespace, path: str) -> None:
    """The workload's synthetic global batch and dense initial weights, from workloads.make (torch)."""
    import numpy as np

    sys.path.insert(0, HERE)
    import workloads

    model, _loss, _opt, make_batch, global_batch = workloads.make(a.workload, quick=a.quick)
    x, y = make_batch(global_batch)
    arrays = {"x": x.numpy(), "y": y.numpy().astype(np.int32)}
    if a.workload == "W1":
        linears = [m for m in model if hasattr(m, "weight")]
    else:
        linears = [m for m in model.mlp if hasattr(m, "weight")]
        arrays["table_shape"] = np.array(model.table.weight.shape)
    for k, layer in enumerate(linears):  # Keras Dense kernels are (in, out): torch's weight transposed
        arrays[f"kernel{k}"] = layer.weight.detach().numpy().T.copy()
        arrays[f"bias{k}"] = layer.bias.detach().numpy()
    np.savez(path, global_batch=np.array(global_batch), **arrays)


def _preexec() -> None:
    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_all(procs: dict) -> None:
    for p, _log in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p, _log in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def launch(a: argparse.Namespace) -> int:
    """Start every process of the job, wait for the result (bounded), print it, kill everything."""
    name = figure_name(a)
    start = time.monotonic()
    if not tensorflow_available():
        print(json.dumps({"figure": name, "error": "tensorflow not installed", "role": None}), flush=True)
        return 1
    with tempfile.TemporaryDirectory(prefix="spread-tf-") as tmp:
        data, out = os.path.join(tmp, "data.npz"), os.path.join(tmp, "result.jsonl")
        _write_data(a, data)
        procs_order = roles(a.mode, a.workers, a.ps)
        configs = tf_configs(a.mode, a.workers, a.ps, free_ports(len(procs_order)))
        procs: dict[str, tuple[subprocess.Popen, str]] = {}
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def on_signal(signum, _frame):
            _kill_all(procs)
            raise SystemExit(128 + signum)

        for s in old:
            signal.signal(s, on_signal)
        error = role_failed = None
        try:
            for role, index in procs_order:
                log = os.path.join(tmp, f"{role}{index}.log")
                with open(log, "w") as logf:
                    p = subprocess.Popen(
                        child_argv(a, role, index, data, out),
                        env=child_env(configs[(role, index)], a.threads),
                        stdin=subprocess.DEVNULL,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        preexec_fn=_preexec,
                    )
                procs[f"{role}{index}"] = (p, log)
            # the processes whose clean exit means "done": the chief (ps) or every worker (mwms)
            finishers = ["chief0"] if a.mode == "ps" else [f"worker{i}" for i in range(a.workers)]
            while True:
                for label, (p, _log) in procs.items():
                    rc = p.poll()
                    if rc is not None and (rc != 0 or label not in finishers):
                        error, role_failed = f"{label} exited with status {rc}", label
                        break
                if error or all(procs[f][0].poll() == 0 for f in finishers):
                    break
                if time.monotonic() - start > a.timeout:
                    running = [lbl for lbl, (p, _) in procs.items() if p.poll() is None]
                    error = f"no result within {a.timeout:.0f} s; still running: {', '.join(running)}"
                    role_failed = running[-1] if running else None
                    break
                time.sleep(0.2)
        finally:
            _kill_all(procs)
            for s, h in old.items():
                signal.signal(s, h)
        if error:
            for label, (_p, log) in procs.items():
                if label == role_failed or role_failed is None or "still running" in error:
                    sys.stderr.write(f"[tf_baselines {label}] last lines:\n{_tail(log)}\n")
            print(json.dumps({"figure": name, "error": error, "role": role_failed}), flush=True)
            return 1
        lines = Path(out).read_text().splitlines() if os.path.exists(out) else []
        if not lines:
            print(json.dumps({"figure": name, "error": "finished without a result", "role": None}))
            return 1
        for line in lines:
            record = json.loads(line)
            record["wall_s"] = round(time.monotonic() - start, 1)
            if os.path.exists(out + ".checksums"):  # mwms: every replica ends with the same weights
                sums = [float(v) for v in Path(out + ".checksums").read_text().split()]
                record["replicas_in_sync"] = len(sums) == a.workers and max(sums) - min(sums) <= 1e-4 * max(
                    1.0, abs(sums[0])
                )
            print(json.dumps(record), flush=True)
        return 0


# ----------------------------------------------------------------------------------------------------
# TensorFlow processes (TensorFlow is imported only below, in the children)


def _watchdog(seconds: float, what: str) -> None:
    import threading

    def fire():
        time.sleep(seconds)
        sys.stderr.write(f"[tf_baselines watchdog] {what} still running after {seconds:.0f} s, exiting\n")
        sys.stderr.flush()
        os._exit(124)

    threading.Thread(target=fire, daemon=True).start()


def _import_tf(a: argparse.Namespace):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.inter)
    return tf


def _emit(a: argparse.Namespace, record: dict[str, Any]) -> None:
    with open(a.out, "a") as f:
        f.write(json.dumps(record) + "\n")


def _summary(a: argparse.Namespace, rates: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "figure": figure_name(a),
        "mode": a.mode,
        "workload": a.workload,
        "unit": "samples/s",
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "reps": len(rates),
        "rates": rates,
        "processes": {"mwms": a.workers, "ps": a.workers + a.ps + 1}[a.mode],
        "threads": a.threads,
        "inter": a.inter,
        **extra,
    }


class _Model:
    """W1 or W3 as Keras layers (built, weights from the .npz); ``forward(x)`` returns logits."""

    def __init__(self, tf, a: argparse.Namespace, d) -> None:
        import keras

        self.tf, self.a = tf, a
        n_dense = 3 if a.workload == "W1" else 2
        kernels = [d[f"kernel{k}"] for k in range(n_dense)]
        self.dense = [
            keras.layers.Dense(k.shape[1], activation="relu" if i < n_dense - 1 else None)
            for i, k in enumerate(kernels)
        ]
        for layer, k in zip(self.dense, kernels, strict=True):
            layer.build((None, k.shape[0]))
        self.embedding = None
        if a.workload == "W3":
            rows, dim = (int(v) for v in d["table_shape"])
            self.embedding = keras.layers.Embedding(
                rows, dim, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=0)
            )
            self.embedding.build((None, 8))
        for k, layer in enumerate(self.dense):
            layer.kernel.assign(d[f"kernel{k}"])
            layer.bias.assign(d[f"bias{k}"])
        self.variables = [v for layer in self._layers() for v in layer.trainable_variables]
        # the tf.Variables under Keras 3's wrappers (for assign_sub / scatter_sub on the server)
        self.tf_variables = [getattr(v, "_value", v) for v in self.variables]

    def _layers(self):
        return ([self.embedding] if self.embedding is not None else []) + self.dense

    def forward(self, x):
        tf = self.tf
        h = x
        if self.embedding is not None:
            if self.a.embedding == "lookup":
                rows = tf.nn.embedding_lookup(self.tf_variables[0], x)
            else:
                rows = self.embedding(x)
            h = tf.reduce_mean(rows, axis=1)
        for layer in self.dense:
            h = layer(h)
        return h


def _server_bytes(ports: list[int]) -> int:
    """TCP payload bytes sent + received by the processes listening on ``ports`` (``ss -tinp``): every
    connection of theirs, whichever side opened it (TF's receiver pulls tensors from the sender)."""

    def ss(*args: str) -> str:
        return subprocess.run(["ss", *args], capture_output=True, text=True, timeout=20).stdout

    pids = set()
    for port in ports:
        pids.update(re.findall(r"pid=(\d+)", ss("-tlnpH", f"( sport = :{port} )")))
    total, owner = 0, None
    for line in ss("-tinpH", "state", "established").splitlines():
        if line[:1].strip():  # a socket's first line: addresses and owner
            owner = set(re.findall(r"pid=(\d+)", line))
        elif owner and owner & pids:
            total += sum(int(v) for v in re.findall(r"bytes_(?:sent|received):(\d+)", line))
    return total


def run_ps_chief(a: argparse.Namespace) -> None:
    """The coordinator: variables on the servers, steps scheduled asynchronously on the workers."""
    import numpy as np

    tf = _import_tf(a)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = None
    if a.ps > 1:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=a.ps
        )
    t0 = time.perf_counter()
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    d = np.load(a.data)
    per = a.per_step or int(d["global_batch"])
    if not 0 < per <= len(d["x"]):
        raise ValueError(f"--per-step {per}: the synthetic batch has {len(d['x'])} samples")
    x, y = d["x"][:per], d["y"][:per]
    with strategy.scope():
        model = _Model(tf, a, d)
    setup_s = time.perf_counter() - t0

    def dataset_fn():
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def worker_fn(it):
        xb, yb = next(it)
        with tf.GradientTape() as tape:
            logits = model.forward(xb)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        grads = tape.gradient(loss, model.tf_variables)
        for v, g in zip(model.tf_variables, grads, strict=True):
            if isinstance(g, tf.IndexedSlices):
                v.scatter_sub(tf.IndexedSlices(LR * g.values, g.indices, g.dense_shape))
            else:
                v.assign_sub(LR * g)
        return loss

    for _ in range(max(a.warmup, 1) * a.workers):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    ps_ports = [int(addr.rsplit(":", 1)[1]) for addr in json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"]]
    bytes_before = _server_bytes(ps_ports)
    rates = []
    n = a.steps * a.workers  # scheduled steps per repetition, over all workers
    for _ in range(a.reps):
        start = time.perf_counter()
        results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(n)]
        coordinator.join()
        rates.append(n * per / (time.perf_counter() - start))
    moved = _server_bytes(ps_ports) - bytes_before
    loss = float(results[-1].fetch())
    _emit(
        a,
        _summary(
            a,
            rates,
            per_step=per,
            bytes_per_step=moved / (n * a.reps),
            last_loss=loss,
            setup_s=round(setup_s, 2),
            note=f"{n} scheduled steps per rep (async, {a.workers} workers), servers intra={a.threads} "
            f"inter={a.inter}; bytes: TCP payload of the server processes per step",
        ),
    )
    sys.stdout.flush()
    os._exit(0)  # the coordinator's threads would keep the interpreter alive


def run_ps_server(a: argparse.Namespace, role: str) -> None:
    import tensorflow as tf

    cfg = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=a.threads, inter_op_parallelism_threads=a.inter
    )
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=role, task_index=a.index, protocol="grpc", config=cfg, start=True
    )
    server.join()


def run_mwms_worker(a: argparse.Namespace) -> None:
    import numpy as np

    tf = _import_tf(a)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    d = np.load(a.data)
    global_batch = int(d["global_batch"])
    per = global_batch // a.workers
    x = tf.constant(d["x"][a.index * per : (a.index + 1) * per])
    y = tf.constant(d["y"][a.index * per : (a.index + 1) * per])
    import keras

    with strategy.scope():
        model = _Model(tf, a, d)
        opt = keras.optimizers.SGD(learning_rate=LR)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model.forward(xb)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.variables)
        opt.apply_gradients(zip(grads, model.variables, strict=True))
        return loss

    @tf.function
    def step():
        return strategy.run(replica_step, args=(x, y))

    def finish(loss):
        return [float(t.numpy()) for t in strategy.experimental_local_results(loss)]

    for _ in range(a.warmup):
        finish(step())
    rates = []
    for _ in range(a.reps):
        start = time.perf_counter()
        for _ in range(a.steps):
            loss = step()
        last = finish(loss)
        rates.append(a.steps * global_batch / (time.perf_counter() - start))
    checksum = float(sum(float(tf.reduce_sum(v)) for v in model.variables))
    with open(a.out + ".checksums", "a") as f:  # the launcher checks that the replicas agree
        f.write(f"{checksum!r}\n")
    if a.index == 0:
        grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.variables)
        _emit(
            a,
            _summary(
                a,
                rates,
                global_batch=global_batch,
                bytes_per_step=grad_bytes,
                last_loss=last[0],
                note=f"RING all-reduce; intra={a.threads} inter={a.inter}; "
                "bytes: the gradient each rank all-reduces",
            ),
        )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.role == "launcher":
        return launch(a)
    _watchdog(a.timeout + 30, f"{a.role}{a.index}")
    if a.mode == "ps" and a.role == "chief":
        run_ps_chief(a)
    elif a.mode == "ps":
        run_ps_server(a, a.role)
    else:
        run_mwms_worker(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
