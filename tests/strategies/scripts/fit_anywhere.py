"""One Trainer.fit script for every way a job can be started (the README's promise).

``python fit_anywhere.py OUT`` trains with MultiWorkerMirroredStrategy on whatever cluster the
environment describes (none, TF_CONFIG, SLURM, torchrun's variables) and rank 0 saves the final
weights to OUT; ``--one-device`` trains the same global batches with OneDeviceStrategy instead, the
reference; ``--sharded`` trains with ``ShardedStrategy(shard="parameters")``. It never calls
``strategy.close()``, as the README's example does not.
"""

import sys

import torch
from torch import nn

import spread

out = sys.argv[1]
if "--one-device" in sys.argv:
    strategy = spread.OneDeviceStrategy()
elif "--sharded" in sys.argv:
    strategy = spread.ShardedStrategy(shard="parameters")
else:
    strategy = spread.MultiWorkerMirroredStrategy()
g = torch.Generator().manual_seed(0)
x = torch.randn(200, 12, generator=g)  # 200 samples: the last global batch of 64 is uneven (8)
y = (x[:, :3].sum(dim=1) > 0).long()
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
history = trainer.fit((x, y), epochs=3, global_batch_size=64, shuffle=True, verbose=0)
weights = strategy.full_state_dict(model)  # collective where the model is sharded
if strategy.is_chief:
    torch.save({k: v.detach().clone() for k, v in weights.items()}, out)
    print("replicas", strategy.num_replicas_in_sync, "loss", history.history["loss"][-1])
