"""Leak guards for every test: no child process and no process group may outlive a test.

The fast tier (``scripts/test.sh --fast``, ``SPREAD_TEST_FAST=1``) deselects tests marked
``processes`` or ``slow``, and refuses to start a process in the tests it keeps: a test that starts
one without the ``processes`` mark fails at once, naming the mark, so the tier stays honest.

On a busy machine every hard budget stretches (``spread.testing.time_budget``): the session reads the
load once at start into ``SPREAD_TEST_TIME_SCALE`` (set it by hand to choose), which scales each
test's pytest-timeout and the harness's timeouts, in this process and the ranks it starts.

The suite is a CPU suite (what CI has): on a machine with GPUs it hides them (``CUDA_VISIBLE_DEVICES``
empty, for the ranks it starts too) unless ``SPREAD_TEST_GPU=1``, which the GPU tests in
``tests/gpu`` need (``SPREAD_TEST_GPU=1 python -m pytest tests/gpu``).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import time

import psutil
import pytest
import torch.distributed as dist

from spread.testing.time_budget import SCALE_ENV, busy_machine_scale, time_scale

FAST_TIER = os.environ.get("SPREAD_TEST_FAST") == "1"
if os.environ.get("SPREAD_TEST_GPU") != "1":  # before anything initialises CUDA
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
UNMARKED_PROCESS = (
    "this test starts a process but is not marked pytest.mark.processes "
    "(the fast tier, scripts/test.sh --fast, runs no multi-process tests)"
)


def _refuse_processes(*args: object, **kwargs: object) -> None:
    raise RuntimeError(UNMARKED_PROCESS)


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(SCALE_ENV):  # once per session, before any process is started
        os.environ[SCALE_ENV] = f"{busy_machine_scale():.2f}"
    if FAST_TIER:  # for the whole session: module-scoped fixtures start processes too
        subprocess.Popen.__init__ = _refuse_processes  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = _refuse_processes  # type: ignore[method-assign]
        os.fork = _refuse_processes  # type: ignore[assignment]
        os.posix_spawn = _refuse_processes  # type: ignore[assignment]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stretch every test's hard timeout by the session's time scale (1 on an idle machine)."""
    scale = time_scale()
    if scale == 1.0:
        return
    suite_wide = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else suite_wide
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * scale), append=False)


def _live_children() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            # multiprocessing's resource tracker lives as long as the test session, by design
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
            alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


def _command(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()[:3]
    except psutil.Error:  # exited, or a zombie, since it was listed
        return ["?"]


@pytest.fixture(autouse=True)
def no_leaks():
    before = {p.pid for p in _live_children()}
    yield
    deadline = time.monotonic() + 5
    leaked = [p for p in _live_children() if p.pid not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = [p for p in _live_children() if p.pid not in before]
    described = [(p.pid, _command(p)) for p in leaked]  # before the kill: a killed child is a zombie
    for p in leaked:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not leaked, f"test left processes behind: {described}"
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised")
