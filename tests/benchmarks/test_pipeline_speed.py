"""``benchmarks/pipeline_speed.py``'s interleaved rounds: every configuration once per round in a
changing order, and ratios paired within a round so a machine drifting between rounds cancels out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import pipeline_speed  # noqa: E402
from pipeline_speed import Config, best_m, paired_ratio, round_order  # noqa: E402


def test_each_round_runs_every_configuration_once_in_a_changing_order():
    orders = [round_order(8, r, 4) for r in range(4)]
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert orders[0] == list(range(8))
    assert len({order[0] for order in orders}) == 4  # a different configuration goes first each round
    assert len({tuple(order) for order in orders}) == 4
    assert round_order(3, 0, 1) == [0, 1, 2]


def _config(key: str, rates: list[list[float]]) -> Config:
    return Config(key, key, lambda: {}, rates=rates)


def test_paired_ratio_cancels_drift_between_rounds():
    # The machine runs at 1x, 0.5x and 1.4x speed in three rounds; A is always 1.2x B within a round.
    speed = [1.0, 0.5, 1.4]
    b = _config("b", [[100 * s, 110 * s] for s in speed])
    a = _config("a", [[120 * s, 132 * s] for s in speed])
    med, lo, hi = paired_ratio(a, b)
    assert med == pytest.approx(1.2) and lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    # The unpaired ratio of medians over all repetitions would not be 1.2 only by luck; pairing is.
    c = _config("c", [[100.0], [50.0], [200.0]])
    assert paired_ratio(c, _config("d", [[50.0], [100.0], [100.0]])) == (2.0, 0.5, 2.0)


@pytest.mark.processes
def test_quick_smoke_run_reports_every_configuration(capsys, monkeypatch):
    argv = [
        "pipeline_speed.py",
        "--quick",
        "--workloads",
        "mlp",
        "--rounds",
        "1",
        "--reps",
        "1",
        "--steps",
        "1",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    pipeline_speed.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 9  # header + one process x2, spread x3, torch x4
    assert any(r.startswith("| spread PipelineStrategy 1f1b, split ") for r in rows)
    assert "| torch.distributed.pipelining Schedule1F1B, split " in out


def test_best_m_picks_each_configurations_fastest_m_by_median_rate():
    configs = [
        _config("torch-1f1b-count@2", [[90.0], [100.0], [95.0]]),
        _config("torch-1f1b-count@4", [[120.0], [60.0], [110.0]]),  # median 110: the best
        _config("spread-zb@2", [[130.0], [140.0], [150.0]]),
        _config("spread-zb@4", [[100.0], [100.0], [100.0]]),
    ]
    assert best_m(configs, "torch-1f1b-count", [2, 4]).key == "torch-1f1b-count@4"
    assert best_m(configs, "spread-zb", [2, 4]).key == "spread-zb@2"


@pytest.mark.processes
def test_quick_smoke_run_with_several_m_adds_the_best_m_table(capsys, monkeypatch):
    argv = ["pipeline_speed.py", "--quick", "--workloads", "mlp", "--microbatches", "2,4"]
    argv += ["--rounds", "1", "--reps", "1", "--steps", "1", "--spread-schedules", "zb"]
    monkeypatch.setattr(sys, "argv", argv)
    pipeline_speed.main()
    out = capsys.readouterr().out
    assert "### M=2" in out and "### M=4" in out
    best = out[out.index("### Each at its best M") :]
    rows = [line for line in best.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| spread-zb",
        "| torch-gpipe-count",
        "| torch-1f1b-count",
    ]
