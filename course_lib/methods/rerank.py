"""Cascades: a fast first stage keeps the top-M, slower stages re-score only the survivors, in the
order `combine` (default `last_stage`, as LightningDOT §3.2, Table 3 "+Re-ranker") gives.

    Cascade([lightningdot, cross_encoder], top_ms=[20])  # two-stage re-ranking
    Cascade([hivlp_l1, hivlp_l2, hivlp_l3], top_ms=[1000, 100])  # coarse-to-fine levels
    Cascade([fast, slow], top_ms=[10], combine=weighted_sum([beta, 1.0]))  # Fast & Slow eq. 9

A query costs one first-stage search plus sum(top_ms) pair scorings, whatever the gallery size. A
re-ranker plugs in as a pair scorer, score_pairs(image_indices (P,), text_indices (P,)) -> (P,).
`two_stage_scores` gives the dense (N, T) form for the usual metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from course_lib.methods.base import Ranker
from course_lib.methods.queries import TopK, check_direction, query_indices

PairScorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def top_m_candidates(first_scores: torch.Tensor, top_m: int,
                     direction: str = "t2i") -> torch.Tensor:
    """The first stage's top_m per query, best first: t2i (T, M) images, i2t (N, M) texts."""
    check_direction(direction)
    if top_m < 1:
        raise ValueError(f"top_m must be >= 1, got {top_m}")
    by_query = torch.as_tensor(first_scores)
    by_query = by_query.T if direction == "t2i" else by_query  # (Q, candidates)
    return torch.topk(by_query, min(top_m, by_query.shape[1]), dim=1).indices  # (Q, M)


def two_stage_scores(first_scores, score_pairs: PairScorer, top_m: int, direction: str = "t2i"):
    """(N, T) two-stage scores: each query's top_m by first_scores (N, T) re-scored by score_pairs
    (one call), every other item in its first-stage order below them."""
    first = torch.as_tensor(first_scores, dtype=torch.float32).cpu()  # (N, T)
    candidates = top_m_candidates(first, top_m, direction)  # (Q, M)
    Q, M = candidates.shape
    queries = torch.arange(Q).repeat_interleave(M)  # (Q*M,) query-major
    flat = candidates.reshape(-1)  # (Q*M,)
    images, texts = (flat, queries) if direction == "t2i" else (queries, flat)
    rescored = torch.as_tensor(score_pairs(images, texts), dtype=torch.float32).cpu().view(Q, M)
    by_query = (first.T if direction == "t2i" else first).clone()  # (Q, candidates)
    # shift each query's first-stage scores below its lowest re-ranked score, keeping their order
    by_query -= (by_query.max(dim=1, keepdim=True).values
                 - rescored.min(dim=1, keepdim=True).values + 1.0)
    by_query.scatter_(1, candidates, rescored)
    return by_query.T.contiguous() if direction == "t2i" else by_query  # (N, T)


def remembered_scores(stage, split, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """stage.score_pairs, each pair scored once per split and fitted model (kept on the stage)
    across cascades and directions. Evaluation only: a timed query pays for every pair."""
    memo = getattr(stage, "_remembered", None)
    if memo is None or memo["model"] is not getattr(stage, "model", None):
        memo = stage._remembered = {"model": getattr(stage, "model", None), "splits": {}}
    # keyed by the split object itself (held, so its id cannot be reused): (split, keys, scores)
    empty = (split, np.zeros(0, np.int64), np.zeros(0, np.float32))
    _, known_keys, known_scores = memo["splits"].get(id(split), empty)  # keys sorted
    keys = images.numpy().astype(np.int64) * split.n_texts + texts.numpy()  # (P,) a number a pair
    new = np.setdiff1d(keys, known_keys)  # (U,) sorted, each new pair once
    if len(new):
        fresh = stage.score_pairs(split, torch.from_numpy(new // split.n_texts),
                                  torch.from_numpy(new % split.n_texts))
        fresh = torch.as_tensor(fresh).float().cpu().numpy()  # (U,)
        order = np.argsort(np.concatenate([known_keys, new]), kind="stable")
        known_keys = np.concatenate([known_keys, new])[order]
        known_scores = np.concatenate([known_scores, fresh])[order]
        memo["splits"][id(split)] = (split, known_keys, known_scores)
    return torch.from_numpy(known_scores[np.searchsorted(known_keys, keys)])


Combine = Callable[[list], torch.Tensor]


def last_stage(stage_scores: list) -> torch.Tensor:
    """The default combine: order by the latest stage's scores alone. (Q, M) -> (Q, M)"""
    return stage_scores[-1]


def weighted_sum(weights: Sequence[float]) -> Combine:
    """sum_j weights[j] * stage j's scores (Fast & Slow: weighted_sum([beta, 1]))."""
    weights = [float(w) for w in weights]

    def combine(stage_scores: list) -> torch.Tensor:  # the stages so far: fewer than weights
        return sum(w * s for w, s in zip(weights, stage_scores, strict=False))

    return combine


class Cascade(Ranker):
    """stages[0] (a Method) ranks the gallery and keeps top_ms[0]; stage j (anything with
    score_pairs) re-scores the survivors and keeps top_ms[j], in combine(scores so far)'s order.
    top_ms_i2t: other counts for image queries. fit fits the stages not fitted yet."""

    def __init__(self, stages: Sequence, top_ms: Sequence[int], combine: Combine = last_stage,
                 name: str | None = None, notes: str | None = None,
                 top_ms_i2t: Sequence[int] | None = None):
        for counts in (top_ms, top_ms if top_ms_i2t is None else top_ms_i2t):
            if len(stages) < 2 or len(counts) != len(stages) - 1:
                raise ValueError("a cascade needs >= 2 stages and one top_m per stage but the "
                                 f"last: got {len(stages)} stages and top_ms {list(counts)}")
            if any(m < 1 for m in counts) or list(counts) != sorted(counts, reverse=True):
                raise ValueError(f"top_ms must be >= 1 and non-increasing, got {list(counts)}")
        self.stages, self.top_ms, self.combine = list(stages), [int(m) for m in top_ms], combine
        self.top_ms_i2t = self.top_ms if top_ms_i2t is None else [int(m) for m in top_ms_i2t]
        self.name = name or "+".join(s.name for s in stages) + "@" + "/".join(map(str, top_ms))
        self.notes = notes or (f"{stages[0].name} keeps the top {'/'.join(map(str, top_ms))}, "
                               "re-scored by " + ", ".join(s.name for s in stages[1:]))
        self.progress = True

    @property
    def eval_pairs(self):
        return tuple(min((b for b in budgets if b is not None), default=None)
                     for budgets in zip(*(s.eval_pairs for s in self.stages[1:]), strict=True))

    def fit(self, bench, tokenizer, cache_dir=None) -> Cascade:
        for stage in self.stages:  # a fitted method is not fitted again
            if getattr(stage, "model", None) is None:
                stage.fit(bench, tokenizer, cache_dir=cache_dir)
        return self

    def survivors(self, direction: str) -> list[int]:
        """The top_ms of a direction: top_ms for text queries, top_ms_i2t for image queries."""
        return self.top_ms if check_direction(direction) == "t2i" else self.top_ms_i2t

    def pairs_per_query(self, split, direction: str) -> int:
        """The first stage's pairs plus later survivors, except `dot_product` stages'."""
        later = zip(self.survivors(direction), self.stages[1:], strict=True)
        return (sum(m for m, stage in later if not getattr(stage, "dot_product", False))
                + self.stages[0].pairs_per_query(split, direction))

    def rescore(self, split, direction: str, queries, candidates, first_scores,
                remember: bool = False):
        """stages[1:] on candidates and first-stage scores (Q, M) -> (indices, scores) (Q, M), best
        first: the survivors, then each stage's drops (latest first) strictly below, as
        two_stage_scores. remember: through remembered_scores (never for `dot_product` stages)."""
        top_ms = self.survivors(direction)
        queries = torch.as_tensor(np.asarray(queries), dtype=torch.long)  # (Q,)
        candidates = torch.as_tensor(candidates, dtype=torch.long)
        tails = [candidates[:, top_ms[0]:]]  # beyond the first stage's top_m, its own order
        indices = candidates[:, :top_ms[0]]
        history = [torch.as_tensor(first_scores).float()[:, :top_ms[0]]]
        for stage, keep in zip(self.stages[1:], top_ms[1:] + [None], strict=True):
            Q, M = indices.shape
            asked = queries.repeat_interleave(M)  # (Q*M,) query-major
            flat = indices.reshape(-1)
            images, texts = (flat, asked) if direction == "t2i" else (asked, flat)
            if remember and not getattr(stage, "dot_product", False):
                scored = remembered_scores(stage, split, images, texts)
            else:
                scored = torch.as_tensor(stage.score_pairs(split, images, texts)).float()
            history.append(scored.view(Q, M))
            order = torch.argsort(self.combine(history), dim=1, descending=True, stable=True)
            keep = M if keep is None else keep
            tails.insert(0, indices.gather(1, order[:, keep:]))
            indices = indices.gather(1, order[:, :keep])
            history = [h.gather(1, order[:, :keep]) for h in history]
        scores = self.combine(history)  # (Q, M_last)
        tail = torch.cat(tails, dim=1)  # (Q, M - M_last)
        below = (scores.min(dim=1, keepdim=True).values - 1.0
                 - torch.arange(tail.shape[1], dtype=torch.float32))
        return torch.cat([indices, tail], dim=1), torch.cat([scores, below], dim=1)

    def rank(self, split, direction: str, top_k: int, queries=None) -> TopK:
        """(indices (Q, k), scores (Q, k)), best first; beyond the last survivors, earlier drops."""
        queries = query_indices(split, check_direction(direction), queries)
        depth = max(top_k, self.survivors(direction)[0])
        candidates, first = self.stages[0].rank(split, direction, depth, queries)  # (Q, depth)
        indices, scores = self.rescore(split, direction, queries, candidates, first, remember=True)
        return indices[:, :top_k], scores[:, :top_k]

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One text query: stage 0's query_fn for top_ms[0], later stages on the survivors."""
        uses_first = self.combine is not last_stage  # only then do the first-stage scores matter
        search = self.stages[0].query_fn(split, caption_index=caption_index, top_k=self.top_ms[0],
                                         **({"with_scores": True} if uses_first else {}))

        def answer() -> np.ndarray:
            found = search()
            candidates, first = found if uses_first else (found, None)
            candidates = torch.as_tensor(np.asarray(candidates), dtype=torch.long)[None]  # (1, M0)
            first = (-torch.arange(candidates.shape[1], dtype=torch.float32)[None] if first is None
                     else torch.as_tensor(np.asarray(first), dtype=torch.float32)[None])  # (1, M0)
            indices, _ = self.rescore(split, "t2i", [caption_index], candidates, first)
            return indices[0, :top_k].numpy()

        return answer


class TwoStageMethod(Cascade):
    """`first` retrieves top_m, `reranker` re-scores them; ranked by the re-ranker alone."""

    def __init__(self, first, reranker, top_m: int, name: str | None = None,
                 top_m_i2t: int | None = None):
        both = (f"{top_m}" if top_m_i2t in (None, top_m)
                else f"{top_m} per caption, {top_m_i2t} per image")
        super().__init__([first, reranker], [top_m], name=name or f"{first.name}+rerank@{top_m}",
                         notes=(f"{first.name} retrieves the top {both}, {reranker.name} "
                                f"re-scores them; final ranking by the re-ranker's score alone"),
                         top_ms_i2t=None if top_m_i2t is None else [top_m_i2t])
        self.first, self.reranker, self.top_m = first, reranker, top_m

    def _scores(self, split, directions) -> list[torch.Tensor]:
        first = self.first.similarity(split)
        scorer = partial(self.reranker.score_pairs, split)  # (images, texts) -> (P,)
        return [two_stage_scores(first, scorer, self.survivors(d)[0], d) for d in directions]

    def similarity(self, split) -> tuple[torch.Tensor, torch.Tensor]:
        """(i2t, t2i) (N, T) each for retrieval_metrics(i2t, ..., t2i_sims=t2i)."""
        return tuple(self._scores(split, ("i2t", "t2i")))

    def t2i_similarity(self, split) -> torch.Tensor:
        """(N, T) scores for text queries only (the benchmark's sampled-query evaluation)."""
        return self._scores(split, ("t2i",))[0]
