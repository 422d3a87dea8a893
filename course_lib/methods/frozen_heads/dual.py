"""Dual encoders of light heads on frozen features: a TokenHead per side (the linear probe, VSE++'s pooled
vector through an MLP, an MLP on every grid cell and word before the mean, LightningDOT's encoders made
shallow), cosine scores at a learned temperature,
InfoNCE (LightningDOT's CMR) or VSE++'s hinge; DualHeadsMethod trains one and keeps its best val point."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import Transformer, masked_mean
from course_lib.core.losses import contrastive_loss, hinge_triplet_loss
from course_lib.core.settings import CourseConfig
from course_lib.methods.frozen_heads.features import TextStates, image_tokens
from course_lib.methods.frozen_heads.training import (Curve, DistinctPhotos, FrozenMethod, optimizer_for, optimizer_step,
                                                      t2i_r1)
from course_lib.methods.queries import query_indices, top_k_of

@dataclass
class HeadsConfig(CourseConfig):
    """A dual encoder of light heads on frozen features (sizes from the learning curves of lesson 08)."""

    # "mean": a linear map of the mean of the tokens (grid cells / words); "mlp": + an MLP of that mean;
    # "token-mlp": + the mean of an MLP of every token (pooled after the non-linearity); "attention":
    # + a transformer's [CLS] over the tokens
    image_head: str = "mlp"
    text_head: str = "mlp"
    text_tower: str = "pretrained"  # "pretrained" (frozen states) or "scratch" (word embeddings learned here)
    loss: str = "infonce"  # "infonce" (CMR) or "hinge" (VSE++'s max of hinges)
    hidden: int = 512  # inside the MLP / attention heads
    embed_dim: int = 256  # the joint space
    layers: int = 1  # attention heads' transformer blocks
    dropout: float = 0.1
    scratch_dim: int = 300  # word embeddings of the scratch text tower
    steps: int = 600
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    margin: float = 0.2  # the hinge loss's
    # augmentation while training: each grid cell / word is kept with this probability (the rest are
    # left out of the head's mean and attention: a random crop of the image, a caption with words dropped)
    region_keep: float = 1.0
    word_keep: float = 1.0
    seed: int = 0

    SMOKE: ClassVar[dict] = {"steps": 30, "batch_size": 32}


HEADS = ("identity", "mean", "mlp", "token-mlp", "attention")


class TokenHead(nn.Module):
    """tokens (B, L, D), mask (B, L) bool [, boxes (L, 7)] -> (B, E) (see the module docstring)."""

    def __init__(self, kind: str, in_dim: int, hidden: int, out_dim: int, layers: int = 1, dropout: float = 0.1,
                 boxes: bool = False):
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"unknown head {kind!r}: use one of {', '.join(map(repr, HEADS))}")
        if kind == "identity" and in_dim != out_dim:
            raise ValueError(f"an identity head keeps its {in_dim}-d input: set embed_dim={in_dim}")
        self.kind = kind
        self.linear = nn.Linear(in_dim, out_dim)
        if kind in ("mlp", "token-mlp"):
            self.mlp = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden), nn.GELU(), nn.Dropout(dropout),
                                     nn.Linear(hidden, out_dim))
        if kind == "attention":
            self.proj = nn.Sequential(nn.Linear(in_dim, hidden), nn.LayerNorm(hidden))
            self.box = nn.Linear(7, hidden) if boxes else None
            self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
            self.transformer = Transformer(hidden, layers, max(1, hidden // 64), dropout)
            self.out = nn.Linear(hidden, out_dim)

    def forward(self, tokens, mask, boxes=None):
        tokens = tokens.float()
        mean = masked_mean(tokens, mask)  # (B, D)
        if self.kind == "identity":  # the pretrained encoder's own sentence vector, left as it is
            return mean
        if self.kind == "mean":
            return self.linear(mean)
        if self.kind == "mlp":
            return self.linear(mean) + self.mlp(mean)
        if self.kind == "token-mlp":  # each cell / word through the MLP on its own, then the mean
            return self.linear(mean) + masked_mean(self.mlp(tokens), mask)  # (B, E)
        x = self.proj(tokens)  # (B, L, H)
        if self.box is not None and boxes is not None:
            x = x + self.box(boxes)  # the grid cell's place: the only position information
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)  # (B, 1 + L, H)
        full = torch.cat([mask.new_ones(len(x), 1), mask], 1)
        return self.linear(mean) + self.out(self.transformer(x, full)[:, 0])  # (B, E)


def _keep(mask, p: float):
    """mask (B, L) with each True kept with probability p (at least one kept per row)."""
    if p >= 1.0:
        return mask
    kept = mask & (torch.rand(mask.shape, device=mask.device) < p)
    first = mask.float().argmax(1)  # a real position of each row, kept if the draw dropped them all
    kept[torch.arange(len(mask)), first] |= ~kept.any(1)
    return kept


class HeadsDual(nn.Module):
    """Two TokenHeads, L2-normalised, cosine scores times a learned scale (starting at 1 / 0.07)."""

    def __init__(self, config: HeadsConfig, image_dim: int, text_dim: int | None, vocab_size: int | None = None):
        super().__init__()
        c = self.config = config
        self.words = None
        if c.text_tower == "scratch":
            self.words = nn.Embedding(vocab_size, c.scratch_dim, padding_idx=0)
            text_dim = c.scratch_dim
        self.image = TokenHead(c.image_head, image_dim, c.hidden, c.embed_dim, c.layers, c.dropout, boxes=True)
        self.text = TokenHead(c.text_head, text_dim, c.hidden, c.embed_dim, c.layers, c.dropout)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_images(self, regions, boxes):  # (B, R, D), (R, 7) -> (B, E)
        mask = _keep(torch.ones(regions.shape[:2], dtype=torch.bool, device=regions.device),
                     self.config.region_keep if self.training else 1.0)
        return F.normalize(self.image(regions, mask, boxes), dim=-1)

    def encode_texts(self, states, mask):  # (B, L, D) states, or (B, L) ids for the scratch tower -> (B, E)
        tokens = self.words(states) if self.words is not None else states
        return F.normalize(self.text(tokens, _keep(mask, self.config.word_keep if self.training else 1.0)), dim=-1)

    def loss(self, image_emb, text_emb):
        scores = image_emb @ text_emb.T  # (B, B) rows images, positives on the diagonal
        if self.config.loss == "hinge":
            return hinge_triplet_loss(scores, self.config.margin, max_violation=True) / len(scores)
        return contrastive_loss(scores * self.log_scale.exp().clamp(max=100))



class DualHeadsMethod(FrozenMethod):
    """A dual encoder of light heads (HeadsDual): exact dot-product search over the gallery's embeddings."""

    prefix = "frozen-dual"

    @property
    def notes(self) -> str:
        c = self.config
        text = "words learned from scratch" if c.text_tower == "scratch" else f"frozen {Path(self.text.name).name}"
        return (f"dual encoder on frozen features: {c.image_head} head on the image grid, {c.text_head} head on "
                f"{text}; {c.loss} loss, {c.steps} steps; exact dot-product search")

    def fit(self, bench: dict, text: TextStates, cache_dir=None) -> "DualHeadsMethod":
        from tqdm.auto import tqdm

        c, train, val = self.config, bench["train"], bench["val"]
        regions, boxes, states, mask = self._training_inputs(bench, text)
        self.model = HeadsDual(c, regions.shape[2], text.dim, len(text.tokenizer))
        path = self.checkpoint_path = self._checkpoint(bench, text, cache_dir)
        if self._load(path):
            return self
        probe = train.subset(range(min(val.n_images, train.n_images)))  # train[:n] against val, same size
        optimizer, schedule = optimizer_for(self.model, c)
        batches = DistinctPhotos(train, c.seed)
        self.curve, every, start = Curve(), max(1, c.steps // 20), time.perf_counter()
        best = (-1.0, None)  # (val t2i R@1, weights): the model kept is the one of the best val point
        for step in tqdm(range(c.steps), desc=self.name, disable=not self.progress, mininterval=1.0):
            self.model.train()
            images, captions = batches.draw(c.batch_size)
            loss = self.model.loss(self.model.encode_images(regions[images], boxes),
                                   self.model.encode_texts(states[captions], mask[captions]))
            optimizer_step(self.model, loss, optimizer, schedule)
            if (step + 1) % every == 0 or step + 1 == c.steps:
                self.curve.step.append(step + 1)
                self.curve.loss.append(float(loss.detach()))
                self.curve.val_r1.append(t2i_r1(*self.embed(val), val.txt2img))
                self.curve.train_r1.append(t2i_r1(*self.embed(probe), probe.txt2img))
                if self.curve.val_r1[-1] > best[0]:
                    best = (self.curve.val_r1[-1], {k: v.clone() for k, v in self.model.state_dict().items()})
        self.model.load_state_dict(best[1])
        self.curve.best_step = self.curve.step[self.curve.val_r1.index(best[0])]
        self.curve.seconds = time.perf_counter() - start
        self._save(path)
        return self

    @torch.no_grad()
    def embed(self, split):
        """(image embeddings (N, E), caption embeddings (T, E)) of a split."""
        model = self._fitted()
        regions, boxes = image_tokens(split)
        states, mask = self.text.of(split)
        images = torch.cat([model.encode_images(regions[k:k + 256], boxes) for k in range(0, len(regions), 256)])
        texts = torch.cat([model.encode_texts(states[k:k + 512], mask[k:k + 512]) for k in range(0, len(states), 512)])
        return images, texts

    def similarity(self, split) -> torch.Tensor:
        images, texts = self.embed(split)
        return images @ texts.T  # (N, T)

    def rank(self, split, direction: str, top_k: int, queries=None):
        queries = query_indices(split, direction, queries)
        sims = self.similarity(split)  # (N, T)
        scores = sims.T[queries] if direction == "t2i" else sims[queries]  # (Q, gallery)
        return top_k_of(scores, top_k)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One text query: tokenise, the frozen text encoder, the head, a dot product with the gallery."""
        model, text = self._fitted(), self.text
        gallery, _ = self.embed(split)  # offline: (N, E)
        caption = split.captions[caption_index]

        @torch.no_grad()
        def query():
            batch = text.tokenize([caption])
            ids, mask = batch["input_ids"], batch["attention_mask"].bool()
            states = ids if text.scratch else text.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            return torch.topk(gallery @ model.encode_texts(states, mask)[0], min(top_k, len(gallery))).indices

        return query


__all__ = ["HEADS", "HeadsConfig", "TokenHead", "HeadsDual", "DualHeadsMethod"]
