"""How far can a text tower take a dot product when the image side is perfect? f(x) is a Linear
of the scene's bag-of-objects vector, g(y) Fast's own text tower trained as Fast is: no pixel model
with the same text tower can expect more."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn as nn

from course_lib.core.settings import seed_everything
from course_lib.core.tokens import SpecialTokens
from course_lib.data.bag_of_objects import image_vectors
from course_lib.data.synthetic import with_fresh_scenes
from course_lib.methods.base import fit_pairs
from course_lib.methods.encoding import learning_curve_splits, retrieval_evaluator, similarity
from course_lib.methods.fast_slow.method import nce_loss
from course_lib.methods.fast_slow.model import FastConfig, fast_text_tower


def with_bag_of_objects(split):
    """The split with each image's bag-of-objects vector as its one region (N, 1, D)."""
    if split.scenes is None:
        raise ValueError(f"split {split.name!r} has no scenes: the bag of objects exists for the "
                         "synthetic benchmark only")
    vectors = image_vectors(split.scenes)  # (N, D)
    n = len(vectors)
    return dataclasses.replace(split, regions=vectors[:, None, :],
                               boxes=np.zeros((n, 1, 7), np.float32),
                               region_mask=np.ones((n, 1), bool), region_classes=None)


class BagOfObjectsDualEncoder(nn.Module):
    """f(x) = Linear(bag-of-objects vector), g(y) = Fast's text tower: (B, E) each, as Fast."""

    modality = "regions"

    def __init__(self, vocab_size: int, width: int, config: FastConfig, special: SpecialTokens):
        super().__init__()
        self.config = config
        self.image_proj = nn.Linear(width, config.embed_dim)
        self.text, self.text_proj = fast_text_tower(vocab_size, config, special)

    def encode_images(self, batch: dict) -> torch.Tensor:
        return self.image_proj(batch["regions"][:, 0])  # (B, E)

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self.text_proj(self.text(batch).pooled)  # (B, E)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_images(batch), self.encode_texts(batch)


def train_text_ceiling(bench: dict, tokenizer, config: FastConfig | None = None, *,
                       eval_every: int | None = None, progress: bool = True):
    """Fast's text tower trained as Fast against the perfect image vector: (model, history)."""
    c = config or FastConfig()
    seed_everything(c.seed)
    train = with_bag_of_objects(with_fresh_scenes(bench["train"], c.fresh_scenes))
    curve = {name: with_bag_of_objects(split)
             for name, split in learning_curve_splits(bench).items()}
    model = BagOfObjectsDualEncoder(len(tokenizer), train.regions.shape[-1], c,
                                    SpecialTokens.of(tokenizer))
    evaluate = retrieval_evaluator(curve, lambda m, split: similarity(m, split, tokenizer))
    history = fit_pairs(model, nce_loss, train, tokenizer, c, modality="regions", evaluate=evaluate,
                        eval_every=eval_every, log_every=25, progress=progress)
    return model.eval(), history
