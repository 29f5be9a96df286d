"""``spread.export``: the trained weights as files other tools read, from any strategy.

``save_safetensors(strategy, model, path)`` writes one ``.safetensors`` file; ``save_pretrained(
strategy, model, directory)`` writes a Hugging Face model loadable with ``from_pretrained``. Both
take the one-device weights from ``strategy.full_state_dict(model)``: call them on every rank, the
chief writes. They live in :mod:`spread.checkpoint.export`; this module is their public name.
"""

from spread.checkpoint.export import save_pretrained, save_safetensors

__all__ = ["save_pretrained", "save_safetensors"]
