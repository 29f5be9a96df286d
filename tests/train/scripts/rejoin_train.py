"""A MultiWorkerMirrored fit (or, with a third argument, a ShardedStrategy fit at that ``shard=`` stage)
on several "machines" (separate ``spread run --recover --nnodes`` calls) for recovery without restart
and machines that join back. ``FULL`` is the world size when every machine is in.
``SPREAD_TEST_CHAOS`` (``MODE@STEP``, only in the environment of the machine to hurt) makes the
machine's last rank hurt itself or its machine before optimizer step ``STEP``:

* ``kill``: SIGKILL of the machine's launcher (its agent and ranks die with it) and of the rank;
* ``die``: SIGKILL of the rank alone (its launcher lives on and reports the exit);
* ``backward``: the same, from inside backward (its peers wait in the gradient all-reduce);
* ``term``: SIGTERM to the machine's launcher (a preemption: it stops its ranks and exits);
* ``stop``: SIGSTOP of the rank (its launcher kills it after a few seconds; the machine goes down);
* ``save``: the chief (rank 0, on whichever machine) dies inside ``BackupAndRestore``'s save, between
  writing and committing (``SPREAD_CHECKPOINT_CRASH_AT=after_shard_write``); its launcher lives on.

While the job is smaller than ``FULL`` the survivors wait at each step for a machine to ask to join
(at most ``WAIT`` s), so that the rejoin happens at a known point whatever the machine's speed. Every
rank that finishes prints ``RESULT <json>`` (the one-device weights); every rank prints ``PIDS`` with its
own and its launcher's."""

import json
import os
import signal
import sys
import time

import torch
from torch import nn

import spread
from spread.train.callbacks import BackupAndRestore, Callback

FULL, BACKUPS = int(sys.argv[1]), sys.argv[2]
HIDDEN = int(os.environ.get("SPREAD_TEST_HIDDEN", "16"))  # larger: to time the state streamed at a join
SHARD = sys.argv[3] if len(sys.argv) > 3 else None  # None: MultiWorkerMirrored
WAIT = 90.0
CHAOS = os.environ.get("SPREAD_TEST_CHAOS", "")
MODE, AT = CHAOS.split("@") if CHAOS else ("", "-1")
PID, LAUNCHER = os.getpid(), os.getppid()
VICTIM = int(os.environ["LOCAL_RANK"]) == int(os.environ["LOCAL_WORLD_SIZE"]) - 1
if MODE == "save":  # the chief writes the backups
    VICTIM = int(os.environ["RANK"]) == 0
AT = int(AT)
print(f"PIDS {PID} {LAUNCHER}", flush=True)


def lose_the_machine() -> None:
    os.kill(LAUNCHER, signal.SIGKILL)
    os.kill(PID, signal.SIGKILL)


class Chaos(Callback):
    def on_train_batch_begin(self, step, logs=None):
        trainer, strategy = self.trainer, self.trainer.strategy
        if VICTIM and trainer.global_step == AT:
            if MODE == "kill":
                lose_the_machine()
            elif MODE == "die":
                os.kill(PID, signal.SIGKILL)
            elif MODE == "term":
                os.kill(LAUNCHER, signal.SIGTERM)
                time.sleep(60)  # the launcher stops this rank
            elif MODE == "stop":
                os.kill(PID, signal.SIGSTOP)
            elif MODE == "save":
                os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = "after_shard_write"
        if strategy.num_replicas_in_sync < FULL:  # every rank, so none waits in a collective meanwhile
            global WAIT
            started = time.monotonic()
            while not strategy.joiners_waiting() and time.monotonic() < started + WAIT:
                time.sleep(0.05)
            WAIT -= time.monotonic() - started  # in all, not per step


if SHARD is None:
    strategy = spread.MultiWorkerMirroredStrategy()
else:  # at "parameters" each Linear is a unit: several blocks, gathered ahead in the order forward used them
    units = (nn.Linear,) if SHARD == "parameters" else "model"
    strategy = spread.ShardedStrategy(shard=SHARD, units=units)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(240, 8, generator=g), torch.randint(0, 3, (240,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
callbacks: list[Callback] = [Chaos()]
if BACKUPS != "-":
    callbacks.append(BackupAndRestore(BACKUPS, save_freq=2))
trainer = spread.Trainer(
    model,
    optimizer,
    nn.CrossEntropyLoss(),
    strategy=strategy,
    callbacks=callbacks,
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    scheduler_interval="step",
    clip_grad_norm=1.0,
)
if MODE == "backward" and VICTIM:  # dies in backward, its peers mid-all-reduce

    def die(grad):
        if trainer.global_step == AT:
            lose_the_machine()
        return grad

    model[0].weight.register_hook(die)
history = trainer.fit((x, y), epochs=2, global_batch_size=12, verbose=0)
result = {
    "pid": PID,
    "world_size": strategy.num_replicas_in_sync,
    "global_step": trainer.global_step,
    "weights": {k: v.tolist() for k, v in strategy.full_state_dict(model).items()},
}
print("RESULT " + json.dumps(result), flush=True)
strategy.close()
