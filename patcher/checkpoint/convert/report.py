"""What ``dsfix convert`` reports, and how it is shown: one result for ``.bin`` folders converted in place, one for
a checkpoint converted into ``--output``; each renders itself (checks table, one line) for the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.headers import render
from patcher.checkpoint.check.model import KIND_TEXT
from patcher.checkpoint.names import examples
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
        tail = (f"removed {examples(self.removed)}" if self.removed
                else f"{examples(self.source)} kept (--remove-bin removes it)")
        return (f"converted {self.path}: {examples(self.source)} -> {examples(self.written)}, "
                f"{self.tensors} tensors ({how}); {tail}")


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
        return "; ".join(f.summary() for f in self.folders)

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
            kind = f" [{KIND_TEXT[result.kind]}]" if result.kind else ""
            out.print(result.summary() + kind, markup=False)


# --------------------------------------------------------------------------- a checkpoint, into --output


@dataclass(frozen=True)
class CheckpointResult(Result, Checks):
    """``dsfix convert``'s result for an engine or universal checkpoint, written into ``--output``."""

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
    kind: str = "deepspeed-engine-checkpoint"  # or deepspeed-universal-checkpoint, peft-adapter, peft-merged
    checkpoint: str = ""  # the checkpoint folder read: ``path`` itself, or the checkpoint-N chosen in a Trainer run
    chosen: str = ""  # how that checkpoint-N was chosen ("" when ``path`` is the checkpoint)
    producer: str = ""  # "trainer", "accelerate" or "" (engine.save_checkpoint), from the files beside it
    config: str = ""  # the folder config.json (generation config, tokenizer) came from
    config_own: bool = False  # that folder is the checkpoint's own (the Trainer's), not --config
    lora: Optional[dict] = None  # DeepSpeed-Chat LoRA layers fused: layers, ranks, lora_scaling, dtype, kept
    verb = "convert"
    warnings = ()

    @property
    def message(self) -> str:
        if not self.ok:
            return f"not converted {self.path}: {self.note or 'a check failed'}; nothing written"
        fused = ""
        if self.lora:
            given = "as given" if self.lora["scaling_given"] else "step 1's default; --lora-scaling to change"
            fused = (f", LoRA fused into {self.lora['layers']} layers with lora_scaling {self.lora['lora_scaling']:g} "
                     f"({given}; scaling = lora_scaling / r, r = {', '.join(map(str, self.lora['ranks']))})"
                     + (f", factors kept in {LORA_FILE}" if self.lora["kept"] else ""))
        tag = f"{Path(self.checkpoint).name}/{self.tag}" if self.chosen else self.tag
        return (f"converted {self.path} ({tag}) -> {self.output}: {self.tensors} tensors, {self.dtype}, "
                f"{self.strategy}{fused}; {examples(self.written)}")

    def describe(self) -> str:
        stage = f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO"
        run = f"a Trainer run folder; converting {self.chosen}: " if self.chosen else ""
        by = PRODUCERS.get(self.producer, "")
        by = f", saved by {by}" if by else ""
        config = ("; config from the checkpoint's own folder" if self.config_own
                  else f"; config from --config {self.config}" if self.config else "")
        if self.kind == "peft-merged":
            return f"{self.path}: {run}a PEFT LoRA adapter merged into its base {self.config}, written to {self.output}"
        if self.kind == "peft-adapter":
            return (f"{self.path}: {run}a PEFT LoRA run ({self.tag}, {stage}, {self.world} rank(s){by}): its adapter "
                    f"from the engine files, written to {self.output}")
        if self.kind == "deepspeed-universal-checkpoint":
            return (f"{self.path}: {run}a DeepSpeed universal checkpoint ({self.tag}, made by ds_to_universal from a "
                    f"{stage} run on {self.world} rank(s); one fp32 file a parameter){config}, "
                    f"written to {self.output}")
        return (f"{self.path}: {run}a DeepSpeed engine checkpoint ({self.tag}, {stage}, {self.world} rank(s), "
                f"{self.precision} optimizer states{by}){config}, written to {self.output}")

    def body(self) -> dict:
        return {"path": self.path, "kind": self.kind, "output": self.output, "status": self.status.value,
                "ok": self.ok, "tag": self.tag, "zero_stage": self.stage, "world_size": self.world,
                "precision": self.precision, "dtype": self.dtype, "strategy": self.strategy, "tensors": self.tensors,
                "lora": self.lora, "checkpoint": self.checkpoint, "chosen": self.chosen or None,
                "producer": self.producer or None, "config": self.config, "config_from_checkpoint": self.config_own,
                "written": list(self.written), "bytes_written": self.bytes_written,
                "note": self.note, "checks": [c._asdict() for c in self.checks]}

    def render(self, out: Any, opts: dict) -> None:
        out.print(self.describe(), markup=False)
        out.print(render(self.checks, title=f"dsfix convert {self.path}"))
        out.print(self.message, markup=False)
