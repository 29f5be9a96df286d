"""``spread plan`` on a slow network: two pretend hosts (network namespaces, rate-limited links).

Calibrates the all-reduce algorithms across the two hosts, then measures W1 (dense) and W3 (sparse
embedding) under MultiWorkerMirroredStrategy across them and compares with the planner's prediction
for a 2-node cluster with that network. Needs root (see netns_cluster.py).

    sudo python benchmarks/plan_netns.py [--rate 1gbit] [--workloads W1,W3] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
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


def _on_both_hosts(cluster: NetnsCluster, target: list[str], timeout: float) -> None:
    """Run ``spread run -n 1`` of ``target`` on each host as one 2-node job; raise if any fails."""
    env = {**os.environ, "SPREAD_JOB_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    procs = []
    for host in range(cluster.hosts):
        cmd = [sys.executable, "-m", "spread.cli.main", "run", "-n", "1", "--nnodes", str(cluster.hosts),
               "--node-rank", str(host), "--master-addr", cluster.address(0), "--master-port", str(PORT),
               *target]  # fmt: skip
        procs.append(
            cluster.popen(host, cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    rows = []
    with NetnsCluster(hosts=2, rate=args.rate) as cluster, tempfile.TemporaryDirectory() as folder:
        links_file = os.path.join(folder, "links.json")
        sizes = ",".join(str(s) for s in (4 << 10, 256 << 10, 4 << 20, 16 << 20))
        _on_both_hosts(cluster, ["-m", "spread.plan._calibration_worker", "--output", links_file,
                                 "--sizes", sizes, "--reps", "3"], args.timeout)  # fmt: skip
        measured_links = json.loads(Path(links_file).read_text())
        fitted = {
            name: fit_link(name, [tuple(s) for s in samples])
            for name, samples in measured_links["samples"].items()
        }
        network = fitted["native"]
        print(f"network fit: alpha {network.alpha * 1e6:.0f} us, beta {network.beta / 1e6:.0f} MB/s "
              f"(link rate {args.rate}); overlap {measured_links['overlap']}")  # fmt: skip
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
            profile = measure_model(model, loss_fn, x, y, optimizer=make_optimizer(model.parameters()),
                                    threads=(1,), name=name)  # fmt: skip
            for algorithm in ("native", "ring"):
                out = os.path.join(folder, f"{name}-{algorithm}.json")
                worker = [str(HERE / "_validation_worker.py"), "--workload", name, "--strategy",
                          "multi_worker_mirrored", "--communication", algorithm, "--steps", str(args.steps),
                          "--output", out]  # fmt: skip
                _on_both_hosts(cluster, worker, args.timeout)
                measured = json.loads(Path(out).read_text())["step_seconds"]
                candidate = Candidate("multi_worker_mirrored", 2, (("communication", algorithm),))
                predicted = predict(candidate, profile, model_cluster, Options(global_batch=global_batch))
                rows.append((name, candidate.label, predicted.step_seconds, measured))
                print(rows[-1], file=sys.stderr)
    print(f"\n| workload | configuration (2 hosts, {args.rate}) | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|")
    for name, label, predicted, measured in rows:
        error = predicted / measured - 1
        print(f"| {name} | {label} | {predicted * 1e3:.0f} | {measured * 1e3:.0f} | {error:+.0%} |")


if __name__ == "__main__":
    main()
