"""Check a saved model folder against its own config.json, reading safetensors headers, not weights.

``verify_folder`` works on any folder: dsfix's own saves (311 tensors for Qwen3-0.6B), a transformers
``save_pretrained`` folder (310: the tied ``lm_head.weight`` dropped), or a broken save. It builds the
model from config.json on the meta device to learn the expected keys, shapes and tied aliases, then
compares the file headers with them. torch and transformers are imported inside the functions, so
``import patcher.checkpoint.verify`` stays cheap for the patch path.

Two kinds of folder, told apart by their keys:

* ``causal-lm``: any causal LM (a Trainer's or accelerate's model, a converted checkpoint, DeepSpeed-Chat's
  step-1 model and step-3 ``actor``/``actor_ema``), checked against
  ``AutoModelForCausalLM.from_config`` and loaded with ``from_pretrained``;
* ``critic``: step 2's reward model and step 3's ``critic`` (``rwtransformer.*`` plus ``v_head.weight``,
  with the base model's config), checked against :class:`patcher.checkpoint.critic.CriticModel` built the way
  DeepSpeed-Chat's ``create_critic_model`` builds it, and loaded into that module with strict key
  matching.

``model_folders`` expands a step-3 output folder into its ``actor``, ``critic`` and ``actor_ema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from patcher.checkpoint.checks import (
    CONFIG_NAME, INDEX_NAME, Check, Header, dtype_check, examples, finite_check, keys_check, load_config,
    nonempty_check, read_headers, row_blocks, shape_text, shapes_check, weight_files,
)
from patcher.errors import DsfixError, need_folder
from patcher.report import Checks, Result, Verdict

STEP3_SUBFOLDERS = ("actor", "critic", "actor_ema")  # what DeepSpeed-Chat's step 3 saves under its output folder

CAUSAL_LM = "causal-lm"
CRITIC = "critic"
KIND_TEXT = {
    CAUSAL_LM: "causal LM (a Trainer's or accelerate's model, DeepSpeed-Chat's step-1 model or step-3 actor/EMA)",
    CRITIC: "reward/critic model (rwtransformer.* + v_head.weight, as create_critic_model builds it)",
}


@dataclass(frozen=True)
class VerifyReport(Checks):
    """One folder's checks (a step-3 folder gives one per model folder; :class:`VerifyResult` holds them)."""

    path: str
    ok: bool
    checks: tuple  # of Check(name, ok, detail)
    tensors: int
    dtype: Optional[str] = None  # the one floating dtype in the files, if they agree
    files: tuple = ()  # the safetensors files read, relative to path
    expected: Optional[int] = None  # keys the config's model has (tied aliases included)
    kind: str = CAUSAL_LM  # CAUSAL_LM or CRITIC, from the file's keys

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "ok": self.ok,
            "kind": self.kind,
            "tensors": self.tensors,
            "expected_keys": self.expected,
            "dtype": self.dtype,
            "files": list(self.files),
            "checks": [c._asdict() for c in self.checks],
        }

    @property
    def summary(self) -> str:
        verdict = "all checks hold" if self.ok else "verification FAILED"
        return f"{verdict}: {self.tensors} tensors, {KIND_TEXT[self.kind]}"


@dataclass(frozen=True)
class VerifyResult(Result):
    """``dsfix verify``'s result: one report per model folder. With one folder, that folder's keys are also
    at the top level of the JSON (``ok``, ``tensors``, ``checks``, ...)."""

    path: str
    reports: tuple  # of VerifyReport
    verb = "verify"
    warnings = ()

    @property
    def status(self) -> Verdict:
        return Verdict.of(all(r.ok for r in self.reports))

    @property
    def message(self) -> str:
        if len(self.reports) == 1:
            return self.reports[0].summary
        bad = [Path(r.path).name for r in self.reports if not r.ok]
        return (f"verification FAILED in {', '.join(bad)}" if bad else
                f"all checks hold in {len(self.reports)} folders")

    def body(self) -> dict:
        head = self.reports[0].to_dict() if len(self.reports) == 1 else {}
        return {**head, "path": self.path, "ok": self.status is Verdict.PASSED,
                "folders": [r.to_dict() for r in self.reports]}


def checks_table(checks, title: str = "dsfix verify"):
    """A rich Table of (name, ok, detail) rows, for the CLI and smoke to print to stderr."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, "[green]ok[/]" if c.ok else "[bold red]FAIL[/]", _escape(c.detail))
    return table


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------- reading the folder


def _read_tensor(folder: Path, file: str, key: str):
    from safetensors import safe_open

    with safe_open(str(folder / file), framework="pt") as f:
        return f.get_tensor(key)


def folder_kind(keys) -> str:
    """CRITIC when the keys are a reward/critic model's (``v_head.weight``, ``rwtransformer.*``), else CAUSAL_LM."""
    return CRITIC if any(k == "v_head.weight" or k.startswith("rwtransformer.") for k in keys) else CAUSAL_LM


def meta_model(cfg, kind: str = CAUSAL_LM):
    """The config's model on the meta device: a causal LM, or the critic as create_critic_model builds it."""
    import torch

    if kind == CRITIC:
        from patcher.checkpoint.critic import build_critic

        return build_critic(cfg)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def model_name(model, kind: str = CAUSAL_LM) -> str:
    if kind == CRITIC:
        return f"{type(model.rwtransformer).__name__} under rwtransformer. + v_head"
    return type(model).__name__


def expected_of(model) -> tuple[dict, list]:
    """(key -> shape, tie groups) of a (meta) model's state dict; tied keys are one tensor object."""
    sd = model.state_dict(keep_vars=True)
    shapes = {k: tuple(int(d) for d in v.shape) for k, v in sd.items()}
    groups: dict = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    return shapes, [g for g in groups.values() if len(g) > 1]


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
    return any(True for pattern in ("*.safetensors", "pytorch_model*.bin", INDEX_NAME, "pytorch_model.bin.index.json")
               for _ in folder.glob(pattern))


# --------------------------------------------------------------------------- the checks


def verify_path(path, expect: Optional[int] = None, load: bool = True, against=None, atol: float = 0.0,
                rtol: float = 0.0) -> VerifyResult:
    """``dsfix verify PATH``: every model folder under ``path`` (see model_folders), third-party output off.
    Bad input (no such folder, a file, no weights) is refused before torch is imported. With ``against``: each
    folder compared with the reference folder instead (:func:`compare_path`)."""
    from patcher.checkpoint.quiet import quiet

    folders = model_folders(path)
    for folder in folders:
        need_folder(folder)
        try:
            weight_files(folder)
        except DsfixError as e:  # a save killed between moving a file aside and its successor in
            killed = leftover_check(folder)
            if killed is None or killed.ok:
                raise
            raise DsfixError(f"{e.message}; {killed.detail}", path=e.path) from None
    if against is not None:
        from patcher.checkpoint.compare import is_bin_reference

        for folder in model_folders(against):
            need_folder(folder)
            if not is_bin_reference(folder):  # a pytorch_model.bin reference (zero_to_fp32's) is read as it is
                weight_files(folder)
    with quiet():
        if against is not None:
            return compare_path(path, against, expect=expect, atol=atol, rtol=rtol)
        return VerifyResult(str(path), tuple(verify_folder(p, expect=expect, load=load, finite=True) for p in folders))


def _holds_dsfix_names(folder: Path) -> bool:
    """Whether ``folder`` or its fallback folder holds a hidden entry of dsfix's naming (a staging folder, a
    temporary file), where a killed save may have left its files: only then is the save module imported to
    read them (it imports torch), so that bad input is still answered before torch."""
    return any(p.name.startswith(".") and "dsfix" in p.name
               for where in (folder, folder / "dsfix-fallback") if where.is_dir() for p in where.iterdir())


def leftover_check(path) -> Optional[Check]:
    """What killed saves of dsfix's save module left in ``path`` (its ``find_leftovers``), or None when there
    is nothing. It fails when a save killed in its final phase left the folder mixing its files and the
    previous save's, and names them: those in place, those missing, those moved aside."""
    import os

    if not _holds_dsfix_names(Path(path)):  # nothing a save could have left: no need of torch to say so
        return None
    from patcher.templates.dsfix_safetensors import find_leftovers

    found = find_leftovers(str(path))
    if not found:
        return None
    notes = []
    for left in found:
        where = os.path.relpath(left.path, str(path))
        if not left.moving:
            notes.append(f"{where}: left by a killed save, nothing of it in place (the next save removes it)")
            continue
        parts = [f"{where}: a save killed while moving its files into place"]
        for label, names in (("its files in place", left.moved_in), ("not moved in", left.pending),
                             ("missing", left.missing), (f"the previous save's, moved aside into {where}/.replaced",
                                                         left.aside),
                             ("the previous save's weight files still in place", left.stale)):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        parts.append("the next save into this folder completes it" if left.mixed else
                     "every file of the new save is in place (the next save removes the rest)")
        notes.append("; ".join(parts))
    return Check("leftovers", not any(left.mixed for left in found), " | ".join(notes))


def compare_path(path, against, expect: Optional[int] = None, atol: float = 0.0, rtol: float = 0.0) -> VerifyResult:
    """``dsfix verify PATH --against REF``: each model folder under ``path`` compared with the same one under
    ``against`` (:mod:`patcher.checkpoint.compare`); a step-3 folder's actor/critic/actor_ema pair by name."""
    from patcher.checkpoint.compare import compare_folders

    if expect is not None:
        raise DsfixError("--expect checks a folder against its config; with --against the reference sets the keys")
    folders, refs = model_folders(path), model_folders(against)
    if len(folders) > 1 or len(refs) > 1:
        names, ref_names = [p.name for p in folders], [p.name for p in refs]
        if names != ref_names:
            raise DsfixError(f"holds {', '.join(names)} but --against holds {', '.join(ref_names)}: "
                             "compare model folders one by one", path=str(path))
    return VerifyResult(str(path), tuple(compare_folders(p, r, atol=atol, rtol=rtol) for p, r in zip(folders, refs)))


def verify_folder(path, expect: Optional[int] = None, load: bool = True, finite: bool = False) -> VerifyReport:
    """Check the model saved in ``path``. Raises DsfixError (code 2) on bad input; failing checks give ok=False.
    ``finite``: also read every floating tensor for NaN and Inf (``dsfix verify`` and ``dsfix smoke`` do)."""
    folder = Path(path)
    need_folder(folder)
    files, weight_map, file_problems = weight_files(folder)
    head = read_headers(folder, files, weight_map)
    problems = file_problems + head.problems
    if not head.entries and not problems:
        raise DsfixError("the weight files hold no tensors", path=str(path))

    checks: list = []
    cfg, cfg_check, cfg_dtype = load_config(folder)
    checks.append(cfg_check)
    what = f"{len(files)} shard(s) via {INDEX_NAME}" if weight_map is not None else examples(files)
    checks.append(Check("files", not problems, "; ".join(problems) if problems else f"{what}, {len(head.entries)} tensors"))

    kind = folder_kind(head.entries)
    expected_shapes, tie_groups, built = _expected(cfg, kind, checks)
    if expected_shapes is not None:
        keys = keys_check(head, expected_shapes, tie_groups)
        if kind == CRITIC:
            keys = keys._replace(detail=f"{keys.detail} (critic: {built})")
        checks.append(keys)
        checks.append(shapes_check(head, expected_shapes))
    checks.append(nonempty_check(head))
    dtype_row, dtype_name = dtype_check(head, cfg_dtype)
    checks.append(dtype_row)
    if finite:
        checks.append(finite_check(folder, head))
    if tie_groups:
        checks.append(_tied_check(folder, head, tie_groups))
    leftovers = leftover_check(folder)
    if leftovers is not None:
        checks.append(leftovers)
    if expect is not None:
        n = len(head.entries)
        checks.append(Check("count", n == expect, f"{n} tensors" + ("" if n == expect else f", expected {expect}")))
    if load and cfg is not None:
        checks.append(critic_load_check(folder, head) if kind == CRITIC else load_check(folder)[0])

    return VerifyReport(
        path=str(path),
        ok=all(c.ok for c in checks),
        checks=tuple(checks),
        tensors=len(head.entries),
        dtype=dtype_name,
        files=tuple(files),
        expected=len(expected_shapes) if expected_shapes is not None else None,
        kind=kind,
    )


def _expected(cfg, kind: str, checks: list) -> tuple[Optional[dict], list, Optional[str]]:
    """(expected shapes, tie groups, the model class built) from ``cfg``'s model built on the meta device;
    (None, [], None) without a config, or with a failing "keys" row appended to ``checks`` when it cannot
    be built."""
    if cfg is None:
        return None, [], None
    try:
        model = meta_model(cfg, kind)
        built = model_name(model, kind)
        expected_shapes, tie_groups = expected_of(model)
        return expected_shapes, tie_groups, built
    except Exception as e:
        what = "the critic (AutoModel + v_head)" if kind == CRITIC else "a causal-LM"
        checks.append(Check("keys", False, f"cannot build {what} from {CONFIG_NAME} on meta: {type(e).__name__}: {e}"))
        return None, [], None


def _tied_check(folder: Path, head: Header, tie_groups: list) -> Check:
    notes, bad = [], []
    for group in tie_groups:
        present = [k for k in group if k in head.entries]
        if len(present) < 2:
            continue
        for other in present[1:]:
            if _equal_in_files(folder, head, present[0], other):
                notes.append(f"{other} == {present[0]}")
            else:
                bad.append(f"{other} != {present[0]}")
    if bad:
        return Check("tied", False, f"tied aliases differ from their partner: {examples(bad)} "
                                    "(from_pretrained re-ties them and silently keeps only one)")
    if not notes:
        return Check("tied", True, "tied aliases not stored (transformers re-ties on load)")
    return Check("tied", True, examples(notes))


def _equal_in_files(folder: Path, head: Header, a: str, b: str) -> bool:
    """torch.equal of two stored tensors, read a block of rows at a time (not two whole copies at once)."""
    import torch
    from safetensors import safe_open

    (shape, code, file_a), (shape_b, code_b, file_b) = head.entries[a], head.entries[b]
    if tuple(shape) != tuple(shape_b) or code != code_b:
        return False
    if not shape or 0 in shape:
        return torch.equal(_read_tensor(folder, file_a, a), _read_tensor(folder, file_b, b))
    with safe_open(str(folder / file_a), framework="pt") as fa, safe_open(str(folder / file_b), framework="pt") as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        for rows in row_blocks(shape):
            if not torch.equal(sa[rows], sb[rows]):
                return False
    return True


def load_check(path, *, dtype=None, device=None, keep_model: bool = False, attn_implementation=None):
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
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = list(info.get(key) or [])
        if vals:
            problems.append(f"{key.replace('_', ' ')}: {examples(vals)}")
    if problems:
        return Check("load", False, "from_pretrained: " + "; ".join(problems)), (model if keep_model else None)
    untied = tie_on_load_check(model)
    if untied is not None:
        return untied, (model if keep_model else None)
    if device is not None:
        model = model.to(device)
    return Check("load", True, "from_pretrained: no missing, unexpected or mismatched keys"), (model if keep_model else None)


def tie_on_load_check(model) -> Optional[Check]:
    """A failed "load" check when the config says ``tie_word_embeddings`` but the loaded model's output
    embedding is a matrix of its own, else None.

    transformers 5.0 to 5.3 load a folder that stores both ``lm_head.weight`` and the embedding (dsfix's
    default clone output) untied: equal values, but two matrices that a further training step updates
    apart. 4.x and 5.4+ tie them again; a folder without the alias (``--strategy dedupe``) loads tied
    everywhere."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
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


def critic_load_check(path, head: Optional[Header] = None) -> Check:
    """Load a critic folder the way step 3 does without from_pretrained (which a RewardModel lacks).

    Builds :class:`patcher.checkpoint.critic.CriticModel` from config.json (parameters on meta, buffers real),
    loads every tensor of the files into it with ``load_state_dict(strict=True, assign=True)``, checks
    that no parameter is left on meta and that each of the module's tensors holds its key's data, then
    runs it on a few tokens: one finite value per token.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    from patcher.checkpoint.critic import build_critic

    folder = Path(path)
    try:
        model = build_critic(AutoConfig.from_pretrained(str(folder)), on_meta=False)
    except Exception as e:
        return Check("load", False, f"cannot build the critic from {CONFIG_NAME}: {type(e).__name__}: {e}")
    if head is None:
        files, weight_map, _ = weight_files(folder)
        head = read_headers(folder, files, weight_map)
    state = {}
    for name in head.files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except Exception as e:
            return Check("load", False, f"cannot read {name}: {type(e).__name__}: {e}")
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


def same_bits(a, b) -> bool:
    """True when two tensors have the same dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    # compare as integers of the element's width: bit-exact, and wider words compare faster than bytes
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size(), torch.uint8)
    return torch.equal(a.detach().reshape(-1).view(as_int), b.detach().reshape(-1).view(as_int))


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
