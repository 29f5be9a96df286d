"""The TensorFlow rows of ``benchmarks/ps_w3.py`` and ``benchmarks/throughput.py`` (``spread bench``):
skipped cleanly, with the reason in the table, where TensorFlow is not installed; ratios spread / TF."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ps_w3  # noqa: E402
import tf_baselines  # noqa: E402
import throughput  # noqa: E402

from spread.cli import _bench_report  # noqa: E402


@pytest.fixture
def no_tensorflow(monkeypatch):
    monkeypatch.setattr(tf_baselines, "tensorflow_available", lambda: False)


def test_ps_w3_has_no_tf_rows_without_tensorflow(no_tensorflow):
    assert ps_w3.tf_ps_rows("W1", 1, 1, quick=True) == []


def test_spread_bench_row_says_tensorflow_is_not_installed(no_tensorflow):
    result = throughput.run_tensorflow("W1", False, 1, 1, 1, timeout=60)
    (row,) = result["rows"]
    assert row["kind"] == "tensorflow" and row["rates"] == []
    assert row["skipped"] == "skipped: tensorflow not installed"
    ddp = {"config": "PyTorch DDP 2 x 1 thread", "kind": "ddp", "processes": 2, "threads": 1, "rates": [10.0]}
    table = _bench_report.throughput_table({**result, "rows": [ddp, row]})
    assert f"| {throughput.TF_CONFIG_NAME} | 2 x 1 | skipped: tensorflow not installed | | | | | |" in table
    assert "| PyTorch DDP 2 x 1 thread | 2 x 1 | 10 |" in table


def test_ratios_pair_each_tf_row_with_its_spread_row():
    rows = [
        ("W1", {"label": "ps 2w+1s", "samples_s": 3000.0, "bytes": 46.6e6}),
        ("W1", {"label": "ps 2w+1s 512/step", "samples_s": 4000.0, "bytes": 46.6e6}),
        ("W1", {"label": "tf ps 2w+1s", "samples_s": 2000.0, "bytes": 46.7e6}),
        ("W1", {"label": "tf ps 2w+1s 512/step", "error": "timeout (role chief0)"}),
        ("W3", {"label": "tf ps 2w+1s", "samples_s": 100.0, "bytes": 1e6}),  # no spread row for W3
    ]
    assert ps_w3.tf_ratios(rows) == [
        "W1 spread ps 2w+1s / tf ps 2w+1s: 1.50x samples/s, bytes/step 46.600 vs 46.700 MB"
    ]
