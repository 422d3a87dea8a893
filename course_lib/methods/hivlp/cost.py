"""HiVLP's cost of one query: the paper's time model (§3.4) and a multiply-add count of ours.

    flat:    every block of the query tower, then N similarities at the last width d_L
    cascade: the blocks up to level 1, then per level the larger of (the next blocks, this level's
             similarities), as the paper runs both in parallel; N_l candidates at width d_l
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, pairwise


@dataclass
class CostModel:
    """The paper's time model, in multiplies: a block costs t_e, a similarity at width d costs d."""

    n_layers: int = 12  # encoder blocks of the query tower
    level_layers: tuple = (4, 8, 12)  # the block each level reads
    widths: tuple = (128, 300, 768)  # d_l
    t_e: float = 1e3  # the cost of one encoder block
    notes: dict = field(default_factory=dict)

    def flat(self, n: int) -> float:
        return self.n_layers * self.t_e + n * self.widths[-1]

    def cascade(self, candidates) -> float:
        """candidates: (N_1, ..., N_L), the items scored at each level (N_1 = the gallery)."""
        if len(candidates) != len(self.widths):
            raise ValueError(f"one candidate count per level: {len(self.widths)} levels, "
                             f"got {list(candidates)}")
        blocks = [b - a for a, b in pairwise((0, *self.level_layers))]  # blocks per segment
        total = blocks[0] * self.t_e
        for level in range(len(self.widths) - 1):
            total += max(blocks[level + 1] * self.t_e, candidates[level] * self.widths[level])
        return total + candidates[-1] * self.widths[-1]


def cascade_cost(n: int, survivors=(1000, 100), model: CostModel | None = None) -> dict:
    """{"flat", "cascade", "speedup", ...} for a gallery of n, survivors (N_2, N_3, ...) capped."""
    model = model or CostModel()
    counts = list(accumulate(survivors, min, initial=n))  # [n, N_2, N_3, ...], each capped
    flat, cascade = model.flat(n), model.cascade(counts)
    return {"n": n, "candidates": counts, "flat": flat, "cascade": cascade,
            "speedup": flat / cascade}


def encoder_multiply_adds(tokens: int, hidden: int, layers: int) -> int:
    """Multiply-adds of pre-LN blocks: per block 4·T·H² + 2·T²·H (attention) + 8·T·H² (MLP)."""
    return layers * (12 * tokens * hidden * hidden + 2 * tokens * tokens * hidden)


def query_multiply_adds(n: int, *, tokens: int, hidden: int, layers: int, widths,
                        survivors=()) -> dict:
    """Multiply-adds of one query: encoder + EOLs, plus n at d_L (flat) or the cascade's levels."""
    if len(survivors) != len(widths) - 1:
        raise ValueError(f"{len(widths)} levels need {len(widths) - 1} survivor counts, "
                         f"got {list(survivors)}")
    eols = sum(hidden * hidden + hidden * w for w in widths)  # the EOL MLPs: H·H + H·d_l a level
    encoder = encoder_multiply_adds(tokens, hidden, layers) + eols
    counts = accumulate(survivors, min, initial=n)  # n, then each survivor count, capped
    flat_sim = n * widths[-1]
    cascade_sim = sum(c * w for c, w in zip(counts, widths, strict=True))
    return {"encoder": encoder, "flat_similarity": flat_sim, "cascade_similarity": cascade_sim,
            "flat": encoder + flat_sim, "cascade": encoder + cascade_sim}
