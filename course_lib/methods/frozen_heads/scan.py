"""SCAN's stacked cross attention on frozen features: lesson 02's scorer with light heads.

Each caption's frozen word states and each photo's grid cells go through one linear map per side (the
cells' boxes added) into a joint space, L2-normalised per item as SCAN's encoders do; words attend to
the cells (text-to-image, lambda_softmax 9, LogSumExp pooling 6: SCAN's Flickr30k t2i recipe), times a
learned scale. Trained with in-batch InfoNCE on the (B, B) SCAN scores of B distinct photos and one of
their captions each (SCAN's own loss is the hinge; InfoNCE is the one every head here shares), the weights
of its best val point kept. A pairwise scorer with the cross-encoder's interface (project_texts,
project_images, score), so rerank.RerankMethod re-scores a dual encoder's top M with it.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.losses import contrastive_loss
from course_lib.core.settings import CourseConfig
from course_lib.methods.frozen_heads.cross import CrossHeadsMethod
from course_lib.methods.frozen_heads.features import TextStates
from course_lib.methods.frozen_heads.training import Curve, DistinctPhotos, optimizer_for, optimizer_step
from course_lib.methods.scan.attention import aggregate, func_attention, scan_similarity


@dataclass
class SCANHeadsConfig(CourseConfig):
    """SCAN over frozen features (sizes from lesson 08's data: docs/tuning_notes.md)."""

    embed_dim: int = 256  # the joint space of words and grid cells
    lambda_softmax: float = 9.0  # SCAN t2i: the attention's inverse temperature
    lambda_lse: float = 6.0  # SCAN t2i: LogSumExp pooling over the caption's words
    grid: int | None = None  # None: every cell of the feature grid (7 x 7) is a region
    steps: int = 300
    batch_size: int = 64  # distinct photos per step, one caption each: a (B, B) score matrix
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0

    SMOKE: ClassVar[dict] = {"steps": 20, "batch_size": 16}


class SCANScorer(nn.Module):
    """Linear(words) and Linear(cells) + Linear(box) into one space, SCAN t2i scores times a learned scale."""

    def __init__(self, config: SCANHeadsConfig, image_dim: int, text_dim: int):
        super().__init__()
        c = self.config = config
        self.words = nn.Linear(text_dim, c.embed_dim)
        self.regions = nn.Linear(image_dim, c.embed_dim)
        self.box = nn.Linear(7, c.embed_dim)
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def project_texts(self, states, mask):  # (B, L, Dt), (B, L) -> (B, L, E), unit length per word
        return F.normalize(self.words(states.float()), dim=-1)

    def project_images(self, regions, boxes):  # (B, R, Di), (R, 7) -> (B, R, E), unit length per cell
        return F.normalize(self.regions(regions.float()) + self.box(boxes), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=100)

    def score(self, words, word_mask, regions):  # (P, L, E), (P, L), (P, R, E) -> (P,) logits, pair by pair
        c = self.config
        attended, _ = func_attention(words, regions, c.lambda_softmax, query_mask=word_mask)  # (P, L, E)
        cosine = F.cosine_similarity(words, attended, dim=-1, eps=1e-8)  # (P, L)
        return self.scale() * aggregate(cosine, word_mask, "lse", c.lambda_lse)

    def similarity(self, words, word_mask, regions):  # (T, L, E), (T, L), (N, R, E) -> (N, T) logits
        c = self.config
        return self.scale() * scan_similarity(regions, None, words, word_mask, "t2i", c.lambda_softmax, "lse",
                                              c.lambda_lse)


class SCANHeadsMethod(CrossHeadsMethod):
    """SCAN on frozen features: it attends over every gallery photo per query (a pairwise scorer), and
    re-ranks a dual encoder's top M (rerank.RerankMethod)."""

    prefix = "frozen-scan"
    eval_pairs = (None, None)  # cheap enough per pair to rank every query of these galleries

    def __init__(self, name: str, config: SCANHeadsConfig, progress: bool = True):
        super().__init__(name, config, None, progress)

    @property
    def notes(self) -> str:
        c = self.config
        cells = "every grid cell" if c.grid is None else f"cells pooled to {c.grid}x{c.grid}"
        return (f"SCAN t2i on frozen features (one linear map per side to {c.embed_dim}-d, {cells}, lambda_softmax "
                f"{c.lambda_softmax:g}, LogSumExp {c.lambda_lse:g}), in-batch InfoNCE; attends over every photo")

    def fit(self, bench: dict, text: TextStates, cache_dir=None) -> "SCANHeadsMethod":
        from tqdm.auto import tqdm

        c, train, val = self.config, bench["train"], bench["val"]
        regions, boxes, states, mask = self._training_inputs(bench, text, c.grid)
        self.model = SCANScorer(c, regions.shape[2], text.dim)
        path = self.checkpoint_path = self._checkpoint(bench, text, cache_dir)
        if self._load(path):
            return self
        optimizer, schedule = optimizer_for(self.model, c)
        batches = DistinctPhotos(train, c.seed)
        self.curve, every, start = Curve(), max(1, c.steps // 10), time.perf_counter()
        best = (-1.0, None)  # (val t2i R@1, weights)
        for step in tqdm(range(c.steps), desc=self.name, disable=not self.progress, mininterval=1.0):
            self.model.train()
            images, captions = batches.draw(c.batch_size)
            longest = int(mask[captions].sum(1).max())
            words = self.model.project_texts(states[captions, :longest], mask[captions, :longest])
            scores = self.model.similarity(words, mask[captions, :longest],
                                           self.model.project_images(regions[images], boxes))  # (B, B)
            loss = contrastive_loss(scores)
            optimizer_step(self.model, loss, optimizer, schedule)
            if (step + 1) % every == 0 or step + 1 == c.steps:
                self.curve.step.append(step + 1)
                self.curve.loss.append(float(loss.detach()))
                self.curve.val_r1.append(100.0 * float(np.mean(self._ranks(val) == 0)))
                if self.curve.val_r1[-1] > best[0]:
                    best = (self.curve.val_r1[-1], copy.deepcopy(self.model.state_dict()))
        self.model.load_state_dict(best[1])
        self.curve.best_step = self.curve.step[self.curve.val_r1.index(best[0])]
        self.curve.seconds = time.perf_counter() - start
        self._save(path)
        return self


__all__ = ["SCANHeadsConfig", "SCANScorer", "SCANHeadsMethod"]
