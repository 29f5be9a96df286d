"""A training script in the style of nanoGPT's train.py DDP section (written here, not copied).

Module-level config, ``ddp = int(os.environ.get("RANK", -1)) != -1``, a master process that prints,
a seed offset per rank, gradient accumulation divided by the world size with ``no_sync`` on all but
the last micro-step, a small GPT (not nn.Sequential) on generated tokens, and
``destroy_process_group`` at the end. Runs without any launcher too. ``--crash-at N`` makes rank 1
raise at iteration N (every attempt), for exit-code checks.
"""

import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
batch_size = 4
block_size = 16
vocab_size = 64
n_layer, n_head, n_embd = 2, 2, 32
gradient_accumulation_steps = 4
max_iters = 6
learning_rate = 3e-3
crash_at = -1
for arg in sys.argv[1:]:  # a poor man's configurator: --key=value
    key, _, value = arg.lstrip("-").partition("=")
    key = key.replace("-", "_")
    globals()[key] = type(globals()[key])(value)
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size, ddp_rank = True, 0, 1, 0
torch.manual_seed(1337 + seed_offset)

# data: a fixed token stream with structure (next token = previous + 1 mod vocab, with noise)
g = torch.Generator().manual_seed(42)
stream = (torch.arange(4096) + torch.randint(0, 3, (4096,), generator=g)) % vocab_size


def get_batch(it, micro_step):
    # every rank reads its own slice of the global batch, so 1 and N processes see the same samples
    start = (
        it * gradient_accumulation_steps * ddp_world_size
        + ddp_rank * gradient_accumulation_steps
        + micro_step
    )
    ix = (torch.arange(batch_size) * 97 + start * 131) % (len(stream) - block_size - 1)
    x = torch.stack([stream[i : i + block_size] for i in ix])
    y = torch.stack([stream[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block() for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = (
            None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        )
        return logits, loss


torch.manual_seed(1337)  # the same initial weights on every rank
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model

for it in range(max_iters):
    lr = learning_rate * 0.5 * (1 + math.cos(math.pi * it / max_iters))
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = 0.0
    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext():
            X, Y = get_batch(it, micro_step)
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if it == crash_at and ddp_rank == 1:
        raise RuntimeError(f"crash at iteration {it}")
    if master_process:
        print(f"iter {it}: loss {total:.6f}")

if master_process:
    print("checksum", f"{sum(p.double().sum().item() for p in raw_model.parameters()):.10f}")
if ddp:
    destroy_process_group()
