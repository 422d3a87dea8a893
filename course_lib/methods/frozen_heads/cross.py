"""The single-stream re-ranker on frozen features (UNITER's form, shallow): [CLS] + words + regions through
a transformer, one logit per pair, trained with a softmax over each query's true item and wrong ones."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import Transformer
from course_lib.core.metrics import ranks_from_top_k
from course_lib.core.settings import CourseConfig
from course_lib.methods.frozen_heads.dual import DualHeadsMethod
from course_lib.methods.frozen_heads.features import TextStates, image_tokens
from course_lib.methods.frozen_heads.rerank import rerank_query
from course_lib.methods.frozen_heads.training import Curve, FrozenMethod, optimizer_for, optimizer_step
from course_lib.methods.queries import ground_truth, query_indices, top_k_of

@dataclass
class CrossConfig(CourseConfig):
    """The single-stream re-ranker on frozen features (sizes from lesson 08's learning curves)."""

    hidden: int = 128
    layers: int = 2  # one layer cannot relate a word to a region (its [CLS] reads each side apart): it stayed at chance
    heads: int = 2
    dropout: float = 0.1
    grid: int | None = 3  # regions average-pooled to grid x grid (None: all 7 x 7): 5x fewer tokens
    negatives: int = 3  # wrong items per query, drawn from the dual encoder's top `mine_from`
    # from the top 20 (hard negatives, UNITER's fine-tuning) a cross-encoder trained from nothing stayed at
    # chance; from all 600 training photos (random negatives) it learns (docs/tuning_notes.md)
    mine_from: int = 600
    # the dual encoder's logit added to every training pair's cross logit: the cross-encoder then learns the
    # correction to the first stage (the fused re-ranker's beta is chosen on val either way); 0 = UNITER's own
    prior_weight: float = 0.0
    steps: int = 300
    batch_size: int = 16  # queries per step, each direction
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0

    SMOKE: ClassVar[dict] = {"steps": 15, "batch_size": 8}


class CrossScorer(nn.Module):
    """[CLS] + projected words + projected regions (with box and type embeddings) -> a transformer ->
    one logit per (image, caption) pair from [CLS] (UNITER's ITM head, one layer here)."""

    def __init__(self, config: CrossConfig, image_dim: int, text_dim: int):
        super().__init__()
        c = self.config = config
        self.words = nn.Sequential(nn.Linear(text_dim, c.hidden), nn.LayerNorm(c.hidden))
        self.regions = nn.Sequential(nn.Linear(image_dim, c.hidden), nn.LayerNorm(c.hidden))
        self.box = nn.Linear(7, c.hidden)
        self.types = nn.Embedding(2, c.hidden)
        self.cls = nn.Parameter(torch.randn(1, 1, c.hidden) * 0.02)
        self.transformer = Transformer(c.hidden, c.layers, c.heads, c.dropout)
        self.head = nn.Linear(c.hidden, 1)

    def project_texts(self, states, mask):  # (B, L, Dt) -> (B, L, H)
        return self.words(states.float()) + self.types.weight[0]

    def project_images(self, regions, boxes):  # (B, R, Di), (R, 7) -> (B, R, H)
        return self.regions(regions.float()) + self.box(boxes) + self.types.weight[1]

    def score(self, words, word_mask, regions):  # (P, L, H), (P, L), (P, R, H) -> (P,) logits
        longest = int(word_mask.sum(1).max()) if len(word_mask) else 0  # right padding: drop the all-pad columns
        words, word_mask = words[:, :longest], word_mask[:, :longest]
        P = len(words)
        x = torch.cat([self.cls.expand(P, -1, -1), words, regions], 1)  # (P, 1 + L + R, H)
        mask = torch.cat([word_mask.new_ones(P, 1), word_mask, word_mask.new_ones(P, regions.shape[1])], 1)
        return self.head(self.transformer(x, mask)[:, 0]).squeeze(-1)



class CrossHeadsMethod(FrozenMethod):
    """The single-stream cross-encoder (CrossScorer), trained on the dual encoder's hardest negatives; it
    scores every (image, caption) pair of a query, so its eval budget samples queries."""

    prefix = "frozen-cross"
    eval_pairs = (12_000, 2_000)
    CURVE_GALLERY = 20  # val photos of its learning curve's gallery: it scores every pair

    def __init__(self, name: str, config: CrossConfig, dual: DualHeadsMethod, progress: bool = True):
        super().__init__(name, config, progress)
        self.dual = dual

    @property
    def notes(self) -> str:
        c = self.config
        return (f"single-stream cross-encoder on frozen features ({c.layers} layers of width {c.hidden}, regions "
                f"pooled to {c.grid}x{c.grid}), trained with {c.negatives} negatives per query from "
                f"{self.dual.name}'s top {c.mine_from}; scores every pair")

    def pairs_per_query(self, split, direction: str) -> int:
        return split.n_images if direction == "t2i" else split.n_texts

    def fit(self, bench: dict, text: TextStates, cache_dir=None) -> "CrossHeadsMethod":
        from tqdm.auto import tqdm

        c, train, val = self.config, bench["train"], bench["val"]
        regions, boxes, states, mask = self._training_inputs(bench, text, c.grid)
        self.model = CrossScorer(c, regions.shape[2], text.dim)
        path = self.checkpoint_path = self._checkpoint(bench, text, cache_dir, self.dual.checkpoint_path and
                                                       self.dual.checkpoint_path.name)
        if self._load(path):
            return self
        sims = self.dual.similarity(train)  # (N, T): where the hard negatives come from
        prior = sims * self.dual._fitted().log_scale.exp().detach()  # (N, T) the dual's logits
        hard_images = top_k_of(sims.T, c.mine_from)[0]  # (T, M) each caption's closest images
        hard_texts = top_k_of(sims, c.mine_from + 5)[0]  # (N, M + 5) each image's closest captions
        txt2img = torch.from_numpy(train.txt2img)
        optimizer, schedule = optimizer_for(self.model, c)
        generator = torch.Generator().manual_seed(c.seed)
        probe = val.subset(range(min(self.CURVE_GALLERY, val.n_images)))
        self.curve, every, start = Curve(), max(1, c.steps // 5), time.perf_counter()
        for step in tqdm(range(c.steps), desc=self.name, disable=not self.progress, mininterval=1.0):
            self.model.train()
            captions = torch.randint(len(txt2img), (c.batch_size,), generator=generator)  # t2i groups
            groups_t2i = [torch.cat([txt2img[t:t + 1], _wrong(hard_images[t], txt2img[t] == hard_images[t],
                                                              c.negatives, generator)]) for t in captions]
            images = torch.randint(train.n_images, (c.batch_size,), generator=generator)  # i2t groups
            groups_i2t = []
            for i in images:
                own = torch.from_numpy(np.flatnonzero(train.txt2img == int(i)))
                pick = own[torch.randint(len(own), (1,), generator=generator)]
                groups_i2t.append(torch.cat([pick, _wrong(hard_texts[i], txt2img[hard_texts[i]] == i, c.negatives,
                                                          generator)]))
            g = c.negatives + 1
            pair_images = torch.cat([torch.stack(groups_t2i).flatten(), images.repeat_interleave(g)])
            pair_texts = torch.cat([captions.repeat_interleave(g), torch.stack(groups_i2t).flatten()])
            logits = self.model.score(self.model.project_texts(states[pair_texts], mask[pair_texts]), mask[pair_texts],
                                      self.model.project_images(regions[pair_images], boxes)).view(-1, g)
            logits = logits + c.prior_weight * prior[pair_images, pair_texts].view(-1, g)
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))  # the true item is first
            optimizer_step(self.model, loss, optimizer, schedule)
            if (step + 1) % every == 0 or step + 1 == c.steps:
                self.curve.step.append(step + 1)
                self.curve.loss.append(float(loss.detach()))
                ranks = self._ranks(probe)
                self.curve.val_r1.append(100.0 * float(np.mean(ranks == 0)))
        self.curve.seconds = time.perf_counter() - start
        self._save(path)
        return self

    def _ranks(self, split) -> np.ndarray:
        indices, scores = self.rank(split, "t2i", 1)
        return ranks_from_top_k(scores, ground_truth(split, "t2i", split.text_queries, indices))

    @torch.no_grad()
    def score_pairs(self, split, images, texts, batch: int = 512) -> torch.Tensor:
        """(P,) logits of the pairs (images[p], texts[p]) of a split (indices (P,) each)."""
        model = self._fitted()
        regions, boxes = self._projected(split)
        states, mask = self.text.of(split)
        images, texts = torch.as_tensor(images), torch.as_tensor(texts)
        out = [model.score(model.project_texts(states[texts[k:k + batch]], mask[texts[k:k + batch]]),
                           mask[texts[k:k + batch]], regions[images[k:k + batch]]) for k in range(0, len(images), batch)]
        return torch.cat(out) if out else torch.zeros(0)

    def _projected(self, split):
        """(regions projected (N, R, H), None): the offline half of a gallery's images, once per split."""
        key = (split.name, split.n_images, id(self.model))
        if getattr(self, "_gallery", (None,))[0] != key:
            regions, boxes = image_tokens(split, self.config.grid)
            with torch.no_grad():
                self._gallery = (key, self._fitted().project_images(regions, boxes))
        return self._gallery[1], None

    def rank(self, split, direction: str, top_k: int, queries=None):
        queries = query_indices(split, direction, queries)
        size = split.n_images if direction == "t2i" else split.n_texts
        indices, scores = [], []
        for q in queries:
            gallery = torch.arange(size)
            query = torch.full((size,), int(q))
            s = self.score_pairs(split, gallery, query) if direction == "t2i" else self.score_pairs(split, query, gallery)
            i, v = top_k_of(s[None], top_k)
            indices.append(i[0])
            scores.append(v[0])
        return torch.stack(indices), torch.stack(scores)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        return rerank_query(None, self, split, caption_index, top_k, split.n_images, 0.0)


def _wrong(candidates, is_true, n: int, generator) -> torch.Tensor:
    """n of the candidates (M,) that are not true (is_true (M,) bool), drawn at random."""
    wrong = candidates[~is_true]
    return wrong[torch.randperm(len(wrong), generator=generator)[:n]]


__all__ = ["CrossConfig", "CrossScorer", "CrossHeadsMethod"]
