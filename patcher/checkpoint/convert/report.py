"""What ``dsfix convert`` reports, and how it is shown: one result for ``.bin`` folders converted in place, one for
weights converted into ``--output`` (a checkpoint, or a ``.bin`` folder), one for a folder that already is a
Hugging Face model; each renders itself (short lines, the checks table) for the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.headers import render
from patcher.checkpoint.check.model import KIND_TEXT
from patcher.checkpoint.names import CONFIG_NAME, examples
from patcher.checkpoint.readers.find import PRODUCERS
from patcher.checkpoint.steps.lora import FILE as LORA_FILE
from patcher.errors import OK, PENDING
from patcher.report import Checks, Result, Status


class ConvertStatus(Status):
    """What happened to one folder, and to the whole run (the worst of its folders)."""

    CONVERTED = ("converted", OK)
    NOTHING = ("nothing to convert", OK)
    FAILED = ("failed", PENDING)  # a check failed: nothing written
    NOT_WRITTEN = ("not written", PENDING)  # this folder passed, another failed: nothing written


# --------------------------------------------------------------------------- .bin folders, in place


@dataclass(frozen=True)
class FolderResult(Checks):
    path: str
    status: ConvertStatus
    ok: bool
    checks: tuple = ()
    kind: Optional[str] = None
    strategy: str = "clone"
    source: tuple = ()  # the .bin files read (names in the folder)
    written: tuple = ()  # the files written (names in the folder)
    tensors: Optional[int] = None
    restored: tuple = ()  # "ALIAS <- PARTNER": tied aliases written as their own copy though the .bin lacked them
    dropped: tuple = ()  # tied aliases the .bin held but dedupe left out
    removed: tuple = ()  # .bin files removed (--remove-bin)
    bytes_written: int = 0
    mmap: Optional[bool] = None  # whether the .bin was memory-mapped
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "path": self.path, "status": self.status.value, "ok": self.ok, "kind": self.kind,
            "strategy": self.strategy, "source": list(self.source), "written": list(self.written),
            "tensors": self.tensors, "restored": list(self.restored), "dropped": list(self.dropped),
            "removed": list(self.removed), "bytes_written": self.bytes_written, "mmap": self.mmap,
            "note": self.note, "checks": [c._asdict() for c in self.checks],
        }

    def summary(self) -> str:
        if self.status is ConvertStatus.NOTHING:
            return f"nothing to convert in {self.path}: {self.note}"
        if self.status is ConvertStatus.NOT_WRITTEN:
            return f"not converted {self.path}: {self.note}"
        if self.status is ConvertStatus.FAILED:
            return f"not converted {self.path}: a check failed; nothing written"
        how = self.strategy
        if self.restored:
            how += f"; restored {examples(self.restored)}"
        if self.dropped:
            how += f"; dropped tied alias {examples(self.dropped)}"
        return f"converted {self.path}: {self.tensors} tensors ({how})"

    def files(self) -> str:
        """A converted folder's files: read, written, and the .bin kept or removed (the line after the summary)."""
        tail = (f"removed {examples(self.removed, 1)}" if self.removed
                else f"{examples(self.source, 1)} kept (--remove-bin removes it)")
        return f"{examples(self.source, 1)} -> {examples(self.written, 1)}; {tail}"


@dataclass(frozen=True)
class ConvertReport(Result):
    """``dsfix convert`` of ``.bin`` output folders: one :class:`FolderResult` each, converted in place."""

    path: str
    strategy: str
    folders: tuple  # of FolderResult
    verb = "convert"
    warnings = ()

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.folders)

    @property
    def status(self) -> ConvertStatus:
        if not self.ok:
            return ConvertStatus.FAILED
        done = any(f.status is ConvertStatus.CONVERTED for f in self.folders)
        return ConvertStatus.CONVERTED if done else ConvertStatus.NOTHING

    @property
    def message(self) -> str:
        if len(self.folders) == 1:
            return self.folders[0].summary()
        return f"{self.path}: " + ", ".join(f"{Path(f.path).name} {f.status.value}" for f in self.folders)

    def body(self) -> dict:
        return {"path": self.path, "ok": self.ok, "strategy": self.strategy,
                "folders": [f.to_dict() for f in self.folders]}

    def render(self, out: Any, opts: dict) -> None:
        if self.status is not ConvertStatus.NOTHING:  # else each folder's one line says it is already safetensors
            done = "converted in place" if self.status is ConvertStatus.CONVERTED else "nothing written"
            out.print(f"{self.path}: DeepSpeed-Chat .bin output ({done})", markup=False)
        for result in self.folders:
            if result.checks and (not result.ok or result.status is ConvertStatus.CONVERTED):
                out.print(render(result.checks, title=f"dsfix convert {result.path}"))
            out.print(result.summary(), markup=False)
            if result.status is ConvertStatus.CONVERTED:
                out.print(result.files(), markup=False)
            if result.kind:
                out.print(f"{Path(result.path).name}: {KIND_TEXT[result.kind]}", markup=False)


# ------------------------------------------------------------------------- a checkpoint or a .bin folder, into --output

BIN_FOLDER = "bin-folder"  # a .bin folder with its own config.json (DeepSpeed-Chat's save_hf_format), into --output
BIN_ALONE = "bin-without-config"  # pytorch_model.bin alone (save_16bit_model, zero_to_fp32): --config names the model
FORMS = {
    BIN_FOLDER: "a .bin output folder (pytorch_model.bin beside config.json, as DeepSpeed-Chat's save_hf_format "
                "writes it)",
    BIN_ALONE: "pytorch_model.bin alone, no config.json (as DeepSpeed's save_16bit_model and zero_to_fp32 write it)",
}


@dataclass(frozen=True)
class CheckpointResult(Result, Checks):
    """``dsfix convert``'s result for an engine or universal checkpoint, a PEFT run's adapter (merged or not), or a
    ``.bin`` folder (``kind``), written into ``--output``."""

    path: str  # the checkpoint folder given
    output: str
    status: ConvertStatus  # CONVERTED, or FAILED (a check failed: nothing written)
    ok: bool
    checks: tuple = ()
    tag: str = ""
    stage: Optional[int] = None
    world: Optional[int] = None
    precision: str = ""
    dtype: str = ""
    strategy: str = "clone"
    tensors: Optional[int] = None
    written: tuple = ()
    bytes_written: int = 0
    note: str = ""
    kind: str = "deepspeed-engine-checkpoint"  # or deepspeed-universal-checkpoint, peft-adapter, peft-merged,
    # BIN_FOLDER, BIN_ALONE
    checkpoint: str = ""  # the checkpoint folder read: ``path`` itself, or the checkpoint-N chosen in a Trainer run
    chosen: str = ""  # how that checkpoint-N was chosen ("" when ``path`` is the checkpoint)
    producer: str = ""  # "trainer", "accelerate" or "" (engine.save_checkpoint), from the files beside it
    config: str = ""  # the folder config.json (generation config, tokenizer) came from
    config_own: bool = False  # that folder is the checkpoint's own (the Trainer's), not --config
    lora: Optional[dict] = None  # DeepSpeed-Chat LoRA layers fused: layers, ranks, lora_scaling, dtype, kept
    sources: tuple = ()  # a .bin folder's files read (pytorch_model.bin, or the shards)
    adapter_from: str = ""  # a PEFT run's adapter_config.json: how it was found where not beside the engine files
    verb = "convert"
    warnings = ()

    @property
    def message(self) -> str:
        if not self.ok:
            return f"not converted {self.path}: {self.note or 'a check failed'}; nothing written"
        fused = (f", LoRA fused into {self.lora['layers']} layers with lora_scaling {self.lora['lora_scaling']:g}"
                 if self.lora else "")
        # an adapter has no tied names: the strategy says nothing there
        how = "the LoRA adapter" if self.kind == "peft-adapter" else self.strategy
        return f"converted {self.read} -> {self.output}: {self.tensors} tensors, {self.dtype}, {how}{fused}"

    @property
    def read(self) -> str:
        """What was read, in a few words (the lines before name the folders): ``checkpoint-N/global_stepN``,
        ``FOLDER/global_stepN``, ``FOLDER/pytorch_model.bin``."""
        folder = Path(self.checkpoint or self.path).name
        what = examples(self.sources, 1) if self.kind in FORMS else self.tag
        return what if folder == what else f"{folder}/{what}"

    def lora_line(self) -> str:
        """What was fused, and with which scaling ("" when no LoRA layers were)."""
        if not self.lora:
            return ""
        given = "as given" if self.lora["scaling_given"] else "step 1's default; --lora-scaling to change"
        return (f"LoRA fused into {self.lora['layers']} layers with lora_scaling {self.lora['lora_scaling']:g} "
                f"({given}; scaling = lora_scaling / r, r = {', '.join(map(str, self.lora['ranks']))})"
                + (f", factors kept in {LORA_FILE}" if self.lora["kept"] else ""))

    def describe(self) -> str:
        """What was read, in short lines: what was chosen in a run folder, what the checkpoint (or .bin folder) is,
        where the config came from and where the folder is written."""
        lines = [f"{self.path}: a Trainer run folder", f"converting {self.chosen}"] if self.chosen else []
        label = Path(self.checkpoint).name if self.chosen else self.path
        stage = f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO"
        by = PRODUCERS.get(self.producer, "")
        saved = f", saved by {by}" if by else ""
        if self.kind in FORMS:
            lines.append(f"{label}: {FORMS[self.kind]}")
        elif self.kind == "peft-merged":
            lines.append(f"{label}: a PEFT adapter merged into its base {self.config}")
        elif self.kind == "peft-adapter":
            lines.append(f"{label}: a PEFT run ({self.tag}, {stage}, {self.world} rank(s){saved}): its adapter "
                         "from the engine files")
        elif self.kind == "deepspeed-universal-checkpoint":
            lines.append(f"{label}: a DeepSpeed universal checkpoint ({self.tag}, made by ds_to_universal from a "
                         f"{stage} run on {self.world} rank(s); one fp32 file a parameter)")
        else:
            lines.append(f"{label}: a DeepSpeed engine checkpoint ({self.tag}, {stage}, {self.world} rank(s), "
                         f"{self.precision} optimizer states{saved})")
        if self.adapter_from:
            lines.append(f"adapter_config.json from {self.adapter_from}")
        written = f"written to {self.output}" if self.ok else ""  # said once the write is committed
        if self.kind.startswith("peft-"):  # the adapter's own files, or the base the line above names
            lines += [written] if written else []
        else:
            where = ("its own folder" if self.kind in FORMS else "the checkpoint's own folder") if self.config_own \
                else f"--config {self.config}"
            lines.append(f"config from {where}" + (f"; {written}" if written else ""))
        return "\n".join(lines)

    def body(self) -> dict:
        return {"path": self.path, "kind": self.kind, "output": self.output, "status": self.status.value,
                "ok": self.ok, "tag": self.tag, "zero_stage": self.stage, "world_size": self.world,
                "precision": self.precision, "dtype": self.dtype, "strategy": self.strategy, "tensors": self.tensors,
                "lora": self.lora, "checkpoint": self.checkpoint, "chosen": self.chosen or None,
                "producer": self.producer or None, "config": self.config, "config_from_checkpoint": self.config_own,
                "adapter_from": self.adapter_from or None,
                "written": list(self.written), "bytes_written": self.bytes_written,
                "note": self.note, "checks": [c._asdict() for c in self.checks]}

    def render(self, out: Any, opts: dict) -> None:
        for line in self.describe().splitlines():
            out.print(line, markup=False)
        out.print(render(self.checks, title=f"dsfix convert {self.path}"))
        out.print(self.message, markup=False)
        if self.ok and self.lora:
            out.print(self.lora_line(), markup=False)


# --------------------------------------------------------------------------- a Hugging Face model folder already


@dataclass(frozen=True)
class ModelFolderResult(Result):
    """``dsfix convert`` of a folder that already is a Hugging Face model (config.json beside safetensors weights:
    ``save_pretrained``, the Trainer's ``save_model()``, a ``save_only_model`` ``checkpoint-N``), given itself or
    as the ``checkpoint-N`` a Trainer run folder's choice lands on: nothing to convert, whatever the options;
    ``dsfix verify`` checks it."""

    path: str  # the folder given
    folder: str  # the model folder: ``path`` itself, or the checkpoint-N chosen in a Trainer run folder
    weights: tuple  # its weight files' names (model.safetensors, or the index)
    chosen: str = ""  # how that checkpoint-N was chosen ("" when ``path`` is the model folder)
    verb = "convert"
    warnings = ()
    ok = True

    @property
    def status(self) -> ConvertStatus:
        return ConvertStatus.NOTHING

    @property
    def next_step(self) -> str:
        return f"dsfix verify {self.folder}"

    @property
    def message(self) -> str:
        return (f"nothing to convert in {self.folder}: a Hugging Face model folder already "
                f"({examples(self.weights)}, {CONFIG_NAME})")

    def body(self) -> dict:
        return {"path": self.path, "kind": "hugging-face-model-folder", "ok": self.ok, "folder": self.folder,
                "chosen": self.chosen or None, "weights": list(self.weights), "next": self.next_step}

    def render(self, out: Any, opts: dict) -> None:
        if self.chosen:
            out.print(f"{self.path}: a Trainer run folder", markup=False)
            out.print(f"chose {self.chosen}", markup=False)
        out.print(self.message, markup=False)
        out.print(f"check it with: {self.next_step}", markup=False)


# --------------------------------------------------------------------------- a PEFT adapter folder with no adapter


@dataclass(frozen=True)
class EmptyAdapterResult(Result):
    """``dsfix convert`` of a PEFT adapter folder whose ``adapter_model.safetensors`` holds no adapter (0 tensors, or
    tensors of 0 elements: PEFT's save of ZeRO-3's partitions): not converted, exit 1, the cause and the convert
    that recovers the adapter from the run's engine files."""

    path: str
    cause: str
    cure: str  # where the adapter is, and the convert that recovers it
    verb = "convert"
    warnings = ()
    ok = False

    @property
    def status(self) -> ConvertStatus:
        return ConvertStatus.FAILED

    @property
    def message(self) -> str:
        return f"not converted {self.path}: {self.cause}; nothing written"

    def body(self) -> dict:
        return {"path": self.path, "kind": "peft-adapter-folder", "ok": self.ok, "cause": self.cause,
                "next": self.cure}

    def render(self, out: Any, opts: dict) -> None:
        out.print(self.message, markup=False)
        out.print(self.cure, markup=False)
