"""Train a Hugging Face GPT-2 (built from a config: nothing is downloaded) with spread.Trainer.

    spread run -n 2 examples/hf_gpt2.py        # 2 local workers, MultiWorkerMirroredStrategy
    python examples/hf_gpt2.py                 # one process

Batches are dicts of the model's keyword arguments, as a tokenized dataset yields them; the model
computes its own loss from ``labels`` (``loss_fn=None``). The text is a generated toy language
(each token is the previous one plus one, modulo the vocabulary), so the loss must fall.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import spread

VOCAB, LENGTH, SAMPLES = 128, 32, 512
starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=torch.Generator().manual_seed(0))
ids = (starts + torch.arange(LENGTH)) % VOCAB
data = [{"input_ids": row, "labels": row} for row in ids]

strategy = spread.MultiWorkerMirroredStrategy()
with strategy.scope():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
trainer = spread.Trainer(model, optimizer, loss_fn=None, strategy=strategy)
history = trainer.fit(data, epochs=3, global_batch_size=32, verbose=2 if strategy.is_chief else 0)
if strategy.is_chief:
    losses = history.history["loss"]
    print(f"hf_gpt2: {strategy.num_replicas_in_sync} replica(s): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
