"""The linear probe: the baseline every real-photo row is read against. Both backbones stay frozen:
an image is the mean of a pretrained CNN's grid cells, a caption the mean of a pretrained BERT's
last states (MiniLM's sentence vector); one linear map a side projects each into a joint space
scored by cosine at a learned temperature (CLIP's), trained with in-batch InfoNCE, the best val
point kept. What a method learns beyond frozen features is its gain over this.

    tokenizer = tokenizer_for(bench["train"], name=pretrained_text_path(MINILM_NAME))
    probe = LinearProbeMethod().fit(bench, tokenizer)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from course_lib.core.blocks import masked_mean
from course_lib.core.encoders import BertTextEncoder, l2_normalize
from course_lib.core.history import History
from course_lib.core.losses import contrastive_loss
from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path
from course_lib.core.settings import CourseConfig, seed_everything
from course_lib.methods.base import DualEncoderMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator, similarity

INITIAL_TEMPERATURE = 0.07  # CLIP's: the logit scale starts at 1 / 0.07
MAX_LOGIT_SCALE = 100.0  # CLIP's clamp


@dataclass
class LinearProbeConfig(CourseConfig):
    text_encoder: str = MINILM_NAME  # the pretrained BERT (name or folder) read frozen: mean state
    embed_dim: int = 512  # width of the joint space each linear map projects to
    batch_size: int = 128  # pairs per step: the in-batch negatives of InfoNCE
    lr: float = 1e-3  # peak AdamW rate of the two maps and the temperature
    max_steps: int = 300  # optimizer steps (at 128: ~1.3 epochs of Flickr8k's 30,000 captions)
    warmup_fraction: float = 0.1  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm
    keep_best: str = "val_t2i_r1"  # the weights of the best val point are the ones kept (Trainer)
    seed: int = 0  # initialisation and data order

    SMOKE: ClassVar[dict] = {"max_steps": 10, "batch_size": 16, "embed_dim": 32}


class LinearProbe(nn.Module):
    """Unit vectors (B, E) of Linear(mean of regions) and Linear(mean of frozen BERT states)."""

    modality = "regions"

    def __init__(self, config: LinearProbeConfig, vocab_size: int, region_dim: int):
        super().__init__()
        self.config = config
        bert = pretrained_text_path(config.text_encoder)
        self.text_encoder = BertTextEncoder(vocab_size, pretrained_name=bert).freeze()
        self.image_proj = nn.Linear(region_dim, config.embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.out_dim, config.embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / INITIAL_TEMPERATURE)))

    def encode_images(self, batch: dict) -> torch.Tensor:
        pooled = masked_mean(batch["regions"], batch["region_mask"])  # (B, D)
        return l2_normalize(self.image_proj(pooled))  # (B, E)

    def encode_texts(self, batch: dict) -> torch.Tensor:
        out = self.text_encoder(batch)  # tokens (B, T, H), zero at padding
        mean = masked_mean(out.tokens, out.mask)  # (B, H)
        return l2_normalize(self.text_proj(mean))  # (B, E)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_images(batch), self.encode_texts(batch)


def probe_loss(model: LinearProbe, batch: dict, step: int = 0) -> dict:
    """CMR on the batch's (B, B) cosines times the learned scale (clamped at CLIP's 100)."""
    images, texts = model(batch)  # (B, E) each
    scale = model.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
    return {"loss": contrastive_loss(scale * images @ texts.T), "scale": scale.detach()}


def build_linear_probe(config: LinearProbeConfig, train_split, tokenizer) -> LinearProbe:
    """A fresh probe sized for the split's region features and the tokenizer."""
    if not train_split.has_regions:
        raise ValueError(f"split {train_split.name!r} has no region features: the probe reads a "
                         "pretrained CNN's grid (course_lib.data.features.load_feature_bench)")
    return LinearProbe(config, len(tokenizer), train_split.regions.shape[-1])


class LinearProbeMethod(DualEncoderMethod):
    """The linear probe as a benchmark Method (a dual encoder)."""

    checkpoint_prefix = "linear-probe"
    config_class = LinearProbeConfig

    @property
    def notes(self) -> str:
        c = self.config
        return (f"frozen features: mean grid cell / mean {c.text_encoder} state, one "
                f"{c.embed_dim}-d linear map a side, InfoNCE, best val point kept; "
                "FAISS IndexFlatIP")

    def build_model(self, bench: dict, tokenizer) -> LinearProbe:
        return build_linear_probe(self.config, bench["train"], tokenizer)

    def train(self, bench: dict, tokenizer, checkpoint_path,
              cache_dir) -> tuple[LinearProbe, History]:
        seed_everything(self.config.seed)  # the maps' initial weights; the Trainer seeds the rest
        model = self.build_model(bench, tokenizer)
        curve = self.learning_curve(bench, self.config.max_steps)
        evaluate = retrieval_evaluator(curve.pop("evaluate_on"),
                                       lambda m, split: similarity(m, split, tokenizer))
        history = fit_pairs(model, probe_loss, bench["train"], tokenizer, self.config,
                            evaluate=evaluate, log_every=10, progress=self.progress,
                            checkpoint_path=checkpoint_path, **curve)
        return model.eval(), history
