"""Thinking Fast and Slow (Miech et al. 2021): the Slow captioning scorer and the Fast dual encoder.

    Slow   phi(x): a small CNN over the pixels; its coarse map is upsampled step by step, each a
           weighted fusion of the upsampled map and a 1x1 lateral of the earlier, finer map
           (BiFPN's fast normalised fusion: ReLU'd weights, / (sum + 1e-4)), then a 3x3 conv
           (§3.1, App. D) -> visual tokens (B, M, H). No self-attention over them.
           A forward and a backward decoder (masked self-attention, cross-attention to phi(x),
           FFN) share the word / position embeddings and the output layer (VirTex);
           h(x, y) = h_fwd + h_bwd, the summed log-likelihood of the caption's words read left to
           right and right to left, teacher-forced, not length-normalised (eq. 1-3).
    Fast   f(x) = Linear(4x4 map); g(y) = MLP(text tower); f(x)^T g(y), no norm / temperature (§3.2)

Our choices where the paper is silent or is about 224-pixel photos:
- 3 conv stages on 32x32 pixels (not ResNet-50), starting from the pixel stem; the 4x4 map is
  upsampled to `visual_size`. Tokens get a learned 2-D position and a LayerNorm: our captions name
  left / right / top / bottom.
- h sums the words only: targets w1 .. wL of [CLS] w1 .. wL [SEP] (eq. 3); the backward decoder
  reads [CLS] wL .. w1 [SEP] (`reverse_words`).
- Fast has its own CNN and flattens its 4x4 map (the paper's mean pool: image_pool="mean"): our
  captions are about where two small objects are. Its text tower is a bi-GRU, not the paper's
  "NCE BoW" (text_tower="bow"): word order binds colour to shape (course_lib.studies.text_ceiling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import RegionEmbedding, masked_mean
from course_lib.core.encoders import BagOfWordsEncoder, BiGRUEncoder, TransformerTextEncoder
from course_lib.core.settings import CourseConfig
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.data.datasets import IMAGE_KEYS
from course_lib.methods.fast_slow.decoder import Decoder, reverse_words, summed_log_likelihood
from course_lib.methods.pixel_stem import HEAD_POOLS, ConvBackbone, StemBackboneModule, conv_bn_relu

FUSION_EPS = 1e-4  # BiFPN's epsilon in the normalised fusion (the paper's App. D)


@dataclass
class SlowConfig(CourseConfig):
    """Defaults chosen in docs/tuning_notes.md, "Fast & Slow, Slow"."""

    channels: tuple = (24, 48, 96)  # CNN widths of the 16x16, 8x8 and 4x4 (coarse) stages
    visual_size: int = 8  # side of the upsampled token map: 4 (no upsampling), 8 or 16 tokens
    hidden: int = 64  # width of the visual tokens and of both decoders (paper: 512)
    layers: int = 2  # blocks in each decoder (paper: 3)
    heads: int = 4  # attention heads (paper: 8)
    dropout: float = 0.1  # on the embeddings and inside the decoder blocks
    max_text_length: int = 40  # token positions of the decoders ([CLS] and [SEP] included)
    batch_size: int = 64  # (image, caption) positive pairs per step: the loss needs no negatives
    lr: float = 2e-3  # peak AdamW rate (paper: Adam 4e-4 on far bigger models)
    max_steps: int = 2000  # optimizer steps
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm (paper: 100)
    seed: int = 0  # model initialisation and data order
    image_init: str = "pixel_stem"  # phi(x)'s CNN from the cached "pixel_stem" or "scratch"
    stem_steps: int = 400  # the pixel stem's pre-training steps (PixelStemConfig.max_steps; cached)
    stem_head_pool: str = "cells"  # how the stem's heads read its map (PixelStemConfig.head_pool)
    image_input: str = "pixels"  # "pixels" (the CNN above) or "regions" (a pretrained CNN's grid)

    SMOKE: ClassVar[dict] = {"max_steps": 30, "batch_size": 16, "hidden": 32,
                             "channels": (8, 16, 32), "stem_steps": 20}
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 300, "batch_size": 64}  # chosen on Flickr8k's val

    def __post_init__(self):
        self.channels = tuple(int(c) for c in self.channels)
        if len(self.channels) != 3 or self.visual_size not in (4, 8, 16):
            raise ValueError("channels must be 3 widths and visual_size 4, 8 or 16, got "
                             f"{self.channels} and {self.visual_size}")
        check_image_fields(self)


@dataclass
class FastConfig(CourseConfig):
    """Defaults chosen in docs/tuning_notes.md, "Fast & Slow, Fast" and "..., distillation"."""

    channels: tuple = (24, 48, 96)  # CNN widths of the image tower's three stages
    image_pool: str = "flatten"  # f(x) reads the 4x4 map by "mean" (the paper's pool) or "flatten"
    text_tower: str = "gru"  # g(y): "bow" (the paper's), "transformer" (Table 7) or "gru" (ours)
    text_layers: int = 1  # transformer blocks (4 heads) or GRU layers of the text tower
    image_init: str = "pixel_stem"  # the image CNN from the cached "pixel_stem" or "scratch"
    stem_steps: int = 400  # pixel_stem pre-training steps (PixelStemConfig.max_steps)
    stem_head_pool: str = "cells"  # how the stem's heads read its 4x4 map (PixelStemConfig)
    freeze_stem: bool = False  # image_init="pixel_stem": keep its CNN (and BatchNorm) as it is
    hidden: int = 128  # word-embedding width of the text tower (the other dual encoders')
    embed_dim: int = 256  # the joint space of f(x) and g(y) (the other dual encoders')
    distill: bool = False  # True: eq. 4, then distill_steps of eq. 8 (method.py); False: eq. 4
    tau: float = 10.0  # eq. 5-6 temperature of both softmaxes (App. B)
    alpha: float = 1.0  # weight of L_DE (eq. 4) in eq. 8
    batch_size: int = 256  # pairs per step (eq. 4's in-batch negatives; the other dual encoders')
    distill_batch_size: int = 16  # captions the teacher scores a step ("batch": B^2 pairs)
    distill_steps: int = 500  # optimizer steps of eq. 8 after eq. 4's
    distill_lr: float = 5e-4  # peak AdamW rate of the distillation steps
    distill_start: str = "fast"  # eq. 8 from "fast" or "scratch"
    distill_candidates: str = "mined"  # eq. 5-6's images: the "batch" (the paper's) or "mined"
    distill_top_k: int = 16  # "mined": images per caption, own included
    lr: float = 1e-3  # peak AdamW learning rate (the other dual encoders')
    max_steps: int = 4000  # optimizer steps of eq. 4
    fresh_scenes: int = 40_000  # generator scenes beside the training split's, for eq. 4 and 8
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm
    seed: int = 0  # model initialisation and data order
    image_input: str = "pixels"  # "pixels" or "regions" (grid cells, mean-pooled)

    SMOKE: ClassVar[dict] = {"max_steps": 30, "batch_size": 16, "distill_batch_size": 8,
                             "distill_steps": 20, "hidden": 32, "embed_dim": 32,
                             "channels": (8, 16, 32), "stem_steps": 20, "fresh_scenes": 100}
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 300, "batch_size": 128,  # chosen on Flickr8k's val
                                   "distill_steps": 150}

    def __post_init__(self):
        self.channels = tuple(int(c) for c in self.channels)
        self.check_choices(image_pool=("mean", "flatten"), text_tower=("bow", "transformer", "gru"),
                           distill_candidates=("batch", "mined"), distill_start=("fast", "scratch"))
        check_image_fields(self)
        if self.distill_top_k < 2 or self.fresh_scenes < 0 or not self.tau > 0 or self.alpha < 0:
            raise ValueError("need distill_top_k >= 2, fresh_scenes >= 0 (0: the training split "
                             f"alone), tau > 0 and alpha >= 0, got {self.distill_top_k}, "
                             f"{self.fresh_scenes}, {self.tau} and {self.alpha}")


def check_image_fields(config) -> None:
    """Both configs' image fields; grid cells (a pretrained CNN's) take no stem and f(x)'s mean."""
    config.check_choices(image_init=("pixel_stem", "scratch"), stem_head_pool=HEAD_POOLS,
                         image_input=("pixels", "regions"))
    if config.image_input == "regions" and config.image_init != "scratch":
        raise ValueError("image_input='regions' reads a pretrained CNN's grid cells, so no pixel "
                         "stem: set image_init='scratch'")
    if config.image_input == "regions" and getattr(config, "image_pool", "mean") != "mean":
        raise ValueError("image_input='regions' mean-pools the grid cells (the paper's global "
                         "pool): set image_pool='mean'")


# ----------------------------------------------------------------------------- visual encoders
class WeightedFusion(nn.Module):
    """BiFPN's fast normalised fusion (App. D), w = ReLU(learned), coarse (B, H, h, w), lateral (B,
    C, 2h, 2w) -> Conv3x3((w0 * up2(coarse) + w1 * Conv1x1(lateral)) / (w0 + w1 + eps))."""

    def __init__(self, lateral_channels: int, hidden: int, eps: float = FUSION_EPS):
        super().__init__()
        self.lateral = nn.Conv2d(lateral_channels, hidden, 1)
        self.weights, self.eps = nn.Parameter(torch.ones(2)), eps  # (upsampled coarse, lateral)
        self.conv = conv_bn_relu(hidden, hidden)

    def forward(self, coarse: torch.Tensor, lateral: torch.Tensor) -> torch.Tensor:
        w = F.relu(self.weights)  # (2,) non-negative
        up = F.interpolate(coarse, scale_factor=2, mode="nearest")  # (B, H, 2h, 2w)
        return self.conv((w[0] * up + w[1] * self.lateral(lateral)) / (w.sum() + self.eps))


class VisualTokens(nn.Module):
    """phi(x): the 4x4 map fused up to visual_size, + position, LayerNorm -> (B, M, H)."""

    def __init__(self, channels, hidden: int, visual_size: int = 8):
        super().__init__()
        self.backbone = ConvBackbone(channels)
        self.coarse = nn.Conv2d(channels[2], hidden, 1)
        steps = {4: 0, 8: 1, 16: 2}[visual_size]
        self.fusions = nn.ModuleList(WeightedFusion(channels[1 - i], hidden) for i in range(steps))
        self.position = nn.Parameter(torch.randn(visual_size ** 2, hidden) * 0.02)  # (M, H)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        maps = self.backbone(pixels)  # 16x16, 8x8, 4x4
        x = self.coarse(maps[2])  # (B, H, 4, 4)
        for i, fusion in enumerate(self.fusions):
            x = fusion(x, maps[1 - i])  # 8x8, then 16x16
        return self.norm(x.flatten(2).transpose(1, 2) + self.position)  # (B, M, H), row-major


class RegionTokens(nn.Module):
    """phi(x) over a pretrained CNN's grid cells, embedded with their boxes -> (B, R, H)."""

    def __init__(self, region_dim: int, hidden: int):
        super().__init__()
        self.embed = RegionEmbedding(region_dim, hidden)

    def forward(self, regions: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        return self.embed(regions, boxes)  # (B, R, H)


def image_inputs(model: nn.Module, batch: dict) -> dict:
    """The fields of `batch` that the model's image side reads (its `modality`'s)."""
    return {k: batch[k] for k in (("pixels",) if model.modality == "pixels" else IMAGE_KEYS)}


def checked_region_dim(config, region_dim: int | None) -> int | None:
    if config.image_input == "regions" and region_dim is None:
        raise ValueError("image_input='regions' needs region_dim, the split's region feature size "
                         "(split.regions.shape[-1])")
    return region_dim


class SlowModel(nn.Module):
    """The Slow scorer: visual_tokens -> (B, M, H); keys_values -> {"fwd", "bwd"}: per decoder a
    list of (2, B, h, M, d); log_likelihood(kvs, texts) -> h (B,) of aligned pairs."""

    def __init__(self, vocab_size: int, config: SlowConfig | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS, region_dim: int | None = None):
        super().__init__()
        c = self.config = config or SlowConfig()
        self.special, self.modality = special, c.image_input
        if c.image_input == "pixels":
            self.visual = VisualTokens(c.channels, c.hidden, c.visual_size)
        else:
            self.visual = RegionTokens(checked_region_dim(c, region_dim), c.hidden)
        # shared by both directions (VirTex): the word and position tables and the output layer
        self.word = nn.Embedding(vocab_size, c.hidden, padding_idx=special.pad)
        self.position = nn.Embedding(c.max_text_length, c.hidden)
        self.embed_norm, self.dropout = nn.LayerNorm(c.hidden), nn.Dropout(c.dropout)
        self.forward_decoder = Decoder(c.hidden, c.layers, c.heads, c.dropout)
        self.backward_decoder = Decoder(c.hidden, c.layers, c.heads, c.dropout)
        self.output = nn.Linear(c.hidden, vocab_size)
        for table in (self.word, self.position):
            nn.init.normal_(table.weight, std=0.02)
        with torch.no_grad():
            self.word.weight[special.pad].zero_()

    def visual_tokens(self, images: dict) -> torch.Tensor:
        if self.modality == "pixels":
            return self.visual(images["pixels"])  # (B, M, H)
        return self.visual(images["regions"], images["boxes"])  # (B, R, H)

    def keys_values(self, tokens: torch.Tensor) -> dict:
        return {"fwd": self.forward_decoder.keys_values(tokens),
                "bwd": self.backward_decoder.keys_values(tokens)}

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        if T > self.config.max_text_length:
            raise ValueError(f"captions of {T} tokens exceed "
                             f"max_text_length={self.config.max_text_length}")
        return self.dropout(self.embed_norm(self.word(ids) + self.position.weight[:T]))  # (B, T, H)

    def logits(self, kvs: dict, texts: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(forward logits, backward logits (B, T, V), reversed_ids (B, T)) of aligned pairs."""
        ids, mask = texts["input_ids"], texts["attention_mask"]
        reversed_ids = reverse_words(ids, mask)
        forward = self.output(self.forward_decoder(self._embed(ids), kvs["fwd"]))
        backward = self.output(self.backward_decoder(self._embed(reversed_ids), kvs["bwd"]))
        return forward, backward, reversed_ids

    def log_likelihood(self, kvs: dict, texts: dict) -> torch.Tensor:
        """h(x, y) (B,) of B aligned pairs from the images' keys / values (eq. 2)."""
        forward, backward, reversed_ids = self.logits(kvs, texts)
        return summed_log_likelihood(forward, backward, texts["input_ids"], reversed_ids,
                                     texts["attention_mask"], self.special)

    def score(self, images: dict, texts: dict) -> torch.Tensor:
        """h (B,) of B aligned pairs from pixels: the uncached path."""
        return self.log_likelihood(self.keys_values(self.visual_tokens(images)), texts)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.score(batch, batch)  # (B,) h of a PairCollate batch


# ----------------------------------------------------------------------------- the Fast model
def fast_text_tower(vocab_size: int, config: FastConfig,
                    special: SpecialTokens = WORD_SPECIAL_TOKENS):
    """g(y)'s (tower: pooled (B, hidden), MLP projection to (B, embed_dim))."""
    c, H = config, config.hidden
    if c.text_tower == "bow":
        tower = BagOfWordsEncoder(vocab_size, H, special)
    elif c.text_tower == "gru":
        tower = BiGRUEncoder(vocab_size, H, H, c.text_layers, special=special)
    else:
        tower = TransformerTextEncoder(vocab_size, H, c.text_layers, heads=4, special=special)
    return tower, nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, c.embed_dim))


class FastModel(StemBackboneModule):
    """f(x) (B, E) = Linear(4x4 map), g(y) (B, E) = MLP(text tower); unnormalised (tau = 10)."""

    def __init__(self, vocab_size: int, config: FastConfig | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS, region_dim: int | None = None):
        super().__init__()
        c = self.config = config or FastConfig()
        self.modality = c.image_input
        if c.image_input == "pixels":
            self.backbone = ConvBackbone(c.channels)
            self.freeze_backbone()
            cells = 1 if c.image_pool == "mean" else 16  # the 4x4 map of 32-pixel images
            self.image_proj = nn.Linear(c.channels[2] * cells, c.embed_dim)
        else:  # the grid's mean, as the paper pools conv5
            self.image_proj = nn.Linear(checked_region_dim(c, region_dim), c.embed_dim)
        self.text, self.text_proj = fast_text_tower(vocab_size, c, special)

    @property
    def frozen_backbone(self) -> bool:
        """Whether the CNN is the pixel stem's, kept as it is (config.freeze_stem)."""
        return self.config.image_init == "pixel_stem" and self.config.freeze_stem

    def encode_images(self, batch: dict) -> torch.Tensor:
        if self.modality == "regions":
            return self.image_proj(masked_mean(batch["regions"], batch["region_mask"]))  # (B, E)
        grid = self.backbone(batch["pixels"])[2]  # (B, C, 4, 4)
        pooled = grid.mean((2, 3)) if self.config.image_pool == "mean" else grid.flatten(1)
        return self.image_proj(pooled)  # (B, C) or (B, 16C) -> (B, E)

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self.text_proj(self.text(batch).pooled)  # (B, E)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_images(batch), self.encode_texts(batch)
