"""Checkers of lessons 00 and 01: ranks from a score matrix (both directions); VSE++'s hinge."""

import numpy as np
import torch

from course_lib.core.losses import hinge_triplet_loss
from course_lib.core.metrics import retrieval_metrics, retrieval_ranks

from .errors import ExerciseError, close


def _cases(seed: int = 0):
    """Small score matrices (n_images, n_texts) with 5 captions per image, ties included."""
    rng = np.random.default_rng(seed)
    for n_images in (2, 3, 7):
        txt2img = np.repeat(np.arange(n_images), 5)
        sims = rng.normal(size=(n_images, 5 * n_images)).round(1)  # rounding makes ties
        yield sims, txt2img


def check_t2i_ranks(fn) -> None:
    """fn(sims, txt2img) -> 0-based rank of the true image for every text (length n_texts)."""
    for sims, txt2img in _cases():
        expected = retrieval_ranks(sims, txt2img)[1]
        got = np.asarray(fn(sims.copy(), txt2img.copy()))
        if got.shape != expected.shape:
            raise ExerciseError(f"expected one rank per text, shape {expected.shape}, got "
                                f"{got.shape}; text queries are the columns of sims (n_images, "
                                "n_texts)")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("every rank is one too high: either they are 1-based (the course "
                                "counts from 0, R@K = mean(rank < K)) or you count the true image "
                                "itself among those scoring at least as high; count only the "
                                "other images")
        ties = (sims == sims[txt2img, np.arange(sims.shape[1])][None, :]).sum(0) - 1  # (n_texts,)
        if ties.any() and np.array_equal(got, expected - ties):  # so got != expected
            raise ExerciseError("on ties you count only strictly higher scores; count every "
                                "*other* image scoring at least as high as the true one (the "
                                "pessimistic convention the course uses, so a model that scores "
                                "everything alike cannot look perfect)")
        if not np.array_equal(got, expected):
            bad = int(np.flatnonzero(got != expected)[0])
            raise ExerciseError(f"text {bad}: expected rank {expected[bad]}, got {got[bad]} "
                                f"(on a {sims.shape[0]}x{sims.shape[1]} matrix)")
    print("t2i ranks: correct")


def check_i2t_ranks(fn) -> None:
    """fn(sims, txt2img) -> 0-based best rank over each image's captions (length n_images)."""
    for sims, txt2img in _cases(1):
        expected = retrieval_ranks(sims, txt2img)[0]
        got = np.asarray(fn(sims.copy(), txt2img.copy()))
        if got.shape != expected.shape:
            raise ExerciseError(f"expected one rank per image, shape {expected.shape}, got "
                                f"{got.shape}")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("your ranks are 1-based; the course counts from 0 (R@K = "
                                "mean(rank < K))")
        first_caption_only = np.array([((sims[i] >= sims[i, np.flatnonzero(txt2img == i)[0]])
                                        & (txt2img != i)).sum() for i in range(sims.shape[0])])
        if np.array_equal(got, first_caption_only) and not np.array_equal(got, expected):
            raise ExerciseError("you ranked only the first caption of each image; the i2t rank is "
                                "the best (smallest) rank over all of the image's ground-truth "
                                "captions")
        if not np.array_equal(got, expected):
            bad = int(np.flatnonzero(got != expected)[0])
            raise ExerciseError(f"image {bad}: expected rank {expected[bad]}, got {got[bad]}")
    sims, txt2img = next(_cases(2))  # and the recalls they give agree with the library's
    metrics = retrieval_metrics(sims, txt2img, ks=(1, 5))
    ranks = np.asarray(fn(sims, txt2img))
    if abs(100.0 * np.mean(ranks < 1) - metrics["i2t_r1"]) > 1e-9:
        raise ExerciseError("ranks look right but the recall they give disagrees with "
                            "retrieval_metrics")
    print("i2t ranks: correct")


# ----------------------------------------------------------------------------- lesson 01

def _hinge_directions(scores, margin: float, max_violation: bool):
    """VSE++'s loss per direction, and the sum of hinges with the diagonal left in (mistakes)."""
    positives = scores.diagonal().view(-1, 1)  # (B, 1)
    cost_text = (margin + scores - positives).clamp(min=0)  # (B, B) rows: images
    cost_image = (margin + scores - positives.t()).clamp(min=0)  # (B, B) columns: texts
    with_diagonal = float(cost_text.sum() + cost_image.sum())
    eye = scores.new_ones(scores.shape[0]).diag().bool()
    cost_text, cost_image = cost_text.masked_fill(eye, 0), cost_image.masked_fill(eye, 0)
    if max_violation:
        return (float(cost_text.max(1).values.sum()), float(cost_image.max(0).values.sum()),
                with_diagonal)
    return float(cost_text.sum()), float(cost_image.sum()), with_diagonal


def check_hinge_loss(fn, margin: float = 0.2) -> None:
    """fn(scores, margin, max_violation) -> VSE++'s hinge loss, summed over the batch."""
    generator = torch.Generator().manual_seed(0)  # (B, B): rows images, positives on the diagonal
    batches = [torch.randn(b, b, generator=generator, dtype=torch.float64).tanh()
               for b in (2, 5, 16)]
    for max_violation in (False, True):
        label = "max-violation" if max_violation else "sum of hinges"
        for scores in batches:
            expected = float(hinge_triplet_loss(scores, margin, max_violation))
            got = float(fn(scores.clone(), margin, max_violation))
            if close(got, expected):
                continue
            batch = scores.shape[0]
            per_image, per_text, with_diagonal = _hinge_directions(scores, margin, max_violation)
            if close(got * batch, expected):
                raise ExerciseError(f"{label}: you averaged over the batch; VSE++ returns the sum")
            if not max_violation and close(got, with_diagonal):
                raise ExerciseError(f"{label}: the positives count as their own negatives (each "
                                    "adds `margin`); zero the diagonal of both cost matrices")
            if close(got, per_image) or close(got, per_text):
                raise ExerciseError(f"{label}: only one direction is counted; add wrong texts per "
                                    "image (rows) and wrong images per text (columns)")
            raise ExerciseError(f"{label}: expected {expected:.6f} on a {batch}x{batch} batch, got "
                                f"{got:.6f}; check the hinge [margin + S(i, j) - S(i, i)]_+ and "
                                "the axis of each max")
    print("hinge loss: correct (sum of hinges and max-violation)")
