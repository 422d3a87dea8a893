"""LightningDOT (Sun et al., NAACL 2021): two transformer encoders, a dot product, three objectives.
An image encoder f_V reads detector regions + boxes behind a [CLS] slot, a language encoder f_L
reads [CLS] words [SEP]; their [CLS] outputs h0 and z0 are the global representations:

    S(t, i) = <z0, h0>                                  (eq. 5: no cross-attention anywhere)

so the gallery is encoded once, offline, into a FAISS index. The other modality reaches each encoder
only through the training objectives (§3.1):

    VMLM    (eq. 2)  mask 15% of the words (80% [MASK] / 10% random / 10% kept), predict each from
                     z_mk + h0: the paired image's [CLS] is *added* to the word's state
    SMRM    (eq. 4)  mask 15% of the regions (features zeroed, boxes kept), and from h_mk + z0
                     SMRFR: regress the region feature through an MLP (squared L2)
                     SMRC-kl: predict the detector's soft class distribution (KL divergence)
    CMR     (eq. 6)  course_lib.core.losses.contrastive_loss on the in-batch scores S (B, B)

`fuse=False` drops the added [CLS]: UNITER-style MLM / MRM, Table 4's "+PT†" row (the authors' code
fuses only behind a flag, off by default; we follow the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.core.encoders import (
    RegionTransformerEncoder,
    TransformerTextEncoder,
    pretrained_bert,
)
from course_lib.core.losses import (
    VMLM,
    batch_scores,
    contrastive_loss,
    fuse_cls,
    mask_tokens,
    prediction_head,
)
from course_lib.core.optimizer import pretrained_lr_scales
from course_lib.core.settings import CourseConfig
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens

OBJECTIVES = ("cmr", "vmlm", "smrfr", "smrc_kl")


@dataclass
class LightningDOTConfig(CourseConfig):
    # Defaults chosen in docs/tuning_notes.md, "LightningDOT".
    hidden: int = 128  # width of both encoders; h0 and z0 live here (no projection, no L2)
    layers: int = 2  # transformer blocks per encoder (the paper: 12)
    heads: int = 4  # attention heads per block
    max_text_length: int = 40  # tokens per caption, [CLS] and [SEP] included
    text_encoder: str | None = None  # a BERT (name or folder) to start from; None: from scratch
    # the pretrained text_encoder's rate as a multiple of each stage's; None = one rate
    text_encoder_lr_scale: float | None = None
    fuse: bool = True  # VMLM / SMRM add the other side's [CLS]; False = plain MLM / MRM (Table 4)
    mask_prob: float = 0.15  # share of words / regions masked (BERT, UNITER)
    # objective -> share of pre-training batches, one per batch (UNITER's scheme; ours, untuned)
    pretrain_tasks: dict = field(
        default_factory=lambda: {"cmr": 2, "vmlm": 2, "smrfr": 1, "smrc_kl": 1})
    pretrain_steps: int = 2000  # optimizer steps on the pre-training corpus; 0 = no pre-training
    pretrain_lr: float = 1e-3  # peak AdamW rate while pre-training (the paper's 5e-5: BERT-base)
    finetune_steps: int = 4000  # CMR steps on train (~20 epochs)
    finetune_lr: float = 1e-3  # peak AdamW rate while fine-tuning
    batch_size: int = 256  # (image, caption) pairs per batch: the in-batch negatives of CMR
    warmup_fraction: float = 0.1  # linear warm-up over the first 10% of steps, then decay (A.1)
    grad_clip: float = 2.0  # max gradient norm
    seed: int = 0  # weights, masking and data order

    SMOKE: ClassVar[dict] = {"pretrain_steps": 30, "finetune_steps": 30, "batch_size": 64}
    # the real-photo preset (CourseConfig.REAL_PHOTOS), chosen on Flickr8k's val
    REAL_PHOTOS: ClassVar[dict] = {"finetune_steps": 450, "finetune_lr": 3e-4, "batch_size": 128}

    def __post_init__(self):
        self.lr_scales()  # a scale without a pretrained text encoder is refused here
        unknown = set(self.pretrain_tasks) - set(OBJECTIVES)
        if unknown or not self.pretrain_tasks or min(self.pretrain_tasks.values()) < 0:
            raise ValueError(f"pretrain_tasks must map some of {OBJECTIVES} to non-negative "
                             f"ratios, got {self.pretrain_tasks}")

    def lr_scales(self) -> dict | None:
        """TrainConfig.lr_scales of every stage: the pretrained text encoder's scaled rate."""
        return pretrained_lr_scales("text_encoder.", self.text_encoder_lr_scale, self.text_encoder,
                                    "LightningDOTConfig")


# ----------------------------------------------------------------------------- masking
def mask_regions(region_mask: torch.Tensor, mask_prob: float = 0.15,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, R) bool: the real regions to mask, each with probability mask_prob, one at least."""
    real = region_mask.bool()
    picked = real & (torch.rand(real.shape, generator=generator, device=real.device) < mask_prob)
    none = real.any(1) & ~picked.any(1)
    if none.any():
        noise = torch.rand(real.shape, generator=generator, device=real.device)
        forced = torch.where(real, noise, torch.full_like(noise, -1.0)).argmax(1)
        picked[none, forced[none]] = True
    return picked


# ----------------------------------------------------------------------------- objectives
class SMRFR(nn.Module):
    """Eq. 4 with D_fr: 1/M sum_k ||v_mk - g_fr(h_mk + z0)||^2; features (B, R, D) unmasked."""

    def __init__(self, hidden: int, region_dim: int, fuse: bool = True):
        super().__init__()
        self.head, self.fuse = prediction_head(hidden, region_dim), fuse

    def forward(self, region_states, text_cls, features, masked) -> torch.Tensor:
        predicted = self.head(fuse_cls(region_states, text_cls, self.fuse)[masked])  # (M, D)
        return (predicted - features[masked]).pow(2).sum(-1).mean()


class SMRCKL(nn.Module):
    """Eq. 4 with D_mrc: 1/M sum_k KL(c(v_mk) || g_mrc(h_mk + z0)), soft labels c (B, R, C)."""

    def __init__(self, hidden: int, n_classes: int, fuse: bool = True):
        super().__init__()
        self.head, self.fuse = prediction_head(hidden, n_classes), fuse

    def forward(self, region_states, text_cls, soft_labels, masked) -> torch.Tensor:
        logits = self.head(fuse_cls(region_states, text_cls, self.fuse)[masked])  # (M, C)
        p = soft_labels[masked]  # (M, C)
        # sum p (log p - log q), 0 log 0 = 0
        return F.kl_div(F.log_softmax(logits, -1), p, reduction="none").sum(-1).mean()


# ----------------------------------------------------------------------------- the model
class LightningDOT(nn.Module):
    """Image and language encoders + pre-training heads: encode_images -> h0 (B, H), encode_texts ->
    z0 (B, H). `special`: the tokenizer's ids, for VMLM's masking and the text padding."""

    modality = "regions"

    def __init__(self, config: LightningDOTConfig, vocab_size: int, region_dim: int,
                 n_classes: int, special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        c = self.config = config
        self.vocab_size, self.special = vocab_size, special  # plain attributes: not in state_dict
        self.image_encoder = RegionTransformerEncoder(region_dim, c.hidden, c.layers, c.heads)
        if c.text_encoder is None:  # the course's shared block on both sides; BERT-shaped, pre-LN
            self.text_encoder = TransformerTextEncoder(vocab_size, c.hidden, c.layers, c.heads,
                                                       max_length=max(64, c.max_text_length),
                                                       special=special)
        else:
            self.text_encoder = pretrained_bert(
                c.text_encoder, vocab_size, c.hidden, "LightningDOTConfig",
                "the width of h0 and z0 (LightningDOT scores them by a plain dot product)", special)
        self.vmlm = VMLM(c.hidden, vocab_size, c.fuse)
        self.smrfr = SMRFR(c.hidden, region_dim, c.fuse)
        self.smrc_kl = SMRCKL(c.hidden, n_classes, c.fuse)

    def encode_images(self, batch: dict) -> torch.Tensor:
        return self.image_encoder(batch).pooled  # h0 (B, H): raw, LightningDOT does not normalise

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self.text_encoder(batch).pooled  # z0 (B, H)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(h0, z0): S = batch_scores(h0, z0) (B, B), eq. 5; in-batch false negatives kept."""
        return self.encode_images(batch), self.encode_texts(batch)

    def objective(self, task: str, batch: dict) -> torch.Tensor:
        """The loss of one objective on a pair batch (masking drawn from torch's global RNG)."""
        if task == "cmr":
            return contrastive_loss(batch_scores(*self(batch)))  # eq. 6 on S (B, B)
        if task == "vmlm":
            ids, labels = mask_tokens(batch["input_ids"], batch["attention_mask"], self.vocab_size,
                                      self.config.mask_prob, special=self.special)  # (B, T) each
            words = self.text_encoder({**batch, "input_ids": ids}).tokens  # (B, T, H)
            return self.vmlm(words, self.encode_images(batch), labels)
        if task in ("smrfr", "smrc_kl"):
            masked = mask_regions(batch["region_mask"], self.config.mask_prob)  # (B, R)
            hidden = {**batch, "regions": batch["regions"].masked_fill(masked.unsqueeze(-1), 0.0)}
            regions = self.image_encoder(hidden).tokens[:, 1:]  # (B, R, H): drop the [CLS] slot
            text_cls = self.encode_texts(batch)  # (B, H)
            if task == "smrfr":
                return self.smrfr(regions, text_cls, batch["regions"], masked)
            if "region_classes" not in batch:
                raise ValueError("smrc_kl needs the detector's soft labels (split.region_classes); "
                                 "drop it from pretrain_tasks for data without them")
            return self.smrc_kl(regions, text_cls, batch["region_classes"], masked)
        raise ValueError(f"unknown objective {task!r}; valid: {OBJECTIVES}")
