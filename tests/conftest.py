"""Leak guards for every test: no child process and no process group may outlive a test."""

from __future__ import annotations

import time

import psutil
import pytest
import torch.distributed as dist


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


@pytest.fixture(autouse=True)
def no_leaks():
    before = {p.pid for p in _live_children()}
    yield
    deadline = time.monotonic() + 5
    leaked = [p for p in _live_children() if p.pid not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = [p for p in _live_children() if p.pid not in before]
    for p in leaked:
        p.kill()
    assert not leaked, f"test left processes behind: {[(p.pid, p.cmdline()[:3]) for p in leaked]}"
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised")
