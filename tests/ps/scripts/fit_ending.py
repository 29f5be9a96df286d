"""A parameter-server job trained with Trainer.fit that, like TensorFlow's examples, closes nothing.

How each task ends comes from SPREAD_TEST_ENDINGS (JSON: {"chief 0": "exit", ...}; default
"return"): "return" (the script just ends), "exit" (sys.exit(0)), "close" (strategy.close() first),
"raise" (an exception after the first of two epochs).
"""

import json
import os
import sys

import torch
from torch import nn

import spread

strategy = spread.ParameterServerStrategy()  # a ps task serves here until the chief stops it
task = json.loads(os.environ["TF_CONFIG"])["task"]
endings = json.loads(os.environ.get("SPREAD_TEST_ENDINGS", "{}"))
ending = endings.get(f"{task['type']} {task['index']}", "return")

with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit(data, epochs=1, global_batch_size=32, verbose=0)
if ending == "raise":
    raise ValueError(f"{task['type']} {task['index']} failed on purpose")
trainer.fit(data, epochs=1, global_batch_size=32, verbose=0)
print(f"trained {task['type']} {task['index']}", flush=True)
if ending == "close":
    strategy.close()
elif ending == "exit":
    sys.exit(0)
