"""HiVLP's coarse-to-fine search over stored level vectors (§3.4):

    level 1: S^1 against all N candidates (width d_1), keep the top N2
    level 2: S^2 against those N2 (width d_2), keep the top N3
    level 3: S^3 orders the N3 (width d_L)                          (`coarse_to_fine`)
"""

from __future__ import annotations

import numpy as np
import torch

SURVIVORS = (1000, 100)  # N2, N3: the paper's defaults for every evaluation set but COCO-full


def select_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores, k, dim=1) as (values, indices). One long row (an online query) takes a
    faster exact path: a strided sample sets a threshold about 2k scores pass, topk runs on those (a
    full topk over 10^7 scores costs about as much as the level-1 product, notebook 05)."""
    Q, N = scores.shape
    k = min(k, N)
    sample = 4096
    if Q == 1 and N >= max(16 * k, 8 * sample):
        row = scores[0]
        probe = row[::N // sample]  # (~sample,) every (N // sample)-th score
        keep = min(len(probe) - 1, 2 * k * len(probe) // N + 8)  # about 2k of the N should pass
        threshold = torch.topk(probe, keep + 1).values[-1]
        passed = torch.nonzero(row >= threshold).squeeze(1)  # (P,) P >= keep + 1 of the probe
        if len(passed) >= k:
            top = torch.topk(row[passed], k)
            return top.values[None], passed[top.indices][None]
    top = torch.topk(scores, k, dim=1)
    return top.values, top.indices


def flat_search(gallery: torch.Tensor, query: torch.Tensor, top_k: int = 10):
    """Exact top_k of queries (Q, d) over gallery (G, d) -> (indices, scores) (Q, k)."""
    values, indices = select_top_k((gallery @ query.T).T, top_k)  # (Q, G) scores
    return indices, values


def rescore(gallery: torch.Tensor, query: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(Q, M): query[q] . gallery[indices[q, m]] (index_select + matmul: 3x einsum's speed)."""
    Q, M = indices.shape
    rows = torch.index_select(gallery, 0, indices.reshape(-1)).view(Q, M, -1)  # (Q, M, d)
    if Q == 1:
        return (rows[0] @ query[0])[None]  # one online query: (1, M)
    return torch.bmm(rows, query[:, :, None])[..., 0]  # (Q, M)


def _level_plan(gallery_levels, query_levels, survivors, top_k: int) -> tuple[list[int], int]:
    """(what each level keeps, the first level that scores): both searches below follow it."""
    if len(gallery_levels) != len(query_levels) or len(survivors) != len(gallery_levels) - 1:
        raise ValueError(f"{len(gallery_levels)} gallery levels, {len(query_levels)} query levels "
                         f"and {len(survivors)} survivor counts: need L, L and L - 1")
    counts = list(survivors) + [top_k]  # what each level keeps
    # a level keeping all it scores filters nothing (N2 = 1,000 on a 1k gallery): skip it
    first = next(level for level, keep in enumerate(counts)
                 if keep < len(gallery_levels[0]) or level == len(counts) - 1)
    return counts, first


def coarse_to_fine(gallery_levels, query_levels, survivors=SURVIVORS, top_k: int = 10):
    """§3.4 for a batch of queries: gallery_levels[l] (G, d_l), query_levels[l] (Q, d_l) -> (indices
    (Q, k), scores (Q, k)) by the last level, k = min(top_k, last survivors)."""
    counts, first = _level_plan(gallery_levels, query_levels, survivors, top_k)
    indices, values = flat_search(gallery_levels[first], query_levels[first],
                                  counts[first])  # (Q, N) at d_first
    for level in range(first + 1, len(counts)):
        if counts[level] >= indices.shape[1] and level < len(counts) - 1:
            continue  # keeps every survivor: nothing to filter
        values = rescore(gallery_levels[level], query_levels[level], indices)  # (Q, M) at d_l
        top = torch.topk(values, min(counts[level], values.shape[1]), dim=1)
        indices, values = indices.gather(1, top.indices), top.values  # (Q, counts[level])
    return indices, values


def coarse_to_fine_one(gallery_levels, query_levels, survivors=SURVIVORS,
                       top_k: int = 10) -> np.ndarray:
    """`coarse_to_fine` for one query in numpy, query_levels[l] (d_l,) -> (k,) gallery indices
    (docs/tuning_notes.md, "The online cascade's search in numpy")."""
    counts, first = _level_plan(gallery_levels, query_levels, survivors, top_k)
    candidates = None  # (M,) gallery rows still in the race, best first; None = all of them
    for level in range(first, len(counts)):
        if candidates is not None and counts[level] >= len(candidates) and level < len(counts) - 1:
            continue  # keeps every survivor: nothing to filter
        rows = gallery_levels[level] if candidates is None else gallery_levels[level][candidates]
        scores = rows @ query_levels[level]  # (M,) from rows (M, d_l)
        k = min(counts[level], len(scores))
        keep = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        keep = keep[np.argsort(-scores[keep], kind="stable")]  # (k,) best first
        candidates = keep if candidates is None else candidates[keep]
    return candidates
