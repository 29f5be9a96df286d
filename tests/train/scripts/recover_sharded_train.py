"""A ShardedStrategy fit for recovery without restart: ``VICTIMS`` (starting ranks, comma-separated,
or -1) are SIGKILLed, each before its optimizer step of ``STEPS`` (``MODE`` kill), in its backward
while its peers reduce gradients (``backward``), or just before its optimizer step while its peers
step and wait for its shard in the buddy exchange (``in_exchange``); ``SHARD`` is the stage. Every
rank that finishes prints ``RESULT <json>`` with its pid, the final world size and the one-device
weights (gathered)."""

import json
import os
import signal
import sys

import torch
from torch import nn

import spread
from spread.train.callbacks import Callback

# Each victim's step: one for all, or one per victim (``2,1`` at ``4,9``: two losses in one job).
VICTIMS = [int(r) for r in sys.argv[1].split(",")]
STEPS = [int(s) for s in sys.argv[2].split(",")]
MODE, SHARD = sys.argv[3], sys.argv[4]
START_RANK, PID = int(os.environ["RANK"]), os.getpid()
AT = dict(zip(VICTIMS, STEPS * len(VICTIMS) if len(STEPS) == 1 else STEPS, strict=True)).get(START_RANK, -1)


class Residual(nn.Module):
    """Not a Sequential: a skip connection around a hidden layer, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        # Running statistics: buffers averaged after every step (SPREAD_TEST_BATCHNORM=1).
        self.norm = nn.BatchNorm1d(16) if os.environ.get("SPREAD_TEST_BATCHNORM") else nn.Identity()
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.norm(self.inp(x)))
        return self.head(h + torch.tanh(self.hidden(h)))


class Hurt(Callback):
    def on_train_batch_begin(self, step, logs=None):
        if self.trainer.global_step == AT and MODE == "kill":
            os.kill(PID, signal.SIGKILL)


strategy = spread.ShardedStrategy(shard=SHARD)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    model = Residual()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
trainer = spread.Trainer(
    model,
    optimizer,
    nn.CrossEntropyLoss(),
    strategy=strategy,
    callbacks=[Hurt()],
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    scheduler_interval="step",
    clip_grad_norm=1.0,
)
if MODE == "backward" and AT >= 0:  # dies in backward, its peers mid-reduction

    def die(grad):
        if trainer.global_step == AT:
            os.kill(PID, signal.SIGKILL)
        return grad

    model.hidden.weight.register_hook(die)
if MODE == "in_exchange" and AT >= 0:  # dies after the others' last collective before the step: they
    # step, then wait in vain for its shard in the buddy exchange

    def die_before_step(opt, args, kwargs):
        if trainer.global_step == AT:
            os.kill(PID, signal.SIGKILL)

    optimizer.register_step_pre_hook(die_before_step)
history = trainer.fit((x, y), epochs=2, global_batch_size=12, verbose=0)
report = strategy.memory_report(optimizer)
weights = strategy.full_state_dict(model)
result = {
    "start_rank": START_RANK,
    "pid": PID,
    "world_size": strategy.num_replicas_in_sync,
    "buddy_copy": strategy._buddy is not None,  # kept under spread run --recover only
    "global_step": trainer.global_step,
    "optimizer_state_bytes": report.optimizer_state_bytes,
    "recovery_copy_bytes": report.recovery_copy_bytes,
    "loss": history.history["loss"],
    "weights": {k: v.tolist() for k, v in weights.items()},
}
print("RESULT " + json.dumps(result), flush=True)
strategy.close()
