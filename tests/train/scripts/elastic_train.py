"""A Trainer job with BackupAndRestore that a test kills and resumes at another size or strategy.

Args: backup_dir crash_at kind (mwms, sharded-<stage>, pipeline); rank 1 is SIGKILLed after
optimizer step crash_at (0: never). The chief prints one RESULT line of JSON.
"""

import json
import os
import signal
import sys

import torch
from torch import nn

import spread
from spread.train.callbacks import BackupAndRestore, Callback

backup_dir, crash_at, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if kind == "pipeline":  # 2 stages, as many pipeline replicas as pairs of processes
    world = int(os.environ["WORLD_SIZE"])
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, replicas=world // 2)
elif kind.startswith("sharded-"):  # each rank backs up its own shard; resharded at another size
    strategy = spread.ShardedStrategy(shard=kind.removeprefix("sharded-"))
else:
    strategy = spread.MultiWorkerMirroredStrategy()


class Kill(Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == crash_at:
            # Backups are written in the background: the kill is meant to land after the newest
            # one is committed (what is tested here is resuming elsewhere, not a lost write).
            strategy.wait_for_checkpoint()
            if strategy.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)


g = torch.Generator().manual_seed(1)
x, y = torch.randn(100, 8, generator=g), torch.randint(0, 3, (100,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
backup = BackupAndRestore(backup_dir, save_freq=3)
trainer = spread.Trainer(
    model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=[backup, Kill()]
)
history = trainer.fit((x, y), epochs=3, global_batch_size=16, verbose=0)
state = strategy.full_state_dict(model)  # collective under a pipeline
if strategy.is_chief:
    print(
        "RESULT "
        + json.dumps(
            {
                "restored": backup.restored_step,
                "from": backup.resumed_from_replicas,
                "world": strategy.num_replicas_in_sync,
                "weights": {k: v.flatten().tolist() for k, v in state.items()},
                "loss": history.history["loss"],
            }
        ),
        flush=True,
    )
