"""Loading a model folder as its users will: ``from_pretrained``, or a critic into its module, ties kept.

``dsfix verify`` and ``dsfix convert`` prove the load in the memory of the model's skeleton: ``from_pretrained``
on the meta device (:func:`meta_load_check`), a critic over the files' memory-mapped pages
(:func:`critic_load_check`). ``dsfix smoke``, which runs the model, loads it for real (``keep_model``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.model import CRITIC, model_name
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
    """(Check, model or None): ``from_pretrained(path)`` finds every key (none missing, unexpected or
    mismatched), and a config that says tied loads tied (see :func:`tie_on_load_check`).

    Without ``keep_model`` (``dsfix verify``, ``dsfix convert``) no weight is read: :func:`meta_load_check`.
    With it (``dsfix smoke``, which runs the model), the model is loaded for real in ``dtype``, moved to
    ``device``, and handed back; ``attn_implementation`` is passed on when given: smoke compares logits with
    the attention the in-memory model ran."""
    if not keep_model:
        return meta_load_check(path, dtype=dtype), None
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"output_loading_info": True}
    if dtype is not None:
        kwargs[dtype_kwarg()] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with _quiet():
            model, info = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as e:
        return _failed(e), None
    problems = _problems(info)
    if problems is not None:
        return problems, model
    untied = tie_on_load_check(model)
    if untied is not None:
        return untied, model
    if device is not None:
        model = model.to(device)
    detail = "from_pretrained: no missing, unexpected or mismatched keys"
    return Check("load", True, detail + (TIED_TEXT if _ties_embeddings(model) else "")), model


TIED_TEXT = "; output embedding tied to the input embedding"
META_TEXT = "from_pretrained on the meta device (the files' keys, shapes and dtypes; no weight read)"


def meta_load_check(path, *, dtype: Any = None) -> Check:
    """The "load" check of ``dsfix verify`` and ``dsfix convert``, in the memory of the model's skeleton.

    transformers' own ``from_pretrained`` is handed the folder's config and a state dict of meta tensors, one
    for each tensor the safetensors headers list (its shape and dtype), with ``device_map="meta"``: it renames
    the keys (``_checkpoint_conversion_mapping``, ``base_model_prefix``), applies
    ``_keys_to_ignore_on_load_*``, ties the embeddings and reports missing, unexpected and mismatched keys just
    as when it reads the files, and nothing is materialised. ``dtype`` (default: the files' floating dtype)
    is the dtype it loads in. What this cannot show: a fault in the data itself, which the value checks read."""
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder

    try:
        with SafetensorsFolder(Path(path)) as reader:
            problems, held = list(reader.header.problems), dict(reader.tensors)
    except Exception as e:
        return _failed(e)
    if problems:
        return Check("load", False, f"from_pretrained cannot read the files: {examples(problems)}")
    unknown = [k for k, h in held.items() if h.dtype is None]
    if unknown:
        return Check("load", False, f"tensors of a dtype torch does not know: {examples(unknown)}")
    try:
        model, info = _meta_from_pretrained(Path(path), held, dtype)
    except Exception as e:
        return _failed(e)
    failed = _problems(info)
    if failed is not None:
        return failed
    untied = tie_on_load_check(model)
    tied = TIED_TEXT
    if untied is not None:
        if not _tied_by_values(Path(path), model):
            return untied
        tied += f" (transformers {_version()} ties a stored lm_head equal to it: bit-equal here)"
    detail = f"{META_TEXT}: no missing, unexpected or mismatched keys"
    return Check("load", True, detail + (tied if _ties_embeddings(model) else ""))


def _version() -> str:
    import transformers

    return transformers.__version__


def _tied_by_values(folder: Path, model: Any) -> bool:
    """Whether this transformers, loading the folder for real, would tie the output embedding that the meta
    load left untied: from 5.4 on it ties a stored output embedding to the input embedding only when their
    values are equal, which it cannot see on the meta device (it skips the pair). dsfix reads both, a block of
    rows at a time. Before 5.4 the answer does not depend on the values: the meta load's is the answer."""
    from patcher.checkpoint.check.values import stored_equal
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder

    if tuple(int(x) for x in _version().split(".")[:2]) < (5, 4):
        return False
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    inp, out = (names.get(id(m.weight), "") for m in (model.get_input_embeddings(), model.get_output_embeddings()))
    with SafetensorsFolder(folder) as reader:
        if inp not in reader.header.entries or out not in reader.header.entries:
            return False
        return stored_equal(reader, reader.header, inp, out)


def _meta_from_pretrained(folder: Path, held: dict, dtype: Any) -> tuple[Any, dict]:
    """(model on meta, loading info) of ``from_pretrained`` given meta tensors of ``held``'s shapes and dtypes."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {k: torch.empty(h.shape, dtype=h.dtype, device="meta") for k, h in held.items()}
    if dtype is None:
        floating = {t.dtype for t in state.values() if t.is_floating_point()}
        dtype = floating.pop() if len(floating) == 1 else torch.float32
    with _quiet():
        config = AutoConfig.from_pretrained(str(folder))
        kind = AutoModelForCausalLM._model_mapping[type(config)]  # what AutoModelForCausalLM builds
        kwargs: dict = {"config": config, "state_dict": state, "device_map": "meta", "output_loading_info": True,
                        "ignore_mismatched_sizes": True, dtype_kwarg(): dtype}  # mismatches listed, not raised
        if int(transformers.__version__.split(".")[0]) >= 5:
            kwargs["use_kernels"] = False  # 5.x kernelizes after loading, and refuses the meta device
        return kind.from_pretrained(None, **kwargs)


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings off (its loading report would repeat what the check says)."""
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _failed(e: Exception) -> Check:
    msg = " ".join(str(e).split())
    return Check("load", False, f"from_pretrained failed: {type(e).__name__}: {msg[:400]}")


def _key_text(v: Any) -> str:
    """A key of a loading info: 5.x gives a mismatched key as (key, stored shape, expected shape)."""
    if isinstance(v, tuple) and len(v) == 3:
        return f"{v[0]} (stored {shape_text(v[1])}, expected {shape_text(v[2])})"
    return str(v)


def _problems(info: dict) -> Optional[Check]:
    """A failed "load" check naming the missing, unexpected and mismatched keys of a loading info, else None."""
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = sorted(_key_text(v) for v in (info.get(key) or []))
        if vals:
            problems.append(f"{key.replace('_', ' ')}: {examples(vals)}")
    return Check("load", False, "from_pretrained: " + "; ".join(problems)) if problems else None


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
    if out.weight is inp.weight:
        return None
    if out.weight.device.type != "meta" and out.weight.data_ptr() == inp.weight.data_ptr():
        return None  # two Parameters over one storage (on meta every data_ptr is 0: only identity tells)
    import transformers

    return Check("load", False, f"config.json says tie_word_embeddings, but transformers {transformers.__version__} "
                                "loaded lm_head untied (a further training step would update two matrices): save with "
                                "--strategy dedupe (dsfix apply or convert), or load with transformers >= 5.4")


def critic_load_check(reader: Any) -> Check:
    """Load a critic folder (a :class:`patcher.checkpoint.readers.safetensors.SafetensorsFolder`) the way step 3
    does without from_pretrained (which a RewardModel lacks).

    Builds :class:`patcher.checkpoint.check.critic.CriticModel` from config.json (parameters on meta, buffers
    real), loads every tensor of the files into it with ``load_state_dict(strict=True, assign=True)``, checks
    that no parameter is left on meta and that each of the module's tensors is its key's data, then runs it
    on a few tokens: one finite value per token. The tensors are the files' own pages, memory-mapped
    (:meth:`~patcher.checkpoint.readers.safetensors.SafetensorsFolder.mapped`), not copies: the process holds
    no more than the activations of 8 tokens, whatever the model's size.
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
        state = {key: reader.mapped(key) for key in reader.tensors}
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
    differ = [k for k, t in state.items() if t.numel() and live[k].data_ptr() != t.data_ptr()]
    if differ:
        return Check("load", False, f"{len(differ)} of the critic's tensors are not the file's: {examples(differ)}")
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
                               "none missing or unexpected, each the file's own (memory-mapped); "
                               "one finite value per token")
