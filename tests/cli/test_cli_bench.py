"""``spread bench``: the quick run produces the tables, the generated doc section and the raw JSON;
the calibration fit recovers known latency and bandwidth. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spread.cli import _bench_report

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


def test_a_failed_calibration_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    import argparse

    from spread.cli import bench
    from spread.plan import calibration

    def failing(path, *, quick):
        raise calibration.CalibrationError("the all-reduce calibration job failed with exit code 1")

    monkeypatch.setattr(calibration, "calibrate", failing)
    args = argparse.Namespace(calibrate=True, quick=True, output=str(tmp_path / "p.json"))
    assert bench.run(args) == 2
    assert capsys.readouterr().err == "spread bench: the all-reduce calibration job failed with exit code 1\n"


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
