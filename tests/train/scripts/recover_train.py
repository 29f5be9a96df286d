"""A MultiWorkerMirrored fit for recovery without restart: ``VICTIM`` (a rank, or -1) hurts itself
before optimizer step ``AT`` (``MODE``: kill = SIGKILL, stop = SIGSTOP, term = SIGTERM, or
mid-backward kill: ``backward``), or is SIGKILLed in the first validation forward after ``AT`` steps
(``validation``: the fit then validates every epoch), or inside the synchronous backup at the end
of epoch ``AT`` (``epoch_save``: ``BackupAndRestore(DIR, save_freq="epoch")``, ``DIR`` the fourth
argument); every rank that finishes prints
``RESULT <json>`` with its pid, the final world size, weights and history."""

import json
import os
import signal
import sys

import torch
from torch import nn

import spread
from spread.train.callbacks import BackupAndRestore, Callback

VICTIM, AT, MODE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "backward": signal.SIGKILL}
START_RANK, PID = int(os.environ["RANK"]), os.getpid()


class Hurt(Callback):
    def on_train_batch_begin(self, step, logs=None):
        if START_RANK == VICTIM and self.trainer.global_step == AT and MODE in SIGNALS and MODE != "backward":
            os.kill(PID, SIGNALS[MODE])

    def on_epoch_end(self, epoch, logs=None):  # before the backup's: it dies inside that save
        if START_RANK == VICTIM and epoch == AT and MODE == "epoch_save":
            os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = "after_shard_write"


strategy = spread.MultiWorkerMirroredStrategy()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(120, 8, generator=g), torch.randint(0, 3, (120,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    # Running statistics, averaged after every step, with SPREAD_TEST_BATCHNORM=1.
    norm = nn.BatchNorm1d(16) if os.environ.get("SPREAD_TEST_BATCHNORM") else nn.Identity()
    model = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
trainer = spread.Trainer(
    model,
    optimizer,
    nn.CrossEntropyLoss(),
    strategy=strategy,
    callbacks=[Hurt(), BackupAndRestore(sys.argv[4], save_freq="epoch", async_save=False)]
    if MODE == "epoch_save"
    else [Hurt()],
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    scheduler_interval="step",
    clip_grad_norm=1.0,
)
if MODE == "backward" and START_RANK == VICTIM:  # dies in backward, its peers mid-all-reduce

    def die(grad):
        if trainer.global_step == AT:
            os.kill(PID, signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die)
validation = None
if MODE == "validation":  # dies while its peers validate, before any callback sees the epoch's end
    validation = (torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g))

    def die_validating(module, args):
        if START_RANK == VICTIM and not module.training and trainer.global_step >= AT:
            os.kill(PID, signal.SIGKILL)

    model.register_forward_pre_hook(die_validating)
history = trainer.fit((x, y), epochs=2, global_batch_size=12, validation_data=validation, verbose=0)
result = {
    "start_rank": START_RANK,
    "pid": PID,
    "world_size": strategy.num_replicas_in_sync,
    "global_step": trainer.global_step,
    "loss": history.history["loss"],
    "val_loss": history.history.get("val_loss", []),
    "weights": {k: v.tolist() for k, v in model.state_dict().items()},
}
print("RESULT " + json.dumps(result), flush=True)
strategy.close()
