"""``spread plan``'s output: user strings come out as written, never as rich markup, emoji or mathtext."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _profiles import toy_profile

from spread.plan.advisor import make_plan
from spread.plan.cluster import ClusterModel
from spread.plan.predict import Candidate, Options
from spread.plan.report import plot, render

# What rich would rewrite if it parsed them: an emoji code inside a factory name (":factory:" is 🏭),
# a plain emoji code, markup tags, and a style-looking label.
HOSTILE = ["plan_cnn:factory", ":smile:", "[bold]x[/bold]", "[shm]", "a [red]b[/] c"]


@pytest.mark.parametrize("text", HOSTILE)
def test_user_strings_are_printed_verbatim(text):
    profile = toy_profile(name=text)
    cluster = ClusterModel(nodes=1, devices_per_node=2, cores_per_node=2, source=f"calibration {text}")
    plan = make_plan(profile, cluster, Options(global_batch=8))
    first = plan.predictions[0]
    hostile = replace(
        first,
        candidate=Candidate(first.candidate.strategy, first.candidate.devices, {"tag": text}),
        note=f"note {text}",
    )
    plan = replace(plan, predictions=[hostile, *plan.predictions[1:]], recommended=hostile, reason=text)

    out = render(plan, profile)

    assert f"model {text}: " in out
    assert f"from calibration {text}\n" in out
    assert f"*{first.candidate.strategy}[{text}]" in out  # the table's strategy cell
    assert f"note {text}" in out  # the table's "why" cell
    assert out.rstrip("\n").endswith(f"recommended: {first.candidate.strategy}[{text}]: {text}")
    assert "🏭" not in out and "😄" not in out


# matplotlib builds its font cache at its first import after an install, running fc-list: a process
# (in the fast tier on a fresh virtualenv that failed the tier's no-process guard).
@pytest.mark.processes
def test_plot_title_takes_a_model_name_with_dollars(tmp_path):
    pytest.importorskip("matplotlib")
    profile = toy_profile(name=r"a $\frac{$ b")  # as mathtext this is a syntax error that aborts the plot
    plan = make_plan(
        profile, ClusterModel(nodes=1, devices_per_node=2, cores_per_node=2), Options(global_batch=8)
    )
    path = plot(plan, profile, 4, str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("plan.png")
