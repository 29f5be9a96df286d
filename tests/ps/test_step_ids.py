"""Step ids: one type made and read at both ends, in the text forms servers' ledgers and checkpoints
already hold."""

from __future__ import annotations

import pytest

from spread.ps.step_ids import StepId, sync_round


@pytest.mark.parametrize(
    ("step_id", "text"),
    [
        (StepId(task=3, session="a1b2c3d4", number=17), "w3.a1b2c3d4.17"),  # a training task's own step
        (StepId(task=0, session="ff", number=0), "w0.ff.0"),
        (StepId(task=None, session="0badf00d", number=5), "0badf00d:5"),  # a coordinator-scheduled task
        (sync_round(12), "sync:12"),  # a sync round, as a server records it
    ],
)
def test_each_form_encodes_as_before_and_decodes_back(step_id, text):
    assert step_id.encode() == text
    assert StepId.decode(text) == step_id


@pytest.mark.parametrize(
    "text",
    [
        "",
        "task-7",
        "w1.ab",
        "w1.ab.",
        "wx.ab.1",
        "w1.a.b.2",
        "w-1.ab.2",
        "w1.ab.-2",
        ":3",
        "ab:",
        "a:b:3",
        "w1.ab.٣",
    ],
)
def test_malformed_text_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"malformed step id {text!r}"):
        StepId.decode(text)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"task": -1, "session": "ab", "number": 0}, "StepId.task"),
        ({"task": 0, "session": "", "number": 0}, "StepId.session"),
        ({"task": 0, "session": "a.b", "number": 0}, "StepId.session"),  # would not decode back
        ({"task": None, "session": "a:b", "number": 0}, "StepId.session"),
        ({"task": 0, "session": "ab", "number": -1}, "StepId.number"),
    ],
)
def test_fields_that_would_not_round_trip_are_refused(fields, name):
    with pytest.raises(ValueError, match=name):
        StepId(**fields)
