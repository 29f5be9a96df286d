"""W2 in bf16 against fp32: speed and loss curve under MultiWorkerMirroredStrategy (2 processes).

Each round runs two jobs, fp32 then bf16 (the order alternates by round), each a ``Trainer.fit`` of
the W2 decoder (4 layers, d=256, vocabulary 8192, 16 x 128 tokens per global batch, AdamW) on
sequences drawn from a fixed random bigram chain, so there is something to learn and the loss curve
means something. Tokens/s is rank 0's over the epochs after the first (warm-up); the ratio is paired
by round. The loss curve is the per-epoch training loss of the last round.

    python benchmarks/precision.py [--rounds 3] [--epochs 3] [--steps 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from workloads import Decoder, _lm_loss

import spread
from spread.testing import run_ranks

VOCAB, D, LAYERS, HEADS, SEQ, BATCH = 8192, 256, 4, 4, 128, 16


def _bigram_sequences(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` sequences of a Markov chain whose next token is one of 4 successors of the previous."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    ids = torch.empty(n, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        choice = torch.randint(0, 4, (n,), generator=g)
        ids[:, t] = successors[ids[:, t - 1], choice]
    return ids


class _EpochClock(spread.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def _job(precision: str, epochs: int, steps: int) -> dict:
    torch.set_num_threads(1)
    strategy = spread.MultiWorkerMirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = Decoder(VOCAB, D, LAYERS, HEADS, SEQ)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _bigram_sequences(steps * BATCH)
    clock = _EpochClock()
    trainer = spread.Trainer(
        model, optimizer, _lm_loss, strategy=strategy, precision=precision, callbacks=[clock]
    )
    history = trainer.fit((ids, ids), epochs=epochs, global_batch_size=BATCH, shuffle=False, verbose=0)
    strategy.close()
    tokens = steps * BATCH * SEQ
    return {"tokens_per_s": [tokens / s for s in clock.seconds[1:]], "loss": history.history["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="global batches per epoch")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"32": [], "bf16": []}
    for r in range(args.rounds):
        order = ["32", "bf16"] if r % 2 == 0 else ["bf16", "32"]
        for precision in order:
            rank0 = run_ranks(_job, 2, args=(precision, args.epochs, args.steps), timeout=1200)[0]
            runs[precision].append(rank0)
            speed = statistics.median(rank0["tokens_per_s"])
            print(f"round {r} precision {precision}: {speed:,.0f} tokens/s, loss {rank0['loss']}", flush=True)
    ratios = [
        statistics.median(b["tokens_per_s"]) / statistics.median(f["tokens_per_s"])
        for f, b in zip(runs["32"], runs["bf16"], strict=True)
    ]
    summary = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "tokens_per_s": {
            p: statistics.median(statistics.median(x["tokens_per_s"]) for x in v) for p, v in runs.items()
        },
        "bf16_over_fp32": {"median": statistics.median(ratios), "per_round": ratios},
        "loss_curve": {p: v[-1]["loss"] for p, v in runs.items()},
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
