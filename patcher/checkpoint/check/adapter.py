"""A PEFT adapter folder checked against its ``adapter_config.json`` and its base model's config.

The expected keys and shapes are PEFT's own: the base model is built from its config on the meta device,
``get_peft_model`` puts the adapter's layers on it as ``adapter_config.json`` says (``r``, the target modules,
``modules_to_save``), and ``get_peft_model_state_dict`` names what ``save_pretrained`` would write. The folder's
``adapter_model.safetensors`` must hold exactly that: every target module's ``lora_A`` (r x in) and ``lora_B``
(out x r), non-empty, finite; and it must load into that model through PEFT's own ``set_peft_model_state_dict``
with no adapter key missing or unexpected. An empty file (what PEFT writes at ZeRO-3 without the gather) fails
with its cause and the command that recovers the adapter from the checkpoint's engine files.

The base model's config: ``--base`` when given, else ``adapter_config.json``'s ``base_model_name_or_path`` when it
is a folder here or a model in the Hugging Face cache (nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.headers import Check, against_model, dtype_check, nonempty_check
from patcher.checkpoint.check.model import ADAPTER, Expected, Model, load_config
from patcher.checkpoint.check.values import finite_check
from patcher.checkpoint.check.verify import VerifyReport
from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.find import engine_files_beside, is_engine_checkpoint
from patcher.checkpoint.readers.peft import (
    ADAPTER_BIN,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_text,
    base_folder,
    read_adapter_config,
)
from patcher.checkpoint.readers.safetensors import SafetensorsFolder
from patcher.errors import DsfixError


def base_config(config: dict, base: Optional[Path]) -> tuple[Any, Check]:
    """(the base model's config or None, the "base" row): ``base`` when given, else the folder or cached model
    ``base_model_name_or_path`` names (:func:`patcher.checkpoint.readers.peft.base_folder`)."""
    folder, found = base_folder(config, base)
    if folder is not None:
        cfg, check, _ = load_config(folder)
        return cfg, check._replace(name="base", detail=f"{found}: {check.detail}")
    named = str(config.get("base_model_name_or_path") or "")
    where = f"{named} is neither a folder here nor in the Hugging Face cache" if named else "it names no base model"
    return None, Check("base", False, f"{ADAPTER_CONFIG}'s base_model_name_or_path: {where}; pass --base BASE_DIR")


def peft_config(config: dict) -> Any:
    """PEFT's own config class of ``config`` (adapter_config.json), as ``PeftConfig.from_pretrained`` builds it; a
    DsfixError names a PEFT type this PEFT does not know."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    kind = str(config.get("peft_type", "")).upper()
    klass = PEFT_TYPE_TO_CONFIG_MAPPING.get(kind)
    if klass is None:
        raise DsfixError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not one this PEFT knows")
    return klass(**{k: v for k, v in config.items() if k in klass.__dataclass_fields__})


def peft_model(config: dict, cfg: Any, dtype: Any = None, adapter: str = "default") -> Any:
    """The PEFT model of ``config`` (adapter_config.json) on the base built from ``cfg`` (in ``dtype``, else the
    default), on the meta device, as ``get_peft_model`` builds it (the adapter named ``adapter``)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    with torch.device("meta"):
        return get_peft_model(AutoModelForCausalLM.from_config(cfg, **kwargs), peft_config(config), adapter)


def saved_names(model: Any, adapter: str = "default") -> dict:
    """{the PEFT model's state-dict key: the name PEFT's own ``get_peft_model_state_dict`` saves it under}, read
    from PEFT itself (each key given a tensor of its own, then followed by identity through PEFT's renames). A
    DsfixError names a PEFT type whose saved tensors are computed (prompt learning), not renamed parameters."""
    import torch
    from peft import get_peft_model_state_dict

    config = model.peft_config[adapter]
    if config.is_prompt_learning:
        raise DsfixError(f"refused: a PEFT {config.peft_type.value} adapter (prompt learning) saves tensors computed "
                         "from its prompt encoder, not renamed parameters; dsfix reads adapters of parameters")
    state = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    owner = {id(v): k for k, v in state.items()}
    saved = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    computed = [k for k, v in saved.items() if id(v) not in owner]
    if computed:
        raise DsfixError(f"refused: a PEFT {config.peft_type.value} adapter saves {examples(computed)}, "
                         "computed from its model rather than a parameter; dsfix reads adapters of parameters")
    return {owner[id(v)]: k for k, v in saved.items()}


def adapter_model(folder: Path, base: Optional[Path] = None, config: Optional[dict] = None) -> Model:
    """What the adapter of ``folder`` (its adapter_config.json, or ``config``) must hold, on its base model."""
    from patcher.prereq import require_peft

    config = config if config is not None else read_adapter_config(folder)
    if config is None:
        raise DsfixError(f"no {ADAPTER_CONFIG}: not a PEFT adapter folder", path=str(folder))
    require_peft("a PEFT adapter's checks")
    targets = config.get("target_modules")
    detail = f"{adapter_text(config)}, targets {examples(sorted(targets)) if isinstance(targets, list) else targets}"
    cfg, base_row = base_config(config, base)
    model = Model(cfg, Check("config", True, detail), None, None, None, ADAPTER, config, base_row)
    if cfg is None:
        return model
    try:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(peft_model(config, cfg))
        shapes = {k: tuple(int(d) for d in v.shape) for k, v in state.items()}
        built = f"PEFT {config.get('peft_type')} on {type(cfg).__name__}"
        return model._replace(expected=Expected(shapes, [], built, None))
    except Exception as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return model._replace(failed=Check("keys", False, f"cannot build the adapter of {ADAPTER_CONFIG} on its base "
                                                          f"on meta: {why}"))


def adapter_checks(reader: Any, model: Model, head: Any, load: bool) -> list:
    """The checks of an adapter's weights (``reader``'s, ``head`` its header) against ``model``."""
    checks = [model.config_row, model.base_row]
    if model.failed is not None:
        checks.append(model.failed)
    if model.expected is not None:
        keys, shapes, nonempty = against_model(head, model.expected.shapes, [])
        checks += [keys, shapes, nonempty] if head.entries else [keys, nonempty]  # no row holds over no tensor
    else:
        checks.append(nonempty_check(head))
    if not head.entries:
        return checks
    checks += [dtype_check(head, None)[0], finite_check(reader, head)]
    if load and model.expected is not None:
        checks.append(adapter_load_check(reader, model))
    return checks


def adapter_load_check(reader: Any, model: Model) -> Check:
    """The adapter loaded into its PEFT model by PEFT's own ``set_peft_model_state_dict``: no adapter key missing
    or unexpected, no shape refused."""
    from peft import set_peft_model_state_dict

    if model.adapter is None:
        return Check("load", False, f"no {ADAPTER_CONFIG} to build the adapter's model from")
    state = {k: reader.slice(k)[:] if reader.tensors[k].shape else reader.slice(k) for k in reader.tensors}
    try:
        result = set_peft_model_state_dict(peft_model(model.adapter, model.cfg), state, low_cpu_mem_usage=True)
    except Exception as e:
        return Check("load", False, f"PEFT refused it: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    problems = [f"{what}: {examples(keys)}" for what, keys in (("missing", missing),
                                                               ("unexpected", list(result.unexpected_keys))) if keys]
    if problems:
        return Check("load", False, "PEFT's set_peft_model_state_dict: " + "; ".join(problems))
    return Check("load", True, f"PEFT's set_peft_model_state_dict: {len(state)} tensors, none missing or unexpected")


def verify_adapter(folder: Path, base: Optional[Path] = None, load: bool = True) -> VerifyReport:
    """``dsfix verify`` of a PEFT adapter folder (a Trainer's ``checkpoint-N`` of a PEFT run, or what
    ``dsfix convert`` wrote from one)."""
    folder = Path(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        found = f"only {ADAPTER_BIN} (a pickle save)" if (folder / ADAPTER_BIN).is_file() else "no adapter weights"
        raise DsfixError(f"{ADAPTER_CONFIG} but {found}: nothing to verify", path=str(folder))
    model = adapter_model(folder, base)
    with SafetensorsFolder(folder, single=ADAPTER_WEIGHTS) as reader:
        head = reader.header
        checks = adapter_checks(reader, model, head, load)
        files = Check("files", not head.problems and bool(head.entries), "; ".join(head.problems) or reader.describe())
        checks.insert(1, files)
    cause = empty_cause(head)
    if cause:
        cure = f"{cause}; {recovery(folder)}"
        checks = [c._replace(ok=False, detail=cure) if c.name == "non-empty" else c for c in checks]
    else:
        cure = failed_line(checks)
    return VerifyReport(path=str(folder), ok=all(c.ok for c in checks), checks=tuple(checks), tensors=len(head.entries),
                        dtype=dtype_check(head, None)[1], files=tuple(head.files),
                        expected=len(model.expected.shapes) if model.expected is not None else None, kind=ADAPTER,
                        cure=cure)


def empty_cause(head: Any) -> str:
    """Why an adapter file holds no adapter ("" when it holds one): 0 tensors, or tensors of 0 elements (ZeRO-3's
    partitioned parameters, saved by PEFT as they are on the rank)."""
    if not head.entries:
        return f"{ADAPTER_WEIGHTS} holds 0 tensors (PEFT's save under ZeRO-3 without the gather)"
    empty = [k for k, (shape, _, _) in head.entries.items() if 0 in shape]
    if not empty:
        return ""
    return (f"{ADAPTER_WEIGHTS} holds {len(empty)} of {len(head.entries)} tensors empty (ZeRO-3 partitions, not "
            "gathered)")


def recovery(folder: Path) -> str:
    """Where an empty adapter folder's adapter is, and the convert that recovers it: the checkpoint-N it is in, an
    engine checkpoint beside it (accelerate's save_state), or the one to give."""
    if is_engine_checkpoint(folder):
        return f"the adapter is in the engine files: dsfix convert {folder} --output ADAPTER_DIR"
    found = engine_files_beside(folder)
    if len(found) == 1:
        return f"it is in the engine files beside it: dsfix convert {found[0]} --config {folder} --output OUT"
    return f"it is in the run's engine files: dsfix convert STATE_FOLDER --config {folder} --output OUT"


NEXT = {  # a failed check of an adapter folder -> the next step ("" where its detail names it)
    "config": f"fix {ADAPTER_CONFIG}, or convert the run's engine files again with dsfix convert",
    "base": "",
    "files": "convert the run's engine files again into a new folder with dsfix convert",
    "keys": "pass --base, the model it was trained on; else convert the run's engine files again",
    "shapes": "pass --base, the model it was trained on; else convert the run's engine files again",
    "load": "pass --base, the model it was trained on; else convert the run's engine files again",
    "finite": "the training diverged: convert an earlier checkpoint-N",
}


def failed_line(checks: list) -> str:
    """The last line of a failed adapter's verify: its first failed check, in short, and the next step ("" when
    every check holds)."""
    first = next((c for c in checks if not c.ok), None)
    if first is None:
        return ""
    step = NEXT.get(first.name, "see the table above")
    room = 100 if step else 170  # a detail that names the next step itself is kept whole
    detail = first.detail if len(first.detail) <= room else first.detail[:room - 3] + "..."
    return f"{first.name}: {detail}" + (f"; next: {step}" if step else "")
