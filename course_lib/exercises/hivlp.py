"""Checker of lesson 05: HiVLP's hierarchical retrieval loss (eq. 6-8)."""

import torch
import torch.nn.functional as F

from course_lib.core.losses import contrastive_loss
from course_lib.methods.hivlp.model import hrl_loss

from .errors import NO_GRADIENT_NOTE, check_answer, scalar_answer


def _hrl_cases(seed: int = 0):
    """(label, image levels, text levels): [(B, d_l)] per level, widths growing, raw vectors."""
    generator = torch.Generator().manual_seed(seed)

    def levels(B, widths, scale=1.0):
        return [scale * torch.randn(B, w, generator=generator, dtype=torch.float64) for w in widths]

    yield "a batch of 6, widths 2/4/8", levels(6, (2, 4, 8)), levels(6, (2, 4, 8))
    yield ("a batch of 5, widths 3/3/5 (large scores)", levels(5, (3, 3, 5), 3.0),
           levels(5, (3, 3, 5), 3.0))
    yield "a batch of 4, two levels", levels(4, (2, 6)), levels(4, (2, 6))
    yield "a batch of 1, one level", levels(1, (4,)), levels(1, (4,))


def _hrl_mistakes(images, texts) -> list:
    """(loss, what to tell the learner) of the usual wrong versions of eq. 6-8."""
    levels = list(zip(images, texts, strict=True))  # [(image (B, d_l), text (B, d_l))] per level
    per_level = [contrastive_loss(i @ t.T) for i, t in levels]
    target = torch.arange(len(images[0]))
    t2i = [F.cross_entropy((i @ t.T).T, target) for i, t in levels]  # CE over images per text
    i2t = [F.cross_entropy(i @ t.T, target) for i, t in levels]  # CE over texts per image
    cosine = [contrastive_loss(F.normalize(i, dim=-1) @ F.normalize(t, dim=-1).T)
              for i, t in levels]
    one_way = "only one direction is there, {}; eq. 7 averages it with {}"
    return [
        (sum(per_level) / len(per_level), "you averaged the levels; eq. 8 sums them, each with "
                                          "weight 1"),
        (per_level[-1], "only the last level is there: eq. 8 sums L_RL over every level"),
        (per_level[0], "only the first level is there: eq. 8 sums L_RL over every level"),
        (sum(2 * v for v in per_level), "each level's two cross-entropies were added without the "
                                        "1/2 of eq. 7"),
        (sum(t2i), one_way.format("text-to-image (eq. 6)", "image-to-text")),
        (sum(i2t), one_way.format("image-to-text", "text-to-image (eq. 6)")),
        (sum(v / 2 for v in t2i), "only one direction is there (text-to-image, halved): eq. 7 "
                                  "is the mean of both directions"),
        (sum(v / 2 for v in i2t), "only one direction is there (image-to-text, halved): eq. 7 "
                                  "is the mean of both directions"),
        (sum(cosine), "you normalised the vectors: S^l (eq. 5) is a raw inner product, no "
                      "cosine, no temperature"),
    ]


def check_hrl_loss(fn) -> None:
    """fn(image_levels, text_levels) -> L_HRL (eq. 8), a scalar; levels [(B, d_l)], pairs by row."""
    plain_number = False
    for label, images, texts in _hrl_cases():
        expected = float(hrl_loss(images, texts))
        got = fn([x.clone().requires_grad_(True) for x in images], [x.clone() for x in texts])
        value, trainable = scalar_answer(got, label, "sum the levels' losses into one scalar",
                                         "level vectors")
        plain_number |= not trainable
        check_answer(value, expected, label, "expected {expected:.6f}, got {got:.6f}; L_HRL = sum "
                     "over levels of (CE over images per text + CE over texts per image) / 2 on "
                     "S^l = image_l @ text_l.T", _hrl_mistakes, images, texts, tol=1e-5)
    print("HRL loss: correct (1 to 3 levels, batches of 1 to 6, raw inner products)" +
          (f" {NO_GRADIENT_NOTE}" if plain_number else ""))
