"""``benchmarks/exit_stress.py``: its abort detection, and the CI subset of the stress check (issue 16)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import exit_stress  # noqa: E402
from exit_stress import CASES, Case, abort_line, report, stress  # noqa: E402


def test_abort_line_is_the_first_line_reporting_a_crash():
    output = (
        "[rank 0] done\n[rank 1] terminate called without an active exception\nspread run: killed by SIGABRT"
    )
    assert abort_line(output) == "[rank 1] terminate called without an active exception"
    assert abort_line("[rank 0] done\n[rank 1] done\n") == ""


def test_every_example_has_a_case():
    examples = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    assert examples <= {case.script for case in CASES}


def test_unknown_case_names_are_refused():
    with pytest.raises(SystemExit, match="unknown case"):
        exit_stress.main(["--cases", "digits,nope", "--runs", "1"])


@pytest.mark.processes
def test_an_aborting_run_is_counted_and_its_message_kept(monkeypatch):
    monkeypatch.setitem(
        exit_stress.SCRIPTS, "aborts", "import os\nprint('trained', flush=True)\nos.abort()\n"
    )
    (tally,) = stress([Case("aborts", ("-n", "1"), "aborts")], runs=1, timeout=120)
    assert tally.runs == 1 and tally.unexpected == 1
    assert 0 not in tally.codes
    assert "SIGABRT" in tally.first_abort
    assert "| aborts | 0 | 1 | 1 |" in report([tally])


@pytest.mark.processes
def test_ci_subset_ends_every_run_with_the_expected_exit_code():
    names = ("custom_loop", "issue16_pipeline_noclose")
    tallies = stress([c for c in CASES if c.name in names], runs=5, timeout=180)
    print(report(tallies))
    assert [t.runs for t in tallies] == [5, 5]
    assert all(t.unexpected == 0 for t in tallies), report(tallies)
