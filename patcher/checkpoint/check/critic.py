"""The reward/critic model of DeepSpeed-Chat steps 2 and 3, rebuilt from a config for checking.

DeepSpeed-Chat's ``create_critic_model`` builds the base transformer with ``AutoModel`` (no language-model
head) and wraps it: the transformer sits under the attribute ``rwtransformer`` and a one-output linear
layer without bias, ``v_head``, maps each hidden state to a value. The wrapper keeps the base model's
``config``, so the folder it saves holds the base model's config.json and the keys ``rwtransformer.*``
plus ``v_head.weight``. :class:`CriticModel` is dsfix's own module with that layout; dsfix builds it on
the meta device to learn the keys and shapes a critic folder must hold, and on the CPU to load one.

This module imports torch at the top; its users import it only inside
functions, so the patch path never loads torch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def value_head_width(config) -> int:
    """The width of the hidden state ``v_head`` reads, as DeepSpeed-Chat picks it.

    OPT projects its output to ``word_embed_proj_dim``; other models use ``hidden_size`` (``n_embd`` in
    GPT-2-style configs).
    """
    for attr in ("word_embed_proj_dim", "hidden_size", "n_embd"):
        width = getattr(config, attr, None)
        if isinstance(width, int) and width > 0:
            return width
    raise ValueError("the config names no hidden size (word_embed_proj_dim, hidden_size or n_embd)")


class CriticModel(nn.Module):
    """A base transformer under ``rwtransformer`` and a value head ``v_head`` (hidden -> 1, no bias)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.config = base.config
        self.rwtransformer = base
        self.v_head = nn.Linear(value_head_width(base.config), 1, bias=False)

    def forward(self, input_ids, attention_mask=None):
        """One value per token: shape (batch, sequence)."""
        hidden = self.rwtransformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        return self.v_head(hidden).squeeze(-1)


def build_critic(config, *, on_meta: bool = True) -> CriticModel:
    """The critic for ``config``: every tensor on the meta device, or (``on_meta=False``) parameters on
    the meta device and buffers real on the CPU, ready for ``load_state_dict(..., assign=True)``."""
    from transformers import AutoModel

    if on_meta:
        with torch.device("meta"):
            return CriticModel(AutoModel.from_config(config))
    with parameters_on_meta():
        return CriticModel(AutoModel.from_config(config))


@contextmanager
def parameters_on_meta():
    """Create parameters on the meta device but buffers (rotary frequencies, say) for real on the CPU.

    Non-persistent buffers are computed in ``__init__`` and are not in a checkpoint, so a model built
    wholly on meta could never run; this way only the parameters, which the checkpoint supplies, are
    left empty.
    """
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
