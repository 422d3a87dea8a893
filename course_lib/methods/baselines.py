"""An untrained reference method: random projections of a bag of words and of pooled regions.
Its recalls sit near chance: it runs the benchmark end to end before any real method exists, and
shows what "no model" looks like on each setting."""

from __future__ import annotations

import numpy as np
import torch

from course_lib.methods.base import Ranker
from course_lib.methods.queries import query_indices, top_k_of


class RandomProjectionBaseline(Ranker):
    """Dot products between random projections of bag-of-words and of mean region features."""

    name = "random_projection"
    notes = "untrained baseline: random projections, expect chance-level recall"

    def __init__(self, dim: int = 64, seed: int = 0):
        self.dim, self.seed, self.tokenizer = dim, seed, None

    def fit(self, bench, tokenizer, cache_dir=None) -> RandomProjectionBaseline:
        """Nothing is trained: only fix the random projections' sizes from the data."""
        self.tokenizer = tokenizer
        generator = torch.Generator().manual_seed(self.seed)
        region_dim = bench["train"].regions.shape[-1]
        self.text_projection = torch.randn(len(tokenizer), self.dim, generator=generator)  # (V, E)
        self.image_projection = torch.randn(region_dim, self.dim, generator=generator)  # (D, E)
        return self

    def encode_texts(self, captions) -> torch.Tensor:
        ids = self.tokenizer(list(captions), add_special_tokens=False, padding=True,
                             return_tensors="pt")
        counts = torch.zeros(len(captions), len(self.tokenizer))  # (T, V) bag of words
        counts.scatter_add_(1, ids["input_ids"], ids["attention_mask"].float())
        return counts @ self.text_projection  # (T, E)

    def encode_images(self, split) -> torch.Tensor:
        regions = torch.from_numpy(split.regions)  # (N, R, D)
        mask = torch.from_numpy(split.region_mask).unsqueeze(-1).float()  # (N, R, 1)
        pooled = (regions * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N, D)
        return pooled @ self.image_projection  # (N, E)

    def similarity(self, split) -> torch.Tensor:
        return self.encode_images(split) @ self.encode_texts(split.captions).T  # (N, T)

    def rank(self, split, direction: str, top_k: int, queries=None):
        """Each query's top_k (indices (Q, k), scores (Q, k)), from the dense similarity."""
        queries = torch.from_numpy(query_indices(split, direction, queries))
        sims = self.similarity(split)  # (N, T)
        return top_k_of(sims.T[queries] if direction == "t2i" else sims[queries], top_k)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """A zero-argument callable answering one text query against the split's gallery."""
        gallery = self.encode_images(split)  # encoded once, offline
        caption = split.captions[caption_index]

        def answer() -> np.ndarray:
            scores = gallery @ self.encode_texts([caption])[0]  # (N,)
            return torch.topk(scores, min(top_k, len(scores))).indices.numpy()

        return answer
