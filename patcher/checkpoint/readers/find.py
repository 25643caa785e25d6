"""Finding the checkpoint: which folder holds the weights to read, which step, whose config, who wrote it.

Where checkpoints come from:

* ``engine.save_checkpoint(dir)`` (DeepSpeed-Chat, a plain loop) writes ``dir/latest`` (the tag) and
  ``dir/global_stepN/``; ``ds_to_universal`` writes ``latest_universal`` naming ``global_stepN_universal/``;
* the Hugging Face Trainer saves ``OUTPUT/checkpoint-N/`` (``latest``, ``global_stepN/``, ``config.json``, the
  tokenizer, ``trainer_state.json``); its ``save_model()`` at ZeRO-3 without gathering writes ``latest`` into
  ``OUTPUT`` itself;
* accelerate's ``save_state`` writes a folder with ``latest`` naming ``pytorch_model/`` beside
  ``random_states_R.pkl``;
* DeepSpeed-Chat's unpatched saves write ``pytorch_model.bin`` beside ``config.json``, and step 3 one such
  folder each in ``actor/``, ``critic/`` and ``actor_ema/``.

Where nothing needs converting:

* a Hugging Face model folder (``config.json`` beside ``model.safetensors`` or its index): what
  ``save_pretrained``, the Trainer's ``save_model()`` and a ``TrainingArguments(save_only_model=True)``
  ``checkpoint-N`` hold (:func:`is_model_folder`, :func:`choose_model_folder`).

:func:`choose_checkpoint` picks a run folder's last ``checkpoint-N`` as transformers' ``get_last_checkpoint``
does, :func:`step_folder` the step ``latest`` names, :func:`config_folder` the checkpoint's own
``config.json`` (or ``--config``), :func:`producer_of` says who wrote it, :func:`model_folders` expands a
step-3 folder. File names only: no torch here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint.names import (
    BIN_INDEX_NAME,
    BIN_NAME,
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    STEP3_SUBFOLDERS,
    examples,
)
from patcher.checkpoint.readers.peft import ADAPTER_CONFIG
from patcher.errors import DsfixError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
# transformers' Trainer saves into OUTPUT/checkpoint-N/ (trainer_utils.PREFIX_CHECKPOINT_DIR, _re_checkpoint)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"  # what marks a folder as the Trainer's checkpoint-N
ACCELERATE_STATE_RE = re.compile(r"^random_states_\d+\.pkl$")  # what accelerate's save_state writes beside the model
PRODUCERS = {"trainer": "the Hugging Face Trainer", "accelerate": "accelerate's save_state"}


def is_engine_checkpoint(path) -> bool:
    """True when ``path`` is what ``engine.save_checkpoint`` (or ``ds_to_universal``) wrote: a folder with
    ``latest``, ``latest_universal`` or step folders holding ``*_model_states.pt``, or such a step folder itself."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    return ((folder / LATEST).is_file() or (folder / LATEST_UNIVERSAL).is_file()
            or any(folder.glob("*_model_states.pt")) or any(folder.glob("*/*_model_states.pt")))


def step_folder(path, tag: Optional[str] = None) -> tuple[Path, str, str]:
    """(the step folder to read, its tag, what named it): ``path/TAG`` with ``tag``; else the folder ``latest``
    names, else the one ``latest_universal`` names (``ds_to_universal`` writes it); else ``path`` itself."""
    root = Path(path)
    if tag is not None:
        folder = root / tag
        if folder.is_dir():
            return folder, tag, "--tag"
        if root.name == tag and any(root.glob("*_model_states.pt")):
            return root, tag, "--tag"
        raise DsfixError(f"no folder {tag} here; the steps saved are {examples(_steps(root)) or 'none'}",
                         path=str(root))
    for pointer in (LATEST, LATEST_UNIVERSAL):
        if (root / pointer).is_file():
            try:
                tag = (root / pointer).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise DsfixError(f"{pointer} is unreadable: {e}", path=str(root)) from e
            if not tag or Path(tag).name != tag or not (root / tag).is_dir():
                raise DsfixError(f"{pointer} names {tag!r}, which is not a folder here (saved: "
                                 f"{examples(_steps(root)) or 'none'}; pick one with --tag)", path=str(root))
            return root / tag, tag, pointer
    return root, root.name, ""


def _steps(root: Path) -> list:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))


# --------------------------------------------------------------------------- which producer, which checkpoint


def producer_of(root: Path) -> str:
    """Who wrote the checkpoint folder ``root`` (the one holding ``latest``), from the files beside it: "trainer"
    (transformers' Trainer: checkpoint-N/ with trainer_state.json), "accelerate" (``Accelerator.save_state``:
    random_states_R.pkl), else "" (a plain ``engine.save_checkpoint``, DeepSpeed-Chat among them)."""
    root = Path(root)
    if (root / TRAINER_STATE).is_file():
        return "trainer"
    if root.is_dir() and any(ACCELERATE_STATE_RE.match(p.name) for p in root.iterdir()):
        return "accelerate"
    return ""


def run_checkpoints(path) -> list:
    """The ``checkpoint-N`` folders of a Trainer's output folder, by N (transformers' own pattern)."""
    root = Path(path)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda t: t[0])]


class Chosen(NamedTuple):
    """The checkpoint folder to convert: ``path`` itself, or one ``checkpoint-N`` of a Trainer run folder."""

    path: Path  # the checkpoint folder (holding latest, or a step folder)
    tag: Optional[str]  # --tag left for the step folder (None: latest's)
    note: str  # how it was chosen ("" when ``path`` was given itself)


def choose_checkpoint(path, tag: Optional[str] = None) -> Optional[Chosen]:
    """``path`` when it is a DeepSpeed checkpoint; in a Trainer run folder (``checkpoint-N/`` folders), the one
    ``--tag`` names, else the last one, as transformers' ``get_last_checkpoint`` picks it (the largest N); None
    when ``path`` is neither. A run folder that is also a checkpoint itself (the Trainer's ``save_model()`` at
    ZeRO-3 without gathering writes ``latest`` into its output folder) is that checkpoint, its final save,
    unless ``--tag checkpoint-N`` names one of its checkpoints. Raises DsfixError when the chosen
    ``checkpoint-N`` holds no DeepSpeed checkpoint (:func:`choose_model_folder` answers first where it is a
    Hugging Face model folder)."""
    root = Path(path)
    runs = run_checkpoints(root)
    if is_engine_checkpoint(root) and not _names_a_checkpoint(tag, runs):
        return Chosen(root, tag, "")
    if not runs:
        return None
    chosen = _pick(root, runs, tag)
    if not is_engine_checkpoint(chosen.path):
        bins = sorted(p.name for p in chosen.path.glob("pytorch_model*.bin"))
        hint = f"; a .bin folder is converted in place: dsfix convert {chosen.path}" if bins else ""
        raise DsfixError(f"{chosen.path.name} holds no DeepSpeed checkpoint (no latest): found "
                         f"{contents(chosen.path)}{hint}", path=str(root))
    return chosen


def _names_a_checkpoint(tag: Optional[str], runs: list) -> bool:
    """Whether ``--tag`` names one of a run folder's ``checkpoint-N`` (rather than the folder's own step)."""
    return tag is not None and bool(runs) and CHECKPOINT_RE.match(tag) is not None


def _pick(root: Path, runs: list, tag: Optional[str]) -> Chosen:
    """The ``checkpoint-N`` of the run folder ``root`` that ``--tag`` names, else its last one (the largest N)."""
    names = [p.name for p in runs]
    listed = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]} ({len(names)} in all)"
    if tag is not None:
        if not CHECKPOINT_RE.match(tag):
            raise DsfixError(f"--tag {tag}: here --tag names a checkpoint-N ({listed}); for a step, give that "
                             "checkpoint-N", path=str(root))
        if tag not in names:
            raise DsfixError(f"--tag {tag}: no such checkpoint here; the run saved {listed}", path=str(root))
        return Chosen(root / tag, None, f"{tag} (as --tag names it, of {listed})")
    chosen = runs[-1]
    return Chosen(chosen, None, f"{chosen.name} (the last of {listed}, as transformers' get_last_checkpoint picks it"
                  + ("; --tag checkpoint-N picks another)" if len(runs) > 1 else ")"))


# --------------------------------------------------------------------------- Hugging Face model folders


def is_model_folder(path) -> bool:
    """A Hugging Face model folder: ``config.json`` beside safetensors weights (``model.safetensors`` or its
    index), with no ``.bin`` weights and no DeepSpeed checkpoint beside them. ``save_pretrained``, the Trainer's
    ``save_model()`` and a ``TrainingArguments(save_only_model=True)`` ``checkpoint-N`` write one."""
    folder = Path(path)
    return (folder.is_dir() and (folder / CONFIG_NAME).is_file()
            and any((folder / n).is_file() for n in (SINGLE_NAME, INDEX_NAME))
            and not any((folder / n).is_file() for n in (BIN_NAME, BIN_INDEX_NAME))
            and not is_engine_checkpoint(folder))


def choose_model_folder(path, tag: Optional[str] = None) -> Optional[Chosen]:
    """The Hugging Face model folder that stands where a checkpoint is looked for, nothing to convert in it:
    ``path`` itself (unless ``--tag checkpoint-N`` names one of its run's checkpoints), or in a Trainer run
    folder the ``checkpoint-N`` :func:`choose_checkpoint` would choose (a run saved with ``save_only_model``, or
    without DeepSpeed). None otherwise. Raises DsfixError where ``--tag`` names no checkpoint of the run."""
    root = Path(path)
    runs = run_checkpoints(root)
    if is_model_folder(root) and not _names_a_checkpoint(tag, runs):
        return Chosen(root, tag, "")
    if not runs or _holds_weights(root) or (is_engine_checkpoint(root) and not _names_a_checkpoint(tag, runs)):
        return None
    chosen = _pick(root, runs, tag)
    return chosen if is_model_folder(chosen.path) else None


def config_folder(path, step: Path) -> Optional[Path]:
    """The checkpoint's own folder holding ``config.json`` (the Trainer writes it into checkpoint-N/ with the
    generation config and the tokenizer): ``path`` itself, or, when ``path`` is the step folder, the folder
    holding it with its ``latest``. None when neither holds one."""
    root = Path(path)
    candidates = [root]
    if Path(step) == root and ((root.parent / LATEST).is_file() or (root.parent / LATEST_UNIVERSAL).is_file()):
        candidates.append(root.parent)
    return next((c for c in candidates if (c / CONFIG_NAME).is_file()), None)


def config_for(chosen: Chosen, config) -> tuple[Path, bool]:
    """(the folder whose config.json, generation config and tokenizer go with the weights, whether it is the
    checkpoint's own): ``--config`` when given, else the checkpoint's folder when it holds config.json (the
    Trainer's checkpoint-N/ does); else one line saying that --config is needed, and why."""
    if config is not None:
        return given_config(config), False
    step, _, _ = step_folder(chosen.path, chosen.tag)
    own = config_folder(chosen.path, step)
    if own is not None:
        return own, True
    root = step.parent if step != chosen.path else chosen.path
    who = {"accelerate": "accelerate's save_state writes none", "trainer": "this checkpoint-N has none"}.get(
        producer_of(root), "engine.save_checkpoint writes none")
    peft = " (ADAPTER_DIR for PEFT)" if producer_of(root) == "accelerate" else ""
    raise DsfixError(f"no {CONFIG_NAME} here ({who}): convert needs --config MODEL_DIR, the model's folder{peft}",
                     path=str(chosen.path))


def given_config(config) -> Path:
    """``--config``: a folder holding config.json (the caller has checked that it is a folder)."""
    config = Path(config)
    if not (config / CONFIG_NAME).is_file():
        raise DsfixError(f"--config: no {CONFIG_NAME} in this folder", path=str(config))
    return config


def adapter_folder(path, step: Path) -> Optional[Path]:
    """The checkpoint's folder holding a PEFT run's ``adapter_config.json`` (the Trainer writes it into
    checkpoint-N/ beside the engine files): ``path``, or the folder holding the step folder; None: not a PEFT run."""
    for folder in (Path(path), Path(step).parent):
        if (folder / ADAPTER_CONFIG).is_file():
            return folder
    return None


def _beside(folder: Path) -> list:
    """The folders near ``folder`` where a run keeps its other saves: its parent, its siblings, its subfolders."""
    folder = Path(folder).resolve()
    near = [folder.parent]
    for root in (folder.parent, folder):
        try:
            near += sorted(p for p in root.iterdir() if p.is_dir() and p != folder)
        except OSError:
            pass
    return near


def engine_files_beside(folder) -> list:
    """The DeepSpeed checkpoints (accelerate's ``save_state`` folders among them) beside an adapter folder that
    ``save_pretrained`` wrote: in its parent, its siblings or its subfolders."""
    return [p for p in _beside(folder) if is_engine_checkpoint(p)]


def adapter_configs_beside(folder) -> list:
    """The folders holding an ``adapter_config.json`` beside a checkpoint (an accelerate ``save_state`` folder):
    its parent, its siblings, its subfolders."""
    return [p for p in _beside(folder) if (p / ADAPTER_CONFIG).is_file()]


def contents(folder) -> str:
    """What a folder holds, in a few names (folders with a slash), for a one-line refusal."""
    try:
        items = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(folder).iterdir())
    except OSError as e:
        return f"nothing readable ({e.strerror or e})"
    return examples(items) if items else "an empty folder"


# --------------------------------------------------------------------------- model folders


def model_folders(path) -> list:
    """The model folders under ``path``: ``[path]`` when it holds weights (safetensors or ``.bin``) itself,
    else its step-3 subfolders (``actor``, ``critic``, ``actor_ema``) that exist, else ``[path]``."""
    folder = Path(path)
    if not folder.is_dir() or _holds_weights(folder):
        return [folder]
    subs = [folder / name for name in STEP3_SUBFOLDERS if (folder / name).is_dir()]
    return subs or [folder]


def _holds_weights(folder: Path) -> bool:
    """Model weights of either format (not any .bin: a step-3 folder may hold training_args.bin)."""
    return any(True for pattern in ("*.safetensors", "pytorch_model*.bin", INDEX_NAME, BIN_INDEX_NAME)
               for _ in folder.glob(pattern))
