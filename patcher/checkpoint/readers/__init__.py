"""Readers: one per layout of weights on disk, behind one interface (:class:`.base.Reader`), found here.

==========================  ==========================  ===============================================
layout                      reader                      what marks it (file names only)
==========================  ==========================  ===============================================
a ``.bin`` folder           :class:`.bin.BinFolder`      ``pytorch_model.bin`` or its index
a safetensors folder        :class:`.safetensors.SafetensorsFolder`  ``model.safetensors`` or its index
a universal checkpoint      :class:`.universal.UniversalReader`  ``zero/<name>/fp32.pt``, no optimizer files
ZeRO-3                      :class:`.zero3.Zero3Reader`  ``zero_pp_rank_R_mp_rank_00_model_states.pt``
ZeRO-1/2                    :class:`.zero12.Zero12Reader`  ``mp_rank_00_model_states.pt``
==========================  ==========================  ===============================================

Finding which folder to read (a run folder's ``checkpoint-N``, ``latest``, the config's folder, the producer) is
:mod:`.find`'s; the one weights-only loader is :mod:`.load`'s; the layouts dsfix refuses, :mod:`.refuse`'s. A new
layout is one reader module, one row in :data:`STEP_READERS` or :data:`FOLDER_READERS`, and its table tests.
Importing a reader imports no torch: a reader imports it when it is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import patcher.checkpoint.readers.refuse as refuse
from patcher.checkpoint.readers.base import Held, Put, Reader
from patcher.checkpoint.readers.bin import BinFolder
from patcher.checkpoint.readers.engine import MODEL12, EngineReader
from patcher.checkpoint.readers.safetensors import SafetensorsFolder
from patcher.checkpoint.readers.universal import UniversalReader
from patcher.checkpoint.readers.zero3 import Zero3Reader
from patcher.checkpoint.readers.zero12 import Zero12Reader
from patcher.errors import DsfixError

__all__ = ["Held", "Put", "Reader", "STEP_READERS", "FOLDER_READERS", "step_reader", "open_step", "folder_reader"]

# a checkpoint's step folder (global_stepN, global_stepN_universal), in the order asked
STEP_READERS: tuple[type[EngineReader], ...] = (UniversalReader, Zero3Reader, Zero12Reader)
# a model folder's weights, in the order asked: safetensors first (a folder converted in place keeps its .bin)
FOLDER_READERS: tuple[type[Reader], ...] = (SafetensorsFolder, BinFolder)


def step_reader(folder: Path) -> type[EngineReader]:
    """Which reader reads the step folder ``folder``, from its file names (no torch); the layouts dsfix refuses
    are refused first."""
    folder = Path(folder)
    refuse.files(folder)
    found = next((r for r in STEP_READERS if r.is_kind(folder)), None)
    if found is None:
        raise DsfixError(f"no {MODEL12} or zero_pp_rank_R_mp_rank_00_model_states.pt: not a DeepSpeed engine "
                         "checkpoint folder", path=str(folder))
    return found


def open_step(folder: Path, tag: str = "") -> EngineReader:
    """The reader of the step folder ``folder``, opened (its model_states read, rank 0's optimizer states too)."""
    return step_reader(folder)(Path(folder), tag)


def folder_reader(folder: Path) -> Optional[type[Reader]]:
    """Which reader reads the model folder ``folder`` (None: no weights it knows), from file names alone."""
    return next((r for r in FOLDER_READERS if r.is_kind(Path(folder))), None)
