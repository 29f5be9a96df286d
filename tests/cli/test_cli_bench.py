"""``spread bench``: the quick run produces the tables, the generated doc section and the raw JSON;
the calibration fit recovers known latency and bandwidth. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spread.cli import _bench_calibrate, _bench_report

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.processes
def test_quick_run_writes_tables_section_and_json(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written text stays.\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spread.cli.main",
            "bench",
            "--quick",
            "--doc",
            str(doc),
            "--json",
            str(tmp_path / "raw.json"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| configuration | processes x threads | samples/s median |" in result.stdout
    assert "| size | native | ring |" in result.stdout
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written text stays.\n")
    assert _bench_report.BEGIN in text and _bench_report.END in text
    for config in (
        "PyTorch DDP 2 x 1 thread",
        "communication=auto",
        "cross_device_ops=hierarchical_copy",
        "one process, 2 threads",
        'spread Sharded 2 x 1 thread, shard="parameters"',
        "PyTorch FSDP2 (fully_shard) 2 x 1 thread",
    ):
        assert config in text
    raw = json.loads((tmp_path / "raw.json").read_text())
    rows = raw["throughput"]["W1"]["rows"]
    assert {r["kind"] for r in rows} == {
        "single",
        "mirrored",
        "ddp",
        "mwms",
        "sharded",
        "fsdp2",
        "tensorflow",
    }
    assert "spread Sharded / PyTorch FSDP2 throughput, paired by round: **" in text
    assert all(rate > 0 for r in rows for rate in r["rates"])
    (tf_row,) = [r for r in rows if r["kind"] == "tensorflow"]  # --quick never starts TensorFlow
    assert tf_row["rates"] == [] and tf_row["skipped"] == "skipped: not run with --quick"
    assert "| skipped: not run with --quick |" in text
    if _has_matplotlib():
        assert (tmp_path / "img" / "bench.png").stat().st_size > 1000


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_rerun_replaces_the_generated_section_only(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("before\n")
    _bench_report.write_section(doc, "first")
    doc.write_text(doc.read_text() + "after\n")
    _bench_report.write_section(doc, "second")
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n")
    assert "second" in text and "first" not in text and text.count(_bench_report.BEGIN) == 1


def test_alpha_beta_fit_recovers_a_known_link():
    alpha, beta = 50e-6, 2e9
    samples = [(s, alpha + s / beta) for s in (4 << 10, 64 << 10, 1 << 20, 16 << 20)]
    got_alpha, got_beta = _bench_calibrate.fit_alpha_beta(samples)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="two timed sizes"):
        _bench_calibrate.fit_alpha_beta(samples[:1])


def test_profile_document_has_schema_and_every_algorithm():
    allreduce = {
        "nprocs": 2,
        "sizes": [1024, 2048],
        "seconds": {"native": {"1024": 1e-4, "2048": 1.5e-4}, "shm": {"1024": 1e-5, "2048": 1.2e-5}},
    }
    doc = _bench_calibrate.profile(allreduce, machine={"cores": 2}, quick=True, flops=1e10)
    assert doc["schema_version"] == _bench_calibrate.SCHEMA_VERSION and doc["ranks"] == 2
    assert set(doc["allreduce"]) == {"native", "shm"}
    assert all(link["alpha"] >= 0 and link["beta"] > 0 for link in doc["allreduce"].values())
    assert doc["compute"]["matmul_flops"] == 1e10


@pytest.mark.processes
def test_calibrate_writes_its_own_profile_without_the_planner(tmp_path, monkeypatch):
    import argparse

    from spread.cli import bench

    real_import = bench.importlib.import_module

    def no_planner(name, *args, **kwargs):
        if name == "spread.plan.calibration":
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(bench.importlib, "import_module", no_planner)
    out = tmp_path / "profile.json"
    args = argparse.Namespace(calibrate=True, quick=True, output=str(out), benchmarks=None, timeout=240)
    assert bench.run(args) == 0
    profile = json.loads(out.read_text())
    assert profile["schema_version"] == 1 and profile["kind"] == _bench_calibrate.KIND
    assert {"native", "ring", "shm", "hierarchical", "reduce_to_one"} <= set(profile["allreduce"])
    assert profile["compute"]["matmul_flops"] > 0


def test_ratios_are_paired_by_round_when_rounds_are_given():
    """A machine that slows down in one round must not turn a 1.1x configuration into 3x: the ratio
    is taken within each round, then the median over rounds."""
    base = {"config": "one", "kind": "single", "processes": 1, "threads": 1, "rounds": [[50], [50], [150]]}
    ddp = {"config": "ddp", "kind": "ddp", "processes": 2, "threads": 1, "rounds": [[100], [100], [300]]}
    fast = {"config": "x", "kind": "mwms", "processes": 2, "threads": 1, "rounds": [[110], [300], [330]]}
    for row in (base, ddp, fast):
        row["rates"] = [x for r in row["rounds"] for x in r]
    rows = {r["config"]: r for r in _bench_report.throughput_rows({"rows": [base, ddp, fast]})}
    assert rows["x"]["vs_ddp"] == pytest.approx(1.1)  # the overall medians would say 300 / 100 = 3x
    assert rows["x"]["efficiency"] == pytest.approx(1.1)  # 110 / 50 / 2 per round
    assert rows["ddp"]["vs_ddp"] == pytest.approx(1.0)
    unpaired = {**fast, "rounds": None}
    (row,) = [r for r in _bench_report.throughput_rows({"rows": [ddp, unpaired]}) if r["config"] == "x"]
    assert row["vs_ddp"] == pytest.approx(3.0)  # no rounds: the ratio of the medians, as before
