"""Steps: what changes a reader's tensors on their way to the writer. Each wraps a reader and is one itself
(:class:`patcher.checkpoint.readers.base.Reader`): it says what it holds and streams it.

* :mod:`.lora`: DeepSpeed-Chat's LoRA factors fused into their weights, as step 1 does before its save.
"""
