"""A ClusterCoordinator loop, as in TensorFlow's tutorial, that returns without shutdown() or close().

The chief's ending comes from SPREAD_TEST_CHIEF_ENDING: "return", "exit" (sys.exit(0)) or "raise"
(after join()). With SPREAD_TEST_LATE_DIR, worker 1 starts only once the chief has finished all the
work (the chief leaves a file there).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import spread

STATE = {}


def dataset_fn():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 128, 16)]


def train_step(iterator):
    x, y = next(iterator)
    STATE["optimizer"].zero_grad()
    loss = nn.functional.cross_entropy(STATE["model"](x), y)
    loss.backward()
    STATE["optimizer"].step()
    return loss.detach()


def eval_step(iterator):  # scheduled only after training: a worker never reaches this call
    x, y = next(iterator)
    with torch.no_grad():
        return (STATE["model"](x).argmax(1) == y).float().mean()


late = os.environ.get("SPREAD_TEST_LATE_DIR")
task = json.loads(os.environ["TF_CONFIG"])["task"]
if late and task == {"type": "worker", "index": 1}:
    deadline = time.monotonic() + 60
    while not Path(late, "trained").exists() and time.monotonic() < deadline:
        time.sleep(0.05)

strategy = spread.ParameterServerStrategy()
with strategy.scope():
    torch.manual_seed(0)
    STATE["model"] = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    STATE["optimizer"] = torch.optim.SGD(STATE["model"].parameters(), lr=0.1)
coordinator = spread.ClusterCoordinator(strategy)
iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(16)]
coordinator.join()
accuracy = coordinator.schedule(eval_step, args=(iterator,))
coordinator.join()
print(f"last loss {float(losses[-1].fetch()):.3f}; accuracy {float(accuracy.fetch()):.2f}", flush=True)
if late:
    Path(late, "trained").write_text(json.dumps(coordinator.stats()))
ending = os.environ.get("SPREAD_TEST_CHIEF_ENDING", "return")
if ending == "exit":
    sys.exit(0)
if ending == "raise":
    raise ValueError("the chief failed on purpose")
