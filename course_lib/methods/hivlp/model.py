"""HiVLP (Chen et al. 2022): two towers with Early Output Layers of growing width, a hierarchical
retrieval loss, and a coarse-to-fine cascade over the levels (§3.4, search.py).

An image tower (a ViT over pixels, §3.2, or a region tower) and a text tower each run L blocks.
Level l sends the global token of one intermediate block (h_V0^l: [IMG]; h_T0^l: [TXT], our [CLS])
through its own MLP, the Early Output Layer, to width d_l:

    ĥ_V^l = EOL_V^l(h_V0^l) in R^{d_l}      ĥ_T^l = EOL_T^l(h_T0^l)      d_1 < d_2 < ... < d_L
    S^l(t, i) = ĥ_T^l · ĥ_V^l                                  (eq. 5: a raw inner product)
    L_RL^l  = (CE_t2v + CE_v2t) / 2 over the in-batch S^l      (eq. 6-7: losses.contrastive_loss)
    L_HRL   = sum_l L_RL^l                                     (eq. 8, every level with weight 1)
    L_LRM   = VMLM on the text tower's last block, each masked word + h_V0 (eq. 4: LightningDOT's)

Our choices where the paper is silent (runs: docs/tuning_notes.md, "HiVLP"):
- Each EOL (Linear, GELU, Linear) reads the mean of its block's real tokens (`pool="mean"`), not the
  global token alone (`pool="cls"`, the paper's).
- Over pixels the frozen pixel stem stands for the paper's pre-trained ViT: its 4x4 map becomes 16
  grid tokens with their cells' boxes, read by a 2-block region transformer (`stem="pixel_stem"`);
  a ViT from random weights (`stem="patch"`; a convolutional stem did no better) learned too slowly.
- L_LRM's h_V0 is the last image block's [IMG] state, weighted by `lrm_weight` (0 by default). The
  VLM loss (eq. 9) is not trained: "+CM" re-ranks with the cross-encoder (`hivlp+rerank@20`).
- It trains on the training split and 40,000 fresh scenes, no pre-training corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from course_lib.core.blocks import masked_mean
from course_lib.core.encoders import PixelEncoder, RegionTransformerEncoder, TransformerTextEncoder
from course_lib.core.losses import VMLM, batch_scores, contrastive_loss, mask_tokens
from course_lib.core.settings import CourseConfig
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.data.render import uniter_boxes
from course_lib.methods.pixel_stem import HEAD_POOLS, ConvBackbone, StemBackboneModule, stem_config


@dataclass
class HiVLPConfig(CourseConfig):
    """Defaults chosen in docs/tuning_notes.md, "HiVLP"."""

    image_input: str = "pixels"  # "pixels": the rendered image (the paper); "regions": detector's
    hidden: int = 128  # width of both towers (LightningDOT's; the paper: 768)
    image_layers: int = 2  # image blocks (the paper's ViT: 12; LightningDOT's region tower: 2)
    text_layers: int = 1  # half LightningDOT's 2 blocks, as the paper's 6 of 12: queries run it
    heads: int = 4  # attention heads per block
    patch_size: int = 8  # ViT patch side in pixels: a 32x32 image is 4x4 patches + [IMG]
    stem: str = "pixel_stem"  # pixels to tokens: "pixel_stem" (16 grid tokens) or "patch" (ViT)
    freeze_stem: bool = True  # keep the pixel stem's weights as they are
    stem_steps: int = 400  # the pixel stem's pre-training steps (PixelStemConfig.max_steps; cached)
    stem_head_pool: str = "cells"  # PixelStemConfig.head_pool; "cells": a grid token per cell
    backbone: str | None = None  # a timm ViT for real data ("vit_base_patch16_224"); None: ours
    pretrained: bool = False  # load the timm backbone's pretrained weights (internet or a cache)
    image_size: int | None = None  # resize pixels to this side (real images: 224); None: as stored
    eol_widths: tuple = (32, 64, 128)  # d_l per level, growing with depth (paper: 128/300/768)
    pool: str = "mean"  # what an EOL reads: its block's "mean" token (U-BERT's eq. 7) or "cls"
    lrm_weight: float = 0.0  # weight of L_LRM (eq. 4) beside L_HRL (1.0: the paper's sum)
    mask_prob: float = 0.15  # share of words LRM masks (BERT)
    dropout: float = 0.1  # dropout in both towers
    max_text_length: int = 40  # tokens per caption, [CLS] and [SEP] included
    batch_size: int = 256  # pairs per batch: every level's in-batch negatives (LightningDOT's)
    lr: float = 1e-3  # peak AdamW rate (the paper's 1e-4 is for a pre-trained 768-wide model)
    max_steps: int = 9000  # optimizer steps (~9 epochs of the training split and its fresh scenes)
    fresh_scenes: int = 40_000  # scenes from the generator beside the split's 10,000 (synthetic)
    warmup_fraction: float = 0.1  # linear warm-up over 10% of steps, then linear decay (§4.1)
    grad_clip: float = 2.0  # max gradient norm
    seed: int = 0  # weights, masking and data order

    SMOKE: ClassVar[dict] = {"max_steps": 30, "batch_size": 64, "stem_steps": 10,
                             "fresh_scenes": 100}
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 150, "batch_size": 128}  # chosen on Flickr8k's val

    def __post_init__(self):
        self.check_choices(image_input=("pixels", "regions"), pool=("mean", "cls"),
                           stem=("pixel_stem", "patch"), stem_head_pool=HEAD_POOLS)
        if self.stem == "pixel_stem" and (self.backbone is not None or self.image_size is not None):
            raise ValueError("the pixel stem is pre-trained on the course's 32x32 synthetic "
                             "scenes: with a timm backbone or resized images set stem='patch'")
        if self.fresh_scenes < 0:
            raise ValueError("fresh_scenes must be >= 0 (0: the training split alone), "
                             f"got {self.fresh_scenes}")
        widths = self.eol_widths = tuple(int(w) for w in self.eol_widths)
        if not widths or list(widths) != sorted(widths) or min(widths) < 1:
            raise ValueError("eol_widths must be positive and non-decreasing with depth, "
                             f"got {self.eol_widths}")
        if min(self.image_layers, self.text_layers) < 1:
            raise ValueError("each tower needs at least one block, got image_layers="
                             f"{self.image_layers} and text_layers={self.text_layers}")

    @property
    def n_levels(self) -> int:
        return len(self.eol_widths)


def level_layers(n_layers: int, n_levels: int) -> list[int]:
    """The 1-based block feeding each level, evenly spaced: (12, 3) -> [4, 8, 12], (3, 3) -> [1, 2,
    3]; fewer blocks than levels share them (our choice): (1, 3) -> [1, 1, 1]."""
    if n_levels < 1 or n_layers < 1:
        raise ValueError(f"need at least one level and one block, got {n_levels} levels over "
                         f"{n_layers} blocks")
    return [max(1, round(n_layers * (level + 1) / n_levels)) for level in range(n_levels)]


class EarlyOutput(nn.Module):
    """One Early Output Layer, (B, hidden) -> (B, width): "a MLP projection" and nothing after it (a
    final LayerNorm ended lower: docs/tuning_notes.md, "HiVLP")."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        return self.mlp(h0)  # (B, width)


class ViTTower(nn.Module):
    """A timm ViT -> every block's states (B, 1 + P, hidden), [IMG] first, after the final LN."""

    def __init__(self, config: HiVLPConfig):
        super().__init__()
        c = config
        kwargs = {} if c.backbone else dict(patch_size=c.patch_size, depth=c.image_layers,
                                             embed_dim=c.hidden, num_heads=c.heads,
                                             drop_rate=c.dropout, attn_drop_rate=0.0)
        if c.image_size is not None:
            kwargs["img_size"] = c.image_size
        self.vit = PixelEncoder(c.backbone, pretrained=c.pretrained, **kwargs).backbone
        self.width, self.depth = self.vit.num_features, len(self.vit.blocks)

    def forward(self, batch: dict) -> list[torch.Tensor]:
        states = self.vit.forward_intermediates(batch["pixels"], indices=self.depth, norm=True,
                                                output_fmt="NLC", return_prefix_tokens=True,
                                                intermediates_only=True)  # [(patches, prefix)]
        return [torch.cat([prefix, patches], dim=1) for patches, prefix in states]  # (B, 1 + P, C)


def grid_boxes(side: int) -> torch.Tensor:
    """(side * side, 7) normalised boxes of a side x side grid, row by row."""
    edges = np.linspace(0.0, 1.0, side + 1)
    xyxy = np.array([[edges[c], edges[r], edges[c + 1], edges[r + 1]]
                     for r in range(side) for c in range(side)])
    return torch.from_numpy(uniter_boxes(xyxy))


class StemGridTower(StemBackboneModule):
    """The pixel stem's last map as grid tokens for the region transformer: pixels (B, 3, 32, 32) ->
    (B, C, 4, 4) -> tokens (B, 16, C) + their cells' boxes -> every block's (B, 1 + 16, hidden)."""

    side = 4  # the stem's last map is 4x4 on the course's 32x32 images (three stride-2 stages)

    def __init__(self, config: HiVLPConfig):
        super().__init__()
        c = config
        self.backbone = ConvBackbone(stem_config(c).channels)
        self.frozen_backbone = c.freeze_stem
        self.freeze_backbone()
        self.encoder = RegionTransformerEncoder(self.backbone.out_dim, c.hidden, c.image_layers,
                                                c.heads, c.dropout)
        self.width, self.depth = c.hidden, c.image_layers
        # the same boxes for every image: moved with the model, never saved
        self.register_buffer("boxes", grid_boxes(self.side).float(), persistent=False)  # (16, 7)

    def grid_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, 32, 32) pixels -> (B, 16, C): the stem's last map, a token a cell, row by row."""
        grid = self.backbone(pixels)[-1]  # (B, C, s, s)
        side = grid.shape[-1]
        if side != self.side:
            raise ValueError(f"the pixel stem's map is {side}x{side}, the grid's boxes "
                             f"{self.side}x{self.side}: the stem reads the course's 32x32 images "
                             "(for other sizes set stem='patch')")
        return grid.flatten(2).transpose(1, 2)  # (B, s*s, C), row by row as grid_boxes

    def forward(self, batch: dict) -> list[torch.Tensor]:
        # a frozen stem's tokens can come precomputed as region features (method.with_stem_grid)
        tokens = self.grid_tokens(batch["pixels"]) if "pixels" in batch else batch["regions"]
        B, n = tokens.shape[:2]  # (B, 16, C)
        if n != self.side * self.side:
            raise ValueError(f"stem grid tokens come {self.side * self.side} per image, got {n}: "
                             "pass pixels, or a split made by "
                             "course_lib.methods.hivlp.method.with_stem_grid")
        boxes = self.boxes.to(tokens.dtype).expand(B, -1, -1)  # (B, s*s, 7)
        regions = {"regions": tokens, "boxes": boxes,
                   "region_mask": tokens.new_ones(B, n, dtype=torch.bool)}
        return self.encoder(regions, return_layers=True).layers


class RegionTower(nn.Module):
    """The course's region transformer, returning every block's states (B, 1 + R, hidden)."""

    def __init__(self, config: HiVLPConfig, region_dim: int):
        super().__init__()
        c = config
        self.encoder = RegionTransformerEncoder(region_dim, c.hidden, c.image_layers, c.heads,
                                                c.dropout)
        self.width, self.depth = c.hidden, c.image_layers

    def forward(self, batch: dict) -> list[torch.Tensor]:
        return self.encoder(batch, return_layers=True).layers


class HiVLP(nn.Module):
    """Two towers with Early Output Layers. image_levels / text_levels(batch) -> [ĥ^l (B, d_l)];
    encode_images / encode_texts -> the last level; loss(batch) -> {"loss", "hrl", "lrm", "rl_1",
    ...}. `special`: the tokenizer's ids (LRM's [MASK])."""

    def __init__(self, config: HiVLPConfig, vocab_size: int, region_dim: int | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        c = self.config = config
        self.vocab_size, self.special, self.modality = vocab_size, special, c.image_input
        if c.image_input == "pixels":
            self.image_tower = StemGridTower(c) if c.stem == "pixel_stem" else ViTTower(c)
        else:  # region_dim: the split's region feature size (checked by build_hivlp)
            self.image_tower = RegionTower(c, region_dim)
        self.text_tower = TransformerTextEncoder(vocab_size, c.hidden, c.text_layers, c.heads,
                                                 max_length=max(64, c.max_text_length),
                                                 dropout=c.dropout, special=special)
        self.image_at = level_layers(self.image_tower.depth, c.n_levels)  # 1-based blocks per level
        self.text_at = level_layers(c.text_layers, c.n_levels)
        width = self.image_tower.width  # of its tokens: hidden, or a timm ViT's
        self.image_eols = nn.ModuleList(EarlyOutput(width, w) for w in c.eol_widths)
        self.text_eols = nn.ModuleList(EarlyOutput(c.hidden, w) for w in c.eol_widths)
        self.vmlm = VMLM(c.hidden, vocab_size, fuse=True) if width == c.hidden else None

    # ---- encoders ---------------------------------------------------------------------------
    def _levels(self, states, mask, at, eols) -> list[torch.Tensor]:
        """Each level's EOL over its block's global token (pool="cls") or masked token mean."""
        cls = self.config.pool == "cls"
        return [eol(states[block - 1][:, 0] if cls else masked_mean(states[block - 1], mask))
                for block, eol in zip(at, eols, strict=True)]  # [(B, d_l)]

    def _image_levels(self, batch: dict, states) -> list[torch.Tensor]:
        """Pooling over [IMG] and the real regions (or every patch): a (B, 1 + P) mask."""
        mask = torch.ones(states[0].shape[:2], dtype=torch.bool, device=states[0].device)
        if self.modality == "regions":
            mask[:, 1:] = batch["region_mask"]  # (B, P)
        return self._levels(states, mask, self.image_at, self.image_eols)

    def image_levels(self, batch: dict) -> list[torch.Tensor]:
        return self._image_levels(batch, self.image_tower(batch))

    def text_levels(self, batch: dict) -> list[torch.Tensor]:
        states = self.text_tower(batch, return_layers=True).layers  # every block's (B, T, H)
        return self._levels(states, batch["attention_mask"].bool(), self.text_at, self.text_eols)

    def encode_images(self, batch: dict) -> torch.Tensor:
        return self.image_levels(batch)[-1]  # (B, d_L)

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self.text_levels(batch)[-1]  # (B, d_L)

    def forward(self, batch: dict) -> tuple[list, list]:
        return self.image_levels(batch), self.text_levels(batch)

    # ---- training ---------------------------------------------------------------------------
    def level_losses(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every level's L_RL (eq. 7) on a pair batch, the image tower's block states)."""
        image_states = self.image_tower(batch)  # every block's (B, 1 + P, C)
        levels = zip(self._image_levels(batch, image_states), self.text_levels(batch), strict=True)
        return [contrastive_loss(batch_scores(i, t)) for i, t in levels], image_states  # eq. 7

    def loss(self, batch: dict) -> dict:
        """L_HRL (eq. 8) + lrm_weight * L_LRM, each level's L_RL logged (rl_1, ...)."""
        c = self.config
        per_level, image_states = self.level_losses(batch)
        out = {"hrl": torch.stack(per_level).sum(), **logged_levels(per_level)}  # eq. 8
        out["loss"] = out["hrl"]
        if c.lrm_weight > 0:
            if self.vmlm is None:
                raise ValueError("LRM adds the image's global state to word states: the image "
                                 f"tower's width ({self.image_tower.width}) must equal hidden "
                                 f"({c.hidden}); set lrm_weight=0")
            ids, labels = mask_tokens(batch["input_ids"], batch["attention_mask"], self.vocab_size,
                                      c.mask_prob, special=self.special)  # (B, T) each
            words = self.text_tower({**batch, "input_ids": ids}).tokens  # (B, T, H) the last block
            out["lrm"] = self.vmlm(words, image_states[-1][:, 0], labels)  # eq. 4: the last h_V0
            out["loss"] = out["loss"] + c.lrm_weight * out["lrm"]
        return out


def logged_levels(level_losses) -> dict:
    """{"rl_1": L_RL^1, ...}, detached, for the history."""
    return {f"rl_{level + 1}": v.detach() for level, v in enumerate(level_losses)}


def hrl_loss(image_levels, text_levels) -> torch.Tensor:
    """Eq. 6-8: sum over levels of the bidirectional in-batch CE of S^l = image_levels[l] @
    text_levels[l].T (B, B), positives on the diagonal."""
    if len(image_levels) != len(text_levels):
        raise ValueError(f"{len(image_levels)} image levels but {len(text_levels)} text levels")
    return torch.stack([contrastive_loss(batch_scores(i, t))  # eq. 8: every level weighs 1
                        for i, t in zip(image_levels, text_levels, strict=True)]).sum()


def build_hivlp(config: HiVLPConfig, split, tokenizer) -> HiVLP:
    """A fresh HiVLP for the split's image input and the vocabulary."""
    regions = config.image_input == "regions"
    if regions and not split.has_regions:
        raise ValueError(f"split {split.name!r} has no region features: use image_input='pixels'")
    if not regions and not split.has_pixels:
        raise ValueError(f"split {split.name!r} has no pixels: use image_input='regions' or give "
                         "read_karpathy an image_root")
    region_dim = split.regions.shape[-1] if regions else None
    return HiVLP(config, len(tokenizer), region_dim, special=SpecialTokens.of(tokenizer))
