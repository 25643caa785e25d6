"""``dsfix convert``: weights on disk (a ``.bin`` folder, a DeepSpeed checkpoint) to a verified safetensors folder.

:mod:`.command` decides what the path holds and runs one pipeline for every kind: a reader
(:mod:`patcher.checkpoint.readers`), the steps it needs (:mod:`patcher.checkpoint.steps`), the plan and the
writer (:mod:`patcher.checkpoint.write`); :mod:`.report` holds the results and how they are shown.
"""

from patcher.checkpoint.convert.command import convert
from patcher.checkpoint.convert.report import CheckpointResult, ConvertReport, ConvertStatus, FolderResult

__all__ = ["convert", "CheckpointResult", "ConvertReport", "ConvertStatus", "FolderResult"]
