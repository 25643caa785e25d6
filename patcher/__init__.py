"""dsfix: make DeepSpeed-Chat save tied-weight models (Qwen3 and friends) as correct safetensors."""

__version__ = "0.1.0"
