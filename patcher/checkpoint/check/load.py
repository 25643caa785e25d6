"""Loading a model folder as its users will: ``from_pretrained``, or a critic into its module, ties kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.model import CRITIC, model_name
from patcher.checkpoint.check.values import same_bits
from patcher.checkpoint.names import CONFIG_NAME, examples, shape_text


def dtype_kwarg(version: Optional[str] = None) -> str:
    """The keyword that ``from_pretrained``/``from_config`` of transformers ``version`` (default: the installed
    one) read the dtype from: ``dtype`` from 4.56 on, ``torch_dtype`` before (4.51 hands ``dtype`` to the
    model's constructor: a TypeError; later releases warn that ``torch_dtype`` is deprecated). Both go through
    ``**kwargs``, so the signature cannot tell: ask the version."""
    if version is None:
        import transformers

        version = transformers.__version__
    major, minor = (int(x) for x in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_check(path, *, dtype: Any = None, device: Any = None, keep_model: bool = False,
               attn_implementation: Optional[str] = None) -> tuple[Check, Any]:
    """(Check, model or None): ``from_pretrained(path)`` loads with no missing, unexpected or mismatched keys,
    and a config that says tied loads tied (see :func:`tie_on_load_check`). ``attn_implementation`` is passed
    on when given: smoke compares logits with the attention the in-memory model ran."""
    import logging

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    kwargs: dict = {"output_loading_info": True}
    if dtype is not None:
        kwargs[dtype_kwarg()] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as e:
        msg = " ".join(str(e).split())
        return Check("load", False, f"from_pretrained failed: {type(e).__name__}: {msg[:400]}"), None
    finally:
        hf_logging.set_verbosity(level)
    kept = model if keep_model else None
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = list(info.get(key) or [])
        if vals:
            problems.append(f"{key.replace('_', ' ')}: {examples(vals)}")
    if problems:
        return Check("load", False, "from_pretrained: " + "; ".join(problems)), kept
    untied = tie_on_load_check(model)
    if untied is not None:
        return untied, kept
    if device is not None:
        model = model.to(device)
        kept = model if keep_model else None
    detail = "from_pretrained: no missing, unexpected or mismatched keys"
    if _ties_embeddings(model):
        detail += "; output embedding tied to the input embedding"
    return Check("load", True, detail), kept


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _ties_embeddings(model: Any) -> bool:
    return bool(getattr(_text_config(model), "tie_word_embeddings", False))


def tie_on_load_check(model: Any) -> Optional[Check]:
    """A failed "load" check when the config says ``tie_word_embeddings`` but the loaded model's output
    embedding is a matrix of its own, else None.

    transformers 5.0 to 5.3 load a folder that stores both ``lm_head.weight`` and the embedding (dsfix's
    default clone output) untied: equal values, but two matrices that a further training step updates
    apart. 4.x and 5.4+ tie them again; a folder without the alias (``--strategy dedupe``) loads tied
    everywhere."""
    if not _ties_embeddings(model):
        return None
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if inp is None or out is None or getattr(out, "weight", None) is None:
        return None
    if out.weight is inp.weight or out.weight.data_ptr() == inp.weight.data_ptr():
        return None
    import transformers

    return Check("load", False, f"config.json says tie_word_embeddings, but transformers {transformers.__version__} "
                                "loaded lm_head untied (a further training step would update two matrices): save with "
                                "--strategy dedupe (dsfix apply or convert), or load with transformers >= 5.4")


def critic_load_check(reader: Any) -> Check:
    """Load a critic folder (a :class:`patcher.checkpoint.readers.safetensors.SafetensorsFolder`) the way step 3
    does without from_pretrained (which a RewardModel lacks).

    Builds :class:`patcher.checkpoint.check.critic.CriticModel` from config.json (parameters on meta, buffers
    real), loads every tensor of the files into it with ``load_state_dict(strict=True, assign=True)``, checks
    that no parameter is left on meta and that each of the module's tensors holds its key's data, then runs it
    on a few tokens: one finite value per token.
    """
    import torch
    from transformers import AutoConfig

    from patcher.checkpoint.check.critic import build_critic

    folder = Path(reader.folder)
    try:
        model = build_critic(AutoConfig.from_pretrained(str(folder)), on_meta=False)
    except Exception as e:
        return Check("load", False, f"cannot build the critic from {CONFIG_NAME}: {type(e).__name__}: {e}")
    try:
        state = {key: reader.slice(key)[:] if reader.tensors[key].shape and 0 not in reader.tensors[key].shape
                 else reader.slice(key) for key in reader.tensors}
    except Exception as e:
        return Check("load", False, f"cannot read the weights: {type(e).__name__}: {e}")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        return Check("load", False, f"load_state_dict (strict) into the critic: {msg[:400]}")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        return Check("load", False, f"{len(left)} tensors left unloaded: {examples(left)}")
    live = model.state_dict()
    differ = [k for k, t in state.items() if not same_bits(live[k], t)]
    if differ:
        return Check("load", False, f"{len(differ)} of the critic's tensors differ from the file's: {examples(differ)}")
    vocab = int(getattr(model.config, "vocab_size", 8) or 8)
    ids = (torch.arange(8) % vocab).unsqueeze(0)
    try:
        model.eval()
        with torch.no_grad():
            values = model(ids)
    except Exception as e:
        msg = " ".join(str(e).split())
        return Check("load", False, f"the loaded critic does not run: {type(e).__name__}: {msg[:300]}")
    if tuple(values.shape) != (1, 8) or not bool(torch.isfinite(values.float()).all()):
        return Check("load", False, f"the loaded critic gives values of shape {shape_text(values.shape)}, "
                                    f"{int((~torch.isfinite(values.float())).sum())} not finite")
    return Check("load", True, f"critic ({model_name(model, CRITIC)}) loaded with strict keys: {len(state)} tensors, "
                               "none missing or unexpected, all equal to the files; one finite value per token")
