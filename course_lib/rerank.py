"""Two-stage retrieval: a fast first stage keeps the top-M, a slow re-ranker re-scores only those.

LightningDOT §3.2: retrieve the top-M with dot products, score those M pairs with a cross-attention
model, and take the final top-K (K <= M) from the re-ranker's scores alone (the authors' code
re-sorts by the re-ranker; the two scores are not fused). A query then costs one encoding plus M
re-ranker passes, whatever the gallery size (Table 3, "+Re-ranker").

Any re-ranker plugs in through one function, a *pair scorer*:

    score_pairs(image_indices (P,), text_indices (P,)) -> scores (P,)   on one split

    first = lightningdot.similarity(split)                                   # (N, T)
    t2i = two_stage_scores(first, score_pairs, top_m=20, direction="t2i")    # (N, T)
    retrieval_metrics(i2t, split.txt2img, t2i_sims=t2i)

`two_stage_scores` returns a full (N, T) matrix, so the usual metrics apply: in each query's
column (t2i) or row (i2t) the M candidates carry the re-ranker's scores and every other item keeps
its first-stage order, strictly below them. `TwoStageMethod` is the benchmark's method.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

PairScorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DIRECTIONS = ("t2i", "i2t")


def top_m_candidates(first_scores: torch.Tensor, top_m: int, direction: str = "t2i") -> torch.Tensor:
    """The first stage's top_m per query, best first: t2i -> (T, M) image indices per text,
    i2t -> (N, M) text indices per image. top_m is capped at the number of candidates."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if top_m < 1:
        raise ValueError(f"top_m must be >= 1, got {top_m}")
    scores = torch.as_tensor(first_scores)
    by_query = scores.T if direction == "t2i" else scores  # (Q, candidates)
    return torch.topk(by_query, min(top_m, by_query.shape[1]), dim=1).indices  # (Q, M)


def two_stage_scores(first_scores, score_pairs: PairScorer, top_m: int, direction: str = "t2i"):
    """(N, T) scores of two-stage retrieval in one direction (module docstring).

    first_scores (N, T): the first stage's scores of every pair. score_pairs: the re-ranker's pair
    scorer, called once with all Q * top_m candidate pairs.
    """
    first = torch.as_tensor(first_scores, dtype=torch.float32).cpu()  # (N, T)
    candidates = top_m_candidates(first, top_m, direction)  # (Q, M)
    Q, M = candidates.shape
    queries = torch.arange(Q).repeat_interleave(M)  # (Q*M,) query-major
    flat = candidates.reshape(-1)  # (Q*M,)
    images, texts = (flat, queries) if direction == "t2i" else (queries, flat)
    rescored = torch.as_tensor(score_pairs(images, texts), dtype=torch.float32).cpu().view(Q, M)
    by_query = (first.T if direction == "t2i" else first).clone()  # (Q, candidates)
    # shift each query's first-stage scores below its lowest re-ranked score, keeping their order
    shift = by_query.max(dim=1, keepdim=True).values - rescored.min(dim=1, keepdim=True).values + 1.0
    by_query -= shift
    by_query.scatter_(1, candidates, rescored)
    return by_query.T.contiguous() if direction == "t2i" else by_query  # (N, T)


class TwoStageMethod:
    """`first` (a fast benchmark method) retrieves top_m, `reranker` re-scores them.

    reranker: any fitted-or-fittable method with `pair_scorer(split)` (e.g. CrossEncoderMethod).
    similarity(split) -> (i2t scores, t2i scores): each direction re-ranks its own candidates.
    """

    def __init__(self, first, reranker, top_m: int, name: str | None = None):
        self.first, self.reranker, self.top_m = first, reranker, top_m
        self.name = name or f"{first.name}+rerank@{top_m}"
        self.notes = (f"{first.name} retrieves the top {top_m} per query, {reranker.name} re-scores "
                      f"them; final ranking by the re-ranker's score alone")

    def fit(self, bench, tokenizer, cache_dir=None) -> "TwoStageMethod":
        for method in (self.first, self.reranker):  # a fitted method is not fitted again
            if method.model is None:
                method.fit(bench, tokenizer, cache_dir=cache_dir)
        return self

    def _scores(self, split, directions) -> list[torch.Tensor]:
        first, scorer = self.first.similarity(split), self.reranker.pair_scorer(split)
        return [two_stage_scores(first, scorer, self.top_m, d) for d in directions]

    def similarity(self, split) -> tuple[torch.Tensor, torch.Tensor]:
        """(i2t scores (N, T), t2i scores (N, T)); pass both to retrieval_metrics(..., t2i_sims=)."""
        i2t, t2i = self._scores(split, ("i2t", "t2i"))
        return i2t, t2i

    def t2i_similarity(self, split) -> torch.Tensor:
        """(N, T) scores for text queries only (the benchmark's sampled-query evaluation)."""
        return self._scores(split, ("t2i",))[0]

    def query_fn(self, split, top_k: int = 10, caption_index: int = 0):
        """One text query: the first stage's index search for top_m, then top_m re-ranker passes."""
        first = self.first.query_fn(split, top_k=self.top_m, caption_index=caption_index)
        scorer = self.reranker.pair_scorer(split)

        def answer() -> np.ndarray:
            candidates = torch.as_tensor(np.asarray(first()), dtype=torch.long)  # (M,)
            scores = scorer(candidates, torch.full_like(candidates, caption_index))  # (M,)
            return candidates[torch.argsort(scores, descending=True)[:top_k]].numpy()

        return answer


__all__ = ["PairScorer", "top_m_candidates", "two_stage_scores", "TwoStageMethod", "DIRECTIONS"]
