"""Checking a model folder, or what is about to become one: against its config's model, a reference, a load.

* :mod:`.headers`: the one-row checks of what the safetensors headers (or a plan) say: keys, shapes, non-empty,
  dtype, and :class:`.headers.Check` itself;
* :mod:`.values`: the checks that read data a block of rows at a time: NaN and Inf, bit-equality, differences;
* :mod:`.model`: the config, and its model built on the meta device (the expected keys, shapes and ties);
* :mod:`.load`: ``from_pretrained`` (a critic into its module) and the tie it must keep;
* :mod:`.verify` (``dsfix verify``) and :mod:`.compare` (``dsfix verify --against``).

These read folders through :mod:`patcher.checkpoint.readers` and import no command.
"""
