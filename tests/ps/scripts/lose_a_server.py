"""A parameter-server job (Trainer.fit, BackupAndRestore every 3 steps) whose chief SIGKILLs
parameter server 1 after its global step ``kill_at`` (-1: never), for spread run --recover. The kill
comes before that step's backup: at a multiple of 3 the chief's backup is the call that finds it lost.

Arguments: mode (sync/async), a work directory, kill_at, and "back" or "never-back" (the server's
replacement hangs before serving, so the tasks' wait for its restore must end). Every process prints
``PID <role> <index> <replacement> <pid>``; the chief prints the servers' weights and ledgers.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import spread
from spread.train.callbacks import BackupAndRestore, Callback

mode, work, kill_at, comes_back = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "back"
task = json.loads(os.environ["TF_CONFIG"])["task"]
replacement = int(os.environ.get("SPREAD_PS_REPLACEMENT", "0"))
print(f"PID {task['type']} {task['index']} {replacement} {os.getpid()}", flush=True)
if task["type"] == "ps":
    (work / f"ps-{task['index']}-{replacement}.pid").write_text(str(os.getpid()))
    if replacement and not comes_back:
        time.sleep(600)  # never serves: spread run stops it when the job fails

strategy = spread.ParameterServerStrategy(mode=mode, timeout=30, max_staleness=1 if mode == "async" else None)


class KillServer(Callback):
    def on_train_batch_end(self, step, logs=None):
        if strategy.is_chief and self.trainer.global_step == kill_at:
            pid = int((work / "ps-1-0.pid").read_text())
            print(f"KILL parameter server 1 (pid {pid}) after step {kill_at}", flush=True)
            os.kill(pid, signal.SIGKILL)


g = torch.Generator().manual_seed(1)
x, y = torch.randn(160, 8, generator=g), torch.randint(0, 3, (160,), generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
backup = BackupAndRestore(str(work / "backup"), save_freq=3, delete_checkpoint=False, keep=100)
trainer = spread.Trainer(
    model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=[KillServer(), backup]
)
trainer.fit((x, y), epochs=2, global_batch_size=32, verbose=0)
if strategy.is_chief:
    strategy.wait_for_workers()  # every task's last step is in; the chief's copy is the final model
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("WEIGHTS " + " ".join(f"{v:.10e}" for v in flat.tolist()), flush=True)
    print("LEDGER " + json.dumps(strategy.server_stats(ids=True), separators=(",", ":")), flush=True)
print(f"END {task['type']} {task['index']} {os.getpid()}", flush=True)
strategy.close()
