"""Sanity at scale: the cost model against published results (see spread/plan/published.py)."""

from __future__ import annotations

import pytest

from spread.plan.costs import Link, pipeline_bubble, pipeline_step_time
from spread.plan.published import HOROVOD_512, horovod_efficiency


def test_horovod_512_gpus_ordering_and_size():
    predicted = {m.name: horovod_efficiency(m) for m in HOROVOD_512}
    # The ordering the paper reports: the convolutional nets scale well, VGG-16 (553 MB of
    # gradients per step) much worse.
    assert predicted["VGG-16"] < predicted["ResNet-101"] - 0.2
    assert predicted["VGG-16"] < predicted["Inception V3"] - 0.2
    # And the rough size: within 0.1 of each published figure.
    for m in HOROVOD_512:
        assert predicted[m.name] == pytest.approx(m.published_efficiency, abs=0.1), m.name


def test_fewer_gpus_scale_better():
    vgg = HOROVOD_512[2]
    assert horovod_efficiency(vgg, devices=8) > horovod_efficiency(vgg, devices=512)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_gpipe_bubble_and_step_time_agree(stages):
    # With a free link, a step of M micro-batches takes (M + S - 1) slots: the pipeline is busy for
    # M of them, idle for the bubble fraction (S - 1) / (M + S - 1), as in GPipe.
    free = Link(0.0, 1e18)
    for micro in (1, 2, 4, 8, 16, 4 * stages):
        step = pipeline_step_time(1.0, stages, micro, 0.0, free)
        assert 1 - micro / step == pytest.approx(pipeline_bubble(stages, micro))
    assert pipeline_bubble(stages, 4 * stages) < 0.2  # GPipe: M >= 4S makes the bubble small
