"""PairwiseRanking: what every cross-attention scorer shares (SCAN, the cross-encoder, Slow),
mixed into base.PairwiseMethod (whose model, name and progress it uses); kept apart from base."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.methods.queries import TopK, check_direction, checked_pairs, query_indices, top_k_of

# pairs scored per score_block call while ranking (memory, not the result)
_PAIRS_PER_BLOCK = 1 << 20
# a split this small ranked in full keeps its (N, T) scores (80 MB at most) for both directions
_DENSE_PAIRS = 20_000_000


class PairwiseRanking(ABC):
    """Ranking by scoring (query, gallery item) pairs jointly: a subclass implements score_block and
    inherits rank, similarity and score_pairs (the re-ranker API of rerank.Cascade)."""

    @abstractmethod
    def score_block(self, split, image_indices, text_indices) -> torch.Tensor:
        """(n, m) scores of the images image_indices (n,) against the captions text_indices (m,)."""

    def pairs_per_query(self, split, direction: str) -> int:
        return split.n_images if check_direction(direction) == "t2i" else split.n_texts

    def similarity(self, split) -> torch.Tensor:
        """(N, T) scores of every pair: small splits only, O(N * T) work."""
        return self.score_block(split, np.arange(split.n_images), np.arange(split.n_texts))

    _dense: tuple = (None, None, None)  # (split, model, (N, T) scores): see _DENSE_PAIRS

    def rank(self, split, direction: str, top_k: int, queries=None) -> TopK:
        """A chunk of queries at a time against the gallery; small full splits scored once."""
        queries = query_indices(split, direction, queries)
        everything = np.array_equal(queries, query_indices(split, direction))
        dense = self._dense[0] is split and self._dense[1] is self.model
        if not dense and everything and split.n_images * split.n_texts <= _DENSE_PAIRS:
            self._dense, dense = (split, self.model, self.similarity(split)), True  # each pair once
        if dense:
            scores, q = self._dense[2], torch.from_numpy(queries)  # (N, T), (Q,)
            return top_k_of(scores.T[q] if direction == "t2i" else scores[q], top_k)
        gallery = np.arange(split.n_images if direction == "t2i" else split.n_texts)
        per_chunk = max(1, _PAIRS_PER_BLOCK // max(len(gallery), 1))
        tops = []
        for start in tqdm(range(0, len(queries), per_chunk), desc=f"{self.name} {direction}",
                          disable=not self.progress or len(queries) <= per_chunk, leave=False):
            chunk = queries[start:start + per_chunk]
            block = (self.score_block(split, gallery, chunk).T if direction == "t2i"
                     else self.score_block(split, chunk, gallery))  # (c, G)
            tops.append(top_k_of(block, top_k))  # (c, k) each
        indices, scores = zip(*tops, strict=True)
        return torch.cat(indices), torch.cat(scores)  # (Q, k) each

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        """(P,) scores of the pairs (image_indices[p], text_indices[p]): score_block per caption."""
        images, texts = checked_pairs(image_indices, text_indices)  # (P,) each
        out = torch.empty(len(images))
        for text in torch.unique(texts).tolist():
            where = torch.nonzero(texts == text).squeeze(1)
            block = self.score_block(split, images[where].numpy(), np.array([text]))  # (p, 1)
            out[where] = block[:, 0].float()
        return out
