"""A ZeRO-3 engine checkpoint: one model_states file and one optimizer file a rank.

``global_stepN/`` holds ``zero_pp_rank_R_mp_rank_00_model_states.pt`` and
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` for each rank R. Every parameter is cut on its own into
``ceil(numel / world)`` elements a rank (the last padded), and rank R's slices of all parameters lie one after
another in its ``fp32_flat_groups`` (groups concatenated) (:func:`pieces`). Frozen parameters are cut the same
way into each rank's ``frozen_param_fragments``.
"""

from __future__ import annotations

import math
from pathlib import Path

from patcher.checkpoint.readers.base import Put, numel
from patcher.checkpoint.readers.engine import EngineReader, model3_files
from patcher.checkpoint.readers.zero12 import Piece
from patcher.errors import DsfixError


def pieces(params: list, world: int, group_sizes: list) -> list:
    """``params``: [(name, numel)] over all groups in ``param_shapes`` order; ``group_sizes``: the elements of each
    of a rank's flat groups. Returns the pieces, rank by rank; raises ValueError when the groups do not hold
    exactly the parameters' partitions."""
    local = sum(math.ceil(n / world) for _, n in params)
    if local != sum(group_sizes):
        raise ValueError(f"each rank's flat groups hold {sum(group_sizes)} elements but the parameters' "
                         f"partitions take {local}")
    bounds = [0]
    for s in group_sizes:
        bounds.append(bounds[-1] + s)
    out = []
    for r in range(world):
        at = 0
        for name, count in params:
            part = math.ceil(count / world)
            first = r * part
            left = min(part, count - first)
            src = at
            while left > 0:  # a slice may cross from one flat group into the next
                g = next(i for i in range(len(group_sizes)) if bounds[i] <= src < bounds[i + 1])
                take = min(left, bounds[g + 1] - src)
                out.append(Piece(r, g, src - bounds[g], name, first, take))
                src, first, left = src + take, first + take, left - take
            at += part
    return out


class Zero3Reader(EngineReader):
    kind = "zero-3"
    flat_key = "fp32_flat_groups"
    stage3 = True

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        return bool(model3_files(folder))

    def _pieces(self, sizes: list, osd: dict, path: Path) -> list:
        params = [(n, numel(s)) for g in self.meta["param_shapes"] for n, s in g.items()]
        try:
            return pieces(params, self.world, sizes)
        except ValueError as e:
            raise DsfixError(f"{e}", path=str(path)) from e

    def frozen(self, rank: int, put: Put) -> None:
        self.frozen_slices(rank, put)
