"""VSE++ (Faghri et al., BMVC 2018): a dual encoder of cosine similarities, trained with a hinge
loss. An image and a text encoder (core.encoders) each end in a linear projection to one shared
space, both vectors L2-normalised:

    s(image, text) = <normalize(W_i f(image)), normalize(W_t g(text))>

`hinge_triplet_loss` over the batch's (B, B) scores: with max_violation only each query's hardest
negative counts (VSE++'s "MH" loss), else every hinge is summed.

    model, history = train_dual_encoder(bench, tokenizer, VsePPConfig())
    image_emb, text_emb = encode_split(model, bench["test"], tokenizer)  # (N, E), (T, E)

Why the sum of hinges by default: VSE++ trains a linear map over pretrained CNN features, where MH
wins. From random weights every image starts near one direction, so MH alone collapses all
embeddings onto one vector (loss 2 * B * margin), as FaceNet (Schroff et al. 2015) reports for
hardest negatives early on; neither a sum-of-hinges warm-up (VSE-infinity's, `sum_warmup_steps`) nor
masking false negatives prevents it here (docs/tuning_notes.md, "VSE++").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from course_lib.core.encoders import build_image_encoder, build_text_encoder, l2_normalize
from course_lib.core.history import History
from course_lib.core.losses import batch_scores, hinge_name, hinge_triplet_loss
from course_lib.core.settings import CourseConfig, seed_everything
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.methods.base import DualEncoderMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator, similarity
from course_lib.methods.registry import register_method

_TEXT_NAMES = {"gru": "bi-GRU", "bow": "bag-of-words", "transformer": "transformer",
               "bert": "BERT (random init)"}
_IMAGE_NAMES = {"regions": "region transformer", "pixels": "tiny ViT on pixels"}


@dataclass
class VsePPConfig(CourseConfig):
    # Defaults chosen in docs/tuning_notes.md, "VSE++".
    image_encoder: str = "regions"  # "regions" (detector features, as VSE++/SCAN), "pixels" (ViT)
    text_encoder: str = "gru"  # "gru" (VSE++'s), "bow" (mean of word vectors), "bert" (random init)
    hidden: int = 128  # width inside both encoders
    embed_dim: int = 256  # size of the joint space both projections map to
    layers: int = 2  # depth of both encoders: transformer blocks, or stacked GRU layers
    margin: float = 0.1  # hinge margin (VSE++: 0.2)
    max_violation: bool = False  # hardest negative only (VSE++'s "MH"), else the sum of all hinges
    batch_size: int = 256  # (image, caption) pairs per batch; the in-batch negatives (VSE++: 128)
    lr: float = 1e-3  # peak AdamW learning rate (VSE++'s Adam: 2e-4, fine-tuning a pretrained CNN)
    max_steps: int = 5000  # ~25 epochs of the 10k-scene train split (50k pairs); curve: notebook 01
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm (VSE++)
    sum_warmup_steps: int = 0  # with max_violation: sum all hinges for these first steps (VSE-inf)
    seed: int = 0  # model initialisation and data order

    SMOKE: ClassVar[dict] = {"max_steps": 40, "batch_size": 64}  # smoke(): tiny, same code path
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 150, "batch_size": 128}  # chosen on Flickr8k's val


class DualEncoder(nn.Module):
    """Image encoder + text encoder, each projected to embed_dim and L2-normalised (VSE++):
    encode_images / encode_texts -> (B, E) unit vectors. `modality`: the image field the datasets
    must provide; `special`: the tokenizer's special ids (SpecialTokens.of)."""

    def __init__(self, config: VsePPConfig, vocab_size: int, region_dim: int | None = None,
                 image_size: int | None = None, special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        c = self.config = config
        self.modality, image = c.image_encoder, {}  # another kind: build_image_encoder lists them
        if c.image_encoder == "regions":
            if region_dim is None:
                raise ValueError("image_encoder='regions' needs region_dim (regions.shape[-1])")
            image = dict(region_dim=region_dim, hidden=c.hidden, layers=c.layers)
        elif c.image_encoder == "pixels":  # the course's tiny ViT, sized like the region encoder
            size = {"img_size": image_size} if image_size else {}
            image = dict(embed_dim=c.hidden, depth=c.layers, **size)
        self.image_encoder = build_image_encoder(c.image_encoder, **image)
        text = {"gru": dict(embed_dim=c.hidden, layers=c.layers), "bert": dict(layers=c.layers)}
        self.text_encoder = build_text_encoder(c.text_encoder, vocab_size, special=special,
                                               hidden=c.hidden, **text.get(c.text_encoder, {}))
        self.image_proj = nn.Linear(self.image_encoder.out_dim, c.embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.out_dim, c.embed_dim)

    def encode_images(self, batch: dict) -> torch.Tensor:
        pooled = self.image_encoder(batch).pooled  # (B, H)
        return l2_normalize(self.image_proj(pooled))  # (B, E), unit norm: scores are cosines

    def encode_texts(self, batch: dict) -> torch.Tensor:
        pooled = self.text_encoder(batch).pooled  # (B, H)
        return l2_normalize(self.text_proj(pooled))  # (B, E)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(image (B, E), text (B, E)). Two captions of one image in a batch are each other's
        negatives, as in VSE++ (in 48% of batches of 128, notebook 03)."""
        return self.encode_images(batch), self.encode_texts(batch)


def vsepp_loss(margin: float = 0.2, max_violation: bool = True, sum_warmup_steps: int = 0):
    """The Trainer's loss_fn: VSE++'s hinge on batch_scores(*model(batch)). With max_violation,
    sum_warmup_steps > 0 sums every hinge for the first optimizer steps (VSE-infinity's
    `vse_mean_warmup_epochs`), then keeps the hardest negatives."""
    def loss_fn(model: nn.Module, batch: dict, step: int = 0) -> torch.Tensor:
        hardest = max_violation and not (sum_warmup_steps and step < sum_warmup_steps)
        return hinge_triplet_loss(batch_scores(*model(batch)), margin=margin, max_violation=hardest)

    return loss_fn


def build_dual_encoder(config: VsePPConfig, train_split, tokenizer) -> DualEncoder:
    """A fresh DualEncoder sized for the split's features and the tokenizer."""
    region_dim = train_split.regions.shape[-1] if train_split.has_regions else None
    image_size = train_split.images.shape[1] if train_split.images is not None else None
    return DualEncoder(config, len(tokenizer), region_dim=region_dim, image_size=image_size,
                       special=SpecialTokens.of(tokenizer))


def train_dual_encoder(bench: dict, tokenizer, config: VsePPConfig | None = None, *,
                       checkpoint_path=None, evaluate_on=None, eval_every: int | None = None,
                       progress: bool = True,
                       device: str | None = None) -> tuple[DualEncoder, History]:
    """Train a DualEncoder with the VSE++ loss (or load a finished checkpoint_path) -> (model,
    history); evaluate_on: a split logged every eval_every steps."""
    config = config or VsePPConfig()
    seed_everything(config.seed)  # the model's initial weights; the Trainer seeds the rest
    model = build_dual_encoder(config, bench["train"], tokenizer)
    evaluate = retrieval_evaluator(evaluate_on, lambda m, split: similarity(m, split, tokenizer))
    loss_fn = vsepp_loss(config.margin, config.max_violation, config.sum_warmup_steps)
    history = fit_pairs(model, loss_fn, bench["train"], tokenizer, config, modality=model.modality,
                        evaluate=evaluate, eval_every=eval_every, log_every=25, progress=progress,
                        checkpoint_path=checkpoint_path, device=device)
    return model.eval(), history


class VsePPMethod(DualEncoderMethod):
    """VSE++ as a benchmark Method."""

    checkpoint_prefix = "vsepp"
    config_class = VsePPConfig

    @property
    def notes(self) -> str:
        c = self.config
        return (f"dual encoder, {_TEXT_NAMES.get(c.text_encoder, c.text_encoder)} text / "
                f"{_IMAGE_NAMES.get(c.image_encoder, c.image_encoder)}, cosine, "
                f"{hinge_name(c.max_violation)}, FAISS IndexFlatIP")

    def build_model(self, bench: dict, tokenizer) -> DualEncoder:
        return build_dual_encoder(self.config, bench["train"], tokenizer)

    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        return train_dual_encoder(bench, tokenizer, self.config, checkpoint_path=checkpoint_path,
                                  progress=self.progress,
                                  **self.learning_curve(bench, self.config.max_steps))


register_method("vsepp", order=1.0)(lambda build: VsePPMethod(build.config(VsePPConfig)))
