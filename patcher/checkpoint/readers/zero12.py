"""A ZeRO-1/2 engine checkpoint: one model_states file, one optimizer file a rank.

``global_stepN/`` holds ``mp_rank_00_model_states.pt`` (names, shapes, frozen parameters whole, buffers) and
one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank. Each parameter group's fp32
master weights are flattened in ``param_shapes`` order (``param_alignment_paddings`` after each parameter,
where recorded), padded to a multiple of 2 x world and cut into equal partitions, rank R holding the R-th
(``single_partition_of_fp32_groups``); a parameter may straddle two ranks (:func:`pieces`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint.readers.base import Put, numel
from patcher.checkpoint.readers.engine import MODEL12, EngineReader, model3_files
from patcher.errors import DsfixError


class Piece(NamedTuple):
    """``length`` elements of parameter ``name`` from element ``dst`` on, found in rank ``rank``'s flat group
    ``group`` from element ``src`` on."""

    rank: int
    group: int
    src: int
    name: str
    dst: int
    length: int


def pieces(groups: list, partition: list, world: int, paddings: Optional[list] = None) -> list:
    """``groups``: per parameter group, [(name, numel)] in ``param_shapes`` order; ``partition``: each group's
    per-rank partition size; ``paddings``: per group, the padding after each parameter (or None). Returns the
    pieces, rank by rank. Raises ValueError when the parameters do not fit the partitions."""
    out = []
    for g, params in enumerate(groups):
        size = partition[g]
        pads = paddings[g] if paddings is not None else [0] * len(params)
        if len(pads) != len(params):
            raise ValueError(f"group {g} records {len(pads)} paddings for {len(params)} parameters")
        offset, spans = 0, []
        for (name, count), pad in zip(params, pads):
            spans.append((name, offset, count))
            offset += count + pad
        if offset > size * world:
            raise ValueError(f"group {g}'s parameters need {offset} elements but its {world} partitions hold "
                             f"{size * world}")
        align = 2 * world  # DeepSpeed pads a group's end to a multiple of 2 x world (and to the partitions)
        if math.ceil(offset / align) * align != math.ceil(size * world / align) * align:
            raise ValueError(f"group {g}'s partitions hold {size * world} elements but its parameters "
                             f"take {offset}: not the layout these files record")
        for name, start, count in spans:
            end = start + count
            for r in range(start // size if size else 0, world):
                lo, hi = max(start, r * size), min(end, (r + 1) * size)
                if lo >= hi:
                    break
                out.append(Piece(r, g, lo - r * size, name, lo - start, hi - lo))
    out.sort(key=lambda p: p.rank)
    return out


class Zero12Reader(EngineReader):
    kind = "zero-1/2"
    flat_key = "single_partition_of_fp32_groups"

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        return (folder / MODEL12).is_file() and not model3_files(folder)

    def _pieces(self, sizes: list, osd: dict, path: Path) -> list:
        groups = [[(n, numel(s)) for n, s in g.items()] for g in self.meta["param_shapes"]]
        try:
            if len(groups) != len(sizes):
                raise ValueError(f"{len(groups)} parameter groups but {len(sizes)} flat partitions")
            return pieces(groups, sizes, self.world, osd.get("param_alignment_paddings"))
        except ValueError as e:
            raise DsfixError(f"{e}", path=str(path)) from e

    def frozen(self, rank: int, put: Put) -> None:
        self.frozen_whole(rank, put)
