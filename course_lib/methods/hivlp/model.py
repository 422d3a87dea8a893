"""HiVLP (Chen et al. 2022): two towers with Early Output Layers of growing width, a hierarchical
retrieval loss, and a coarse-to-fine cascade over the levels.

An image tower (a ViT over the pixels, §3.2; or, to separate the pixel-vs-detector confound, the
course's region tower) and a text tower each run L transformer blocks. At each level l the global
token of one intermediate block (h_V0^l: [IMG], our [CLS] slot; h_T0^l: [TXT], our [CLS]) goes
through that level's own MLP, the Early Output Layer, to width d_l; widths grow with depth:

    ĥ_V^l = EOL_V^l(h_V0^l) in R^{d_l}      ĥ_T^l = EOL_T^l(h_T0^l)      d_1 < d_2 < ... < d_L
    S^l(t, i) = ĥ_T^l · ĥ_V^l                                  (eq. 5: a raw inner product)
    L_RL^l  = (CE_t2v + CE_v2t) / 2 over the in-batch S^l      (eq. 6-7: losses.contrastive_loss)
    L_HRL   = sum_l L_RL^l                                     (eq. 8, every level with weight 1)
    L_LRM   = VMLM on the text tower's last block, each masked word + h_V0 (eq. 4: LightningDOT's)

Retrieval (§3.4, course_lib.methods.hivlp.method): level 1 scores every candidate at width d_1 and keeps N2,
level 2 re-scores those at d_2 and keeps N3, the last level orders the N3. Its cost (the
paper's time model and a multiply-add count of ours) is in course_lib.methods.hivlp.cost.

Where the paper is silent, our choices (the notebook says them too; HiVLPConfig's comments give the reasons,
docs/tuning_notes.md, "HiVLP", the runs):
- Sizes: hidden 128 (LightningDOT's), a 2-block image tower over the 16 grid tokens (or a 6-block ViT over
  8x8-pixel patches with stem="patch"), a 1-block text tower (half of LightningDOT's two, as the paper's 6 is half
  of 12); EOL widths 32/64/128 (the paper's 128/300/768 ratio, roughly), after evenly spaced blocks (`level_layers`:
  the paper's 4/8/12 and 2/4/6).
- Where we depart from the paper: each EOL reads the mean of its block's real tokens, the global token included
  (`pool="mean"`, the default), not the global token alone (`pool="cls"`, the paper's h_V0^l / h_T0^l), as the
  learning curves chose.
- The EOL MLP: Linear(hidden, hidden), GELU, Linear(hidden, d_l) (depth not given), nothing after it
  (`eol_layernorm=True` adds a LayerNorm).
- The image tower over pixels starts from a pre-trained backbone, as the paper's ViT does: ours is the course's
  pixel stem (course_lib.methods.pixel_stem, pre-trained on the pre-training split's scenes against what sits in
  each cell), kept frozen, whose 4x4 map becomes 16 grid tokens (each with its cell's box, as a region has) read
  by LightningDOT's 2-block region transformer (`stem="pixel_stem"`, "grid features"). The paper's ViT from random
  weights (`stem="patch"`; `stem="conv"` with a convolutional stem) learned to see too slowly here.
- LRM's image term h_V0 is the last image block's [IMG] state (eq. 4 writes h_V0^l with no l). It is added to
  L_HRL with weight `lrm_weight` (the paper gives none), 0 by default; 1.0 is L_HRL + L_LRM, two of the paper's
  three objectives. The cross-modal encoder and its VLM loss (eq. 9), the third, are not trained here: "+CM"
  re-ranking uses lesson 02's cross-encoder instead (`hivlp+rerank@20`).
- No pre-training corpus for HiVLP itself: it trains on the training split and 40,000 fresh scenes from the same
  generator (`fresh_scenes`), its pixel stem on the pre-training split's scenes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from timm.models.vision_transformer_hybrid import HybridEmbed
from torch import nn

from course_lib.core.blocks import masked_mean
from course_lib.core.encoders import (
    PixelEncoder,
    RegionTransformerEncoder,
    TransformerTextEncoder,
)
from course_lib.core.losses import VMLM, batch_scores, contrastive_loss, mask_tokens
from course_lib.core.settings import CourseConfig
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.data.render import uniter_boxes
from course_lib.methods.pixel_stem import HEAD_POOLS, ConvBackbone, StemBackboneModule, stem_config

IMAGE_INPUTS = ("pixels", "regions")
STEMS = ("pixel_stem", "patch", "conv")
TRAIN_LEVELS = ("all", "last")
POOLS = ("mean", "cls")


@dataclass
class HiVLPConfig(CourseConfig):
    image_input: str = "pixels"  # "pixels": a ViT over the rendered image (the paper); "regions": the detector tower
    hidden: int = 128  # width of both towers (the paper: 768); LightningDOT's, as in the paper
    image_layers: int = 2  # image blocks (the paper's ViT: 12; LightningDOT's region tower: 2, as ours)
    text_layers: int = 1  # half of LightningDOT's, as the paper's 6 of 12: its speed claim rests on it (queries run it)
    heads: int = 4  # attention heads per block
    patch_size: int = 8  # ViT patch side in pixels: a 32x32 image is 4x4 patches + [IMG]
    # how pixels become tokens: "pixel_stem" (the pre-trained stem's 4x4 map as 16 grid tokens), "patch" (the paper's
    # ViT from random weights, use image_layers=6; docs/tuning_notes.md, "HiVLP"), "conv" (a convolutional stem)
    stem: str = "pixel_stem"
    freeze_stem: bool = True  # keep the stem as it is: fine-tuned at the towers' rate it did worse (tuning notes)
    stem_steps: int = 400  # the pixel stem's pre-training steps (PixelStemConfig.max_steps; cached, paid once)
    # how the stem's heads read its map (PixelStemConfig.head_pool): "cells" makes each grid token carry its own cell
    # (docs/tuning_notes.md, "HiVLP")
    stem_head_pool: str = "cells"
    backbone: str | None = None  # a timm ViT name for real data (e.g. "vit_base_patch16_224"); None = the course's
    pretrained: bool = False  # load the timm backbone's pretrained weights (needs internet or a cache)
    image_size: int | None = None  # resize pixels to this side (real images: e.g. 224); None = as stored (32)
    eol_widths: tuple = (32, 64, 128)  # d_l of each level, growing with depth to the width (the paper: 128/300/768)
    # end each EOL with a LayerNorm (level vectors start at norm sqrt(d_l), not near 0); over regions the bare
    # MLP ended higher (docs/tuning_notes.md, "HiVLP")
    eol_layernorm: bool = False
    # what a level's EOL reads: "mean" of its block's real tokens, global token included (U-BERT's eq. 7); "cls" the
    # global token alone (the paper's h_V0^l); docs/tuning_notes.md, "The levels read the mean of their
    # block's tokens"
    pool: str = "mean"
    train_levels: str = "all"  # "all": L_HRL over every level (eq. 8); "last": the last level only (ablation)
    # weight of L_LRM (eq. 4) beside L_HRL (1.0: the paper's L_HRL + L_LRM). Here it slowed alignment and each step
    # (docs/tuning_notes.md), so the default is 0 and notebook 05 measures it
    lrm_weight: float = 0.0
    mask_prob: float = 0.15  # share of words LRM masks (BERT)
    dropout: float = 0.1  # dropout in both towers
    max_text_length: int = 40  # tokens per caption, [CLS] and [SEP] included
    batch_size: int = 256  # pairs per batch: the in-batch negatives of every level's loss (as LightningDOT's)
    lr: float = 1e-3  # peak AdamW rate (the paper's 1e-4 is for a pre-trained 768-wide model)
    # optimizer steps (about 9 epochs of the 250k pairs of the training split and its fresh scenes;
    # docs/tuning_notes.md, "Fresh scenes and 9,000 steps, the stem's grid computed once")
    max_steps: int = 9000
    # scenes drawn fresh from the generator (data.synthetic.with_fresh_scenes) beside the training split's 10,000: on
    # the split alone the model fits its training images ahead of val (docs/tuning_notes.md, "HiVLP")
    fresh_scenes: int = 40_000
    warmup_fraction: float = 0.1  # linear warm-up over 10% of steps, then linear decay (§4.1)
    grad_clip: float = 2.0  # max gradient norm
    seed: int = 0  # weights, masking and data order

    SMOKE: ClassVar[dict] = {"max_steps": 30, "batch_size": 64, "stem_steps": 10, "fresh_scenes": 100}
    # the real-photo preset (CourseConfig.REAL_PHOTOS), chosen on Flickr8k's val
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 150, "batch_size": 128}

    def __post_init__(self):
        if self.image_input not in IMAGE_INPUTS:
            raise ValueError(f"image_input must be one of {IMAGE_INPUTS}, got {self.image_input!r}")
        if self.stem not in STEMS or self.stem_head_pool not in HEAD_POOLS:
            raise ValueError(f"stem must be one of {STEMS} and stem_head_pool one of {HEAD_POOLS}, got {self.stem!r} "
                             f"and {self.stem_head_pool!r}")
        if self.stem == "pixel_stem" and (self.backbone is not None or self.image_size is not None):
            raise ValueError("the pixel stem is pre-trained on the course's 32x32 synthetic scenes: with a timm "
                             "backbone or resized (real) images set stem='patch'")
        if self.fresh_scenes < 0:
            raise ValueError(f"fresh_scenes must be >= 0 (0: the training split alone), got {self.fresh_scenes}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.train_levels not in TRAIN_LEVELS:
            raise ValueError(f"train_levels must be one of {TRAIN_LEVELS}, got {self.train_levels!r}")
        self.eol_widths = tuple(int(w) for w in self.eol_widths)
        n = len(self.eol_widths)
        if n < 1 or list(self.eol_widths) != sorted(self.eol_widths) or min(self.eol_widths) < 1:
            raise ValueError(f"eol_widths must be positive and non-decreasing with depth, got {self.eol_widths}")
        for side, layers in (("image", self.image_layers), ("text", self.text_layers)):
            if layers < 1:
                raise ValueError(f"the {side} tower needs at least one block, got {side}_layers={layers}")

    @property
    def n_levels(self) -> int:
        return len(self.eol_widths)


def level_layers(n_layers: int, n_levels: int) -> list[int]:
    """The 1-based blocks whose global token feeds each level, evenly spaced and ending at the last:
    (12, 3) -> [4, 8, 12], (6, 3) -> [2, 4, 6], (3, 3) -> [1, 2, 3]. A tower with fewer blocks than
    levels feeds several levels from one block ((1, 3) -> [1, 1, 1]: our one-block text tower, half of
    LightningDOT's two as the paper's is half of its twelve; its levels then differ by EOL width only).
    The paper never has fewer blocks than levels, so this case is our choice."""
    if n_levels < 1 or n_layers < 1:
        raise ValueError(f"need at least one level and one block, got {n_levels} levels over {n_layers} blocks")
    return [max(1, round(n_layers * (l + 1) / n_levels)) for l in range(n_levels)]


class EarlyOutput(nn.Module):
    """One Early Output Layer: the global token (B, hidden) -> (B, width) through a 2-layer MLP, and
    optionally a LayerNorm (layernorm=True), so that S^l = a raw inner product starts at the scale of
    LightningDOT's LayerNorm'd [CLS] vectors (HiVLPConfig.eol_layernorm says what it measured)."""

    def __init__(self, hidden: int, width: int, layernorm: bool = True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, width),
                                 *([nn.LayerNorm(width)] if layernorm else []))

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        return self.mlp(h0)  # (B, width)


def conv_stem(hidden: int, patch_size: int) -> nn.Sequential:
    """log2(patch_size) stride-2 3x3 convolutions (GELU between), widths doubling up to `hidden`:
    a (B, 3, H, W) image -> (B, hidden, H / patch_size, W / patch_size), one vector per patch, each
    seeing its neighbours' pixels too (the "convolutional stem" of Xiao et al., 2021)."""
    steps = int(math.log2(patch_size))
    if 2 ** steps != patch_size or steps < 1:
        raise ValueError(f"a conv stem needs patch_size a power of 2 (>= 2), got {patch_size}")
    widths = [3] + [max(hidden >> (steps - 1 - i), 8) for i in range(steps)]
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Conv2d(a, b, 3, stride=2, padding=1)] + ([nn.GELU()] if i < steps - 1 else [])
    return nn.Sequential(*layers)


class ConvStemEmbed(HybridEmbed):
    """timm's hybrid patch embedding over `conv_stem`: the ViT's patch_size becomes the stem's total
    stride, and each cell of the stem's map is one token (a 1x1 projection to embed_dim)."""

    def __init__(self, *, patch_size: int, embed_dim: int, **kwargs):
        super().__init__(backbone=conv_stem(embed_dim, patch_size), patch_size=1, embed_dim=embed_dim, **kwargs)


class ViTTower(nn.Module):
    """A timm ViT over pixels that returns every block's states (B, 1 + P, hidden), [IMG] first,
    each after the final LayerNorm (as `blocks.Transformer(return_layers=True)` gives them)."""

    def __init__(self, config: HiVLPConfig):
        super().__init__()
        c = config
        kwargs = {} if c.backbone else dict(patch_size=c.patch_size, depth=c.image_layers, embed_dim=c.hidden,
                                             num_heads=c.heads, drop_rate=c.dropout, attn_drop_rate=0.0)
        if c.image_size is not None:
            kwargs["img_size"] = c.image_size
        if c.stem == "conv":
            kwargs["embed_layer"] = ConvStemEmbed
        self.vit = PixelEncoder(c.backbone, pretrained=c.pretrained, **kwargs).backbone
        self.width, self.depth = self.vit.num_features, len(self.vit.blocks)

    def forward(self, batch: dict) -> list[torch.Tensor]:
        states = self.vit.forward_intermediates(batch["pixels"], indices=self.depth, norm=True,
                                                output_fmt="NLC", return_prefix_tokens=True,
                                                intermediates_only=True)  # [(patches, prefix)] per block
        return [torch.cat([prefix, patches], dim=1) for patches, prefix in states]  # (B, 1 + P, C) each


def grid_boxes(side: int) -> torch.Tensor:
    """The (side * side, 7) boxes of a side x side grid over the image, row by row, as a detector's
    region boxes (x1, y1, x2, y2, w, h, area; normalised): a grid token's only position information."""
    edges = np.linspace(0.0, 1.0, side + 1)
    xyxy = np.array([[edges[c], edges[r], edges[c + 1], edges[r + 1]] for r in range(side) for c in range(side)])
    return torch.from_numpy(uniter_boxes(xyxy))


class StemGridTower(StemBackboneModule):
    """The pre-trained pixel stem's last map as grid tokens, read by the course's region transformer:

        pixels (B, 3, 32, 32) -> ConvBackbone -> (B, C, 4, 4) -> 16 tokens (B, 16, C), each with its
        cell's box (grid_boxes) -> RegionTransformerEncoder -> every block's states (B, 1 + 16, hidden)

    The backbone's weights come from the pixel stem (method.train_hivlp loads them); frozen
    (config.freeze_stem) it keeps the stem's BatchNorm statistics and gets no gradient."""

    side = 4  # the stem's last map is 4x4 on the course's 32x32 images (three stride-2 stages)

    def __init__(self, config: HiVLPConfig):
        super().__init__()
        c = config
        self.backbone = ConvBackbone(stem_config(c).channels)
        self.frozen_backbone = c.freeze_stem
        self.freeze_backbone()
        self.encoder = RegionTransformerEncoder(self.backbone.out_dim, c.hidden, c.image_layers, c.heads, c.dropout)
        self.width, self.depth = c.hidden, c.image_layers
        # the same boxes for every image: built once, moved with the model, never saved
        self.register_buffer("boxes", grid_boxes(self.side).float(), persistent=False)  # (16, 7)

    def grid_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, 32, 32) pixels -> (B, 16, C) the stem's last map, one token per cell, row by row."""
        grid = self.backbone(pixels)[-1]  # (B, C, s, s)
        side = grid.shape[-1]
        if side != self.side:
            raise ValueError(f"the pixel stem's map is {side}x{side}, the grid's boxes {self.side}x{self.side}: the "
                             "stem reads the course's 32x32 images (for other sizes set stem='patch')")
        return grid.flatten(2).transpose(1, 2)  # (B, s*s, C), row by row as grid_boxes

    def forward(self, batch: dict) -> list[torch.Tensor]:
        # a frozen stem is a fixed function: training reads its tokens computed once per image, stored as the
        # split's region features (method.with_stem_grid), instead of running it at every step
        tokens = self.grid_tokens(batch["pixels"]) if "pixels" in batch else batch["regions"]  # (B, 16, C)
        B, n = tokens.shape[:2]
        if n != self.side * self.side:
            raise ValueError(f"stem grid tokens come {self.side * self.side} per image, got {n}: pass pixels, or a split "
                             "made by course_lib.methods.hivlp.method.with_stem_grid")
        boxes = self.boxes.to(tokens.dtype).expand(B, -1, -1)  # (B, s*s, 7)
        regions = {"regions": tokens, "boxes": boxes, "region_mask": tokens.new_ones(B, n, dtype=torch.bool)}
        return self.encoder(regions, return_layers=True).layers


class RegionTower(nn.Module):
    """The course's region transformer, returning every block's states (B, 1 + R, hidden)."""

    def __init__(self, config: HiVLPConfig, region_dim: int):
        super().__init__()
        c = config
        self.encoder = RegionTransformerEncoder(region_dim, c.hidden, c.image_layers, c.heads, c.dropout)
        self.width, self.depth = c.hidden, c.image_layers

    def forward(self, batch: dict) -> list[torch.Tensor]:
        return self.encoder(batch, return_layers=True).layers


class HiVLP(nn.Module):
    """Two towers with Early Output Layers (module docstring).

    image_levels(batch) / text_levels(batch) -> [ĥ^l (B, d_l) for each level]; encode_images /
    encode_texts -> the last level (a plain dual encoder: `hivlp-flat`); forward(batch) -> (image
    levels, text levels); loss(batch) -> {"loss", "hrl", "lrm", "rl_1", ...}. `modality` is the image
    field it reads ("pixels" or "regions"). `special`: the tokenizer's ids (LRM's [MASK]).
    """

    def __init__(self, config: HiVLPConfig, vocab_size: int, region_dim: int | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        c = self.config = config
        self.vocab_size, self.special, self.modality = vocab_size, special, c.image_input
        if c.image_input == "pixels":
            self.image_tower = StemGridTower(c) if c.stem == "pixel_stem" else ViTTower(c)
        else:
            if region_dim is None:
                raise ValueError("image_input='regions' needs region_dim (the split's region feature size)")
            self.image_tower = RegionTower(c, region_dim)
        self.text_tower = TransformerTextEncoder(vocab_size, c.hidden, c.text_layers, c.heads,
                                                 max_length=max(64, c.max_text_length), dropout=c.dropout,
                                                 special=special)
        self.image_at = level_layers(self.image_tower.depth, c.n_levels)  # 1-based blocks per level
        self.text_at = level_layers(c.text_layers, c.n_levels)
        self.image_eols = nn.ModuleList(EarlyOutput(self.image_tower.width, w, c.eol_layernorm) for w in c.eol_widths)
        self.text_eols = nn.ModuleList(EarlyOutput(c.hidden, w, c.eol_layernorm) for w in c.eol_widths)
        self.vmlm = VMLM(c.hidden, vocab_size, fuse=True) if self.image_tower.width == c.hidden else None

    # ---- encoders ---------------------------------------------------------------------------
    def _image_states(self, batch: dict) -> list[torch.Tensor]:
        return self.image_tower(batch)  # every block's (B, 1 + P, C)

    def _text_states(self, batch: dict) -> list[torch.Tensor]:
        return self.text_tower(batch, return_layers=True).layers  # every block's (B, T, H)

    def _image_mask(self, batch: dict, states: torch.Tensor) -> torch.Tensor:
        """(B, 1 + P) bool, True = a real token: [IMG] and the unpadded regions (every patch or cell is real)."""
        B, L = states.shape[:2]
        if self.modality == "regions":
            return torch.cat([batch["region_mask"].new_ones(B, 1), batch["region_mask"]], dim=1).bool()
        return torch.ones(B, L, dtype=torch.bool, device=states.device)

    def _levels(self, states, mask, at, eols) -> list[torch.Tensor]:
        """Each level's EOL over its block's global token (pool="cls") or masked token mean (pool="mean")."""
        pooled = (lambda s: s[:, 0]) if self.config.pool == "cls" else (lambda s: masked_mean(s, mask))  # (B, C)
        return [eol(pooled(states[block - 1])) for block, eol in zip(at, eols)]  # [(B, d_l)]

    def _image_levels(self, batch: dict, states) -> list[torch.Tensor]:
        return self._levels(states, self._image_mask(batch, states[0]), self.image_at, self.image_eols)

    def image_levels(self, batch: dict) -> list[torch.Tensor]:
        return self._image_levels(batch, self._image_states(batch))

    def text_levels(self, batch: dict) -> list[torch.Tensor]:
        return self._levels(self._text_states(batch), batch["attention_mask"].bool(), self.text_at, self.text_eols)

    def encode_images(self, batch: dict) -> torch.Tensor:
        return self.image_levels(batch)[-1]  # (B, d_L)

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self.text_levels(batch)[-1]  # (B, d_L)

    def forward(self, batch: dict) -> tuple[list, list]:
        return self.image_levels(batch), self.text_levels(batch)

    # ---- training ---------------------------------------------------------------------------
    def loss(self, batch: dict) -> dict:
        """L_HRL (over config.train_levels) + lrm_weight * L_LRM on a pair batch, with every level's
        L_RL logged (rl_1, rl_2, ...) whether or not it is trained."""
        c = self.config
        image_states = self._image_states(batch)
        images = self._image_levels(batch, image_states)  # [(B, d_l)]
        texts = self.text_levels(batch)
        per_level = [contrastive_loss(batch_scores(i, t)) for i, t in zip(images, texts)]  # eq. 7
        trained = per_level if c.train_levels == "all" else per_level[-1:]
        out = {"hrl": hrl_sum(trained), **{f"rl_{l + 1}": v.detach() for l, v in enumerate(per_level)}}
        out["loss"] = out["hrl"]
        if c.lrm_weight > 0:
            if self.vmlm is None:
                raise ValueError("LRM adds the image's global state to word states: the image tower's width "
                                 f"({self.image_tower.width}) must equal hidden ({c.hidden}); set lrm_weight=0")
            ids, labels = mask_tokens(batch["input_ids"], batch["attention_mask"], self.vocab_size,
                                      c.mask_prob, special=self.special)  # (B, T) each
            words = self.text_tower({**batch, "input_ids": ids}).tokens  # (B, T, H) the last block
            out["lrm"] = self.vmlm(words, image_states[-1][:, 0], labels)  # eq. 4, + h_V0 of the last block
            out["loss"] = out["loss"] + c.lrm_weight * out["lrm"]
        return out


def hrl_sum(level_losses) -> torch.Tensor:
    """Eq. 8: L_HRL = sum_l L_RL^l, every level with weight 1."""
    return torch.stack(list(level_losses)).sum()


def hrl_loss(image_levels, text_levels) -> torch.Tensor:
    """Eq. 6-8 on one batch: the sum over levels of the bidirectional in-batch cross-entropy of
    S^l = image_levels[l] @ text_levels[l].T (B, B), positives on the diagonal."""
    if len(image_levels) != len(text_levels):
        raise ValueError(f"{len(image_levels)} image levels but {len(text_levels)} text levels")
    return hrl_sum(contrastive_loss(batch_scores(i, t)) for i, t in zip(image_levels, text_levels))


def build_hivlp(config: HiVLPConfig, split, tokenizer) -> HiVLP:
    """A fresh HiVLP for the split's image input (its region feature size) and the vocabulary."""
    region_dim = None
    if config.image_input == "regions":
        if not split.has_regions:
            raise ValueError(f"split {split.name!r} has no region features: use image_input='pixels'")
        region_dim = split.regions.shape[-1]
    elif not split.has_pixels:
        raise ValueError(f"split {split.name!r} has no pixels: use image_input='regions' or give read_karpathy "
                         "an image_root")
    return HiVLP(config, len(tokenizer), region_dim, special=SpecialTokens.of(tokenizer))


__all__ = ["HiVLPConfig", "HiVLP", "EarlyOutput", "ViTTower", "StemGridTower", "RegionTower", "stem_config",
           "grid_boxes", "level_layers", "hrl_loss", "hrl_sum", "build_hivlp", "IMAGE_INPUTS", "STEMS", "TRAIN_LEVELS", "POOLS"]
