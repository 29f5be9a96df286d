"""``spread plan`` on a slow network: two pretend hosts (network namespaces, rate-limited links).

Calibrates the all-reduce algorithms and the parameter servers' transport across two hosts, then
measures W1 (dense) and W3 (sparse embedding) under MultiWorkerMirroredStrategy across two hosts and
under ParameterServerStrategy across three (chief, worker and server each on its own host, started
from a TF_CONFIG per host, as on a real cluster), and compares each with the planner's prediction for
that cluster and network. Needs root (see netns_cluster.py).

    sudo python benchmarks/plan_netns.py [--rate 1gbit] [--workloads W1,W3] [--steps 3] [--no-ps]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import block_workloads  # noqa: E402
from netns_cluster import NetnsCluster  # noqa: E402

from spread.plan.calibration import fit_link  # noqa: E402
from spread.plan.cluster import ClusterModel  # noqa: E402
from spread.plan.predict import Candidate, Options, predict  # noqa: E402
from spread.plan.workload import measure_model  # noqa: E402

PORT = 29561


def _on_both_hosts(cluster: NetnsCluster, target: list[str], timeout: float, hosts: int = 2) -> None:
    """Run ``spread run -n 1`` of ``target`` on each of ``hosts`` as one job; raise if any fails."""
    env = {**os.environ, "SPREAD_JOB_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    procs = []
    for host in range(hosts):
        cmd = [sys.executable, "-m", "spread.cli.main", "run", "-n", "1", "--nnodes", str(hosts),
               "--node-rank", str(host), "--master-addr", cluster.address(0), "--master-port", str(PORT),
               *target]  # fmt: skip
        procs.append(
            cluster.popen(host, cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    _wait_all(procs, timeout)


def _ps_job(cluster: NetnsCluster, target: list[str], timeout: float) -> None:
    """Chief on host 0, worker on host 1, parameter server on host 2: one TF_CONFIG per host."""
    roles = [("chief", 0), ("worker", 0), ("ps", 0)]
    spec = {role: [f"{cluster.address(host)}:{PORT + 1}"] for host, (role, _) in enumerate(roles)}
    env = {**os.environ, "SPREAD_JOB_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    procs = []
    for host, (role, index) in enumerate(roles):
        tf_config = json.dumps({"cluster": spec, "task": {"type": role, "index": index}})
        procs.append(
            cluster.popen(
                host,
                [sys.executable, *target],
                {**env, "TF_CONFIG": tf_config},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    _wait_all(procs, timeout)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a host failed (exit {p.returncode}):\n{out[-2000:]}")


def _both(prediction, contention: float) -> tuple[float, float]:
    """The predicted step, and the same with its compute slowed by ``contention`` (shared cores)."""
    compute = prediction.parts.get("compute", 0.0)
    return prediction.step_seconds, prediction.step_seconds + (contention - 1.0) * compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-ps", action="store_true", help="skip the parameter-server runs (3 hosts)")
    args = parser.parse_args()
    rows = []
    hosts = 2 if args.no_ps else 3
    with NetnsCluster(hosts=hosts, rate=args.rate) as cluster, tempfile.TemporaryDirectory() as folder:
        links_file = os.path.join(folder, "links.json")
        sizes = ",".join(str(s) for s in (4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20))
        _on_both_hosts(cluster, ["-m", "spread.plan._calibration_worker", "--output", links_file,
                                 "--sizes", sizes, "--reps", "3"], args.timeout)  # fmt: skip
        measured_links = json.loads(Path(links_file).read_text())
        fitted = {
            name: fit_link(name, [tuple(s) for s in samples])
            for name, samples in measured_links["samples"].items()
        }
        if len(measured_links.get("ps", [])) >= 2:  # one push on the parameter servers' transport
            fitted["ps"] = fit_link("ps", [tuple(s) for s in measured_links["ps"]])
        network = fitted["native"]
        print(f"network fit: alpha {network.alpha * 1e6:.0f} us, beta {network.beta / 1e6:.0f} MB/s "
              f"(link rate {args.rate}); overlap {measured_links['overlap']}")  # fmt: skip
        if "ps" in fitted:
            print(f"ps transport fit: alpha {fitted['ps'].alpha * 1e6:.0f} us, "
                  f"beta {fitted['ps'].beta / 1e6:.0f} MB/s")  # fmt: skip
        model_cluster = ClusterModel(
            nodes=2,
            devices_per_node=1,
            cores_per_node=1,
            inter=network,
            inter_by_algorithm=fitted,
            overlap=measured_links["overlap"],
        )
        for name in args.workloads.split(","):
            model, loss_fn, make_optimizer, make_batch, global_batch = block_workloads.make(name)
            x, y = make_batch(global_batch)
            cores = (1, os.cpu_count() or 1)  # the machine's cores bound the contention measurement
            profile = measure_model(model, loss_fn, x, y, optimizer=make_optimizer(model.parameters()),
                                    threads=cores, concurrency=(2,), name=name)  # fmt: skip
            # The pretend hosts share this machine's cores: two training processes slow each other
            # as measured by the profile's contention, which a real 2-host cluster would not see.
            shared = profile.contention_factor(2)
            for algorithm in ("native", "ring"):
                out = os.path.join(folder, f"{name}-{algorithm}.json")
                worker = [str(HERE / "_validation_worker.py"), "--workload", name, "--strategy",
                          "multi_worker_mirrored", "--communication", algorithm, "--steps", str(args.steps),
                          "--output", out]  # fmt: skip
                _on_both_hosts(cluster, worker, args.timeout)
                measured = json.loads(Path(out).read_text())["step_seconds"]
                candidate = Candidate("multi_worker_mirrored", 2, (("communication", algorithm),))
                predicted = predict(candidate, profile, model_cluster, Options(global_batch=global_batch))
                rows.append((name, f"{candidate.label}, 2 hosts", *_both(predicted, shared), measured))
                print(rows[-1], file=sys.stderr)
            if args.no_ps:
                continue
            out = os.path.join(folder, f"{name}-ps.json")
            _ps_job(cluster, [str(HERE / "_validation_worker.py"), "--workload", name, "--strategy",
                              "parameter_server", "--steps", str(args.steps), "--output", out],
                    args.timeout)  # fmt: skip
            measured = json.loads(Path(out).read_text())["step_seconds"]
            candidate = Candidate("parameter_server", 3, (("servers", 1),))
            ps_cluster = replace(model_cluster, nodes=3)
            predicted = predict(candidate, profile, ps_cluster, Options(global_batch=global_batch))
            label = f"{candidate.label}, chief + worker + server on 3 hosts"
            rows.append((name, label, *_both(predicted, shared), measured))
            print(rows[-1], predicted.note, file=sys.stderr)
    print("\nPS rows: the step is one worker's step on its 256 samples (2 workers step at once, async);")
    print("all-reduce rows: one synchronous step of 512 samples over the 2 hosts.")
    print("'shared CPU': the same prediction with the compute slowed by the profile's contention factor for")
    print("2 replicas, because the pretend hosts run on the same 2 cores.")
    print(f"\n| workload | configuration ({args.rate} links) | predicted ms | predicted ms, shared CPU | "
          "measured ms | error | error, shared CPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, label, predicted, with_sharing, measured in rows:
        cells = [f"{v * 1e3:.0f}" for v in (predicted, with_sharing, measured)]
        errors = [f"{v / measured - 1:+.0%}" for v in (predicted, with_sharing)]
        print(f"| {name} | {label} | " + " | ".join(cells + errors) + " |")


if __name__ == "__main__":
    main()
