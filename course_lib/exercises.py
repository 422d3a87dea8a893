"""Checkers for the notebooks' exercises: each runs the learner's function on cases with
known answers and says what is wrong in words (the usual mistakes first), or that it passes.

The reference answers come from `course_lib.metrics`, so an exercise checks the learner against
the same tested code the rest of the course uses.
"""

from __future__ import annotations

import numpy as np

from .metrics import retrieval_metrics, retrieval_ranks


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""


def _cases(seed: int = 0):
    """Small score matrices (n_images, n_texts) with 5 captions per image, ties included."""
    rng = np.random.default_rng(seed)
    for n_images in (2, 3, 7):
        txt2img = np.repeat(np.arange(n_images), 5)
        sims = rng.normal(size=(n_images, 5 * n_images)).round(1)  # rounding makes ties
        yield sims, txt2img


def _recall_from_ranks(ranks, k):
    return 100.0 * np.mean(np.asarray(ranks) < k)


def check_t2i_ranks(fn) -> None:
    """fn(sims, txt2img) -> 0-based rank of the true image for every text (length n_texts)."""
    for sims, txt2img in _cases():
        expected = retrieval_ranks(sims, txt2img)[1]
        got = np.asarray(fn(sims.copy(), txt2img.copy()))
        if got.shape != expected.shape:
            raise ExerciseError(f"expected one rank per text, shape {expected.shape}, got {got.shape}; "
                                "text queries are the columns of sims (n_images, n_texts)")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("your ranks are 1-based; the course counts from 0 (R@K = mean(rank < K))")
        ties = (sims == sims[txt2img, np.arange(sims.shape[1])][None, :]).sum(0) - 1
        if ties.any() and not np.array_equal(got, expected) and np.array_equal(got, expected + ties):
            raise ExerciseError("on ties you count the equal-scoring images as above the true one; count "
                                "only strictly higher scores (the optimistic convention the course uses)")
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
            raise ExerciseError(f"expected one rank per image, shape {expected.shape}, got {got.shape}")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("your ranks are 1-based; the course counts from 0 (R@K = mean(rank < K))")
        first_caption_only = np.array([(sims[i] > sims[i, np.flatnonzero(txt2img == i)[0]]).sum()
                                       for i in range(sims.shape[0])])
        if np.array_equal(got, first_caption_only) and not np.array_equal(got, expected):
            raise ExerciseError("you ranked only the first caption of each image; the i2t rank is the "
                                "best (smallest) rank over all of the image's ground-truth captions")
        if not np.array_equal(got, expected):
            bad = int(np.flatnonzero(got != expected)[0])
            raise ExerciseError(f"image {bad}: expected rank {expected[bad]}, got {got[bad]}")
    # and the recalls they give agree with the library's
    sims, txt2img = next(_cases(2))
    metrics = retrieval_metrics(sims, txt2img, ks=(1, 5))
    ranks = np.asarray(fn(sims, txt2img))
    if abs(_recall_from_ranks(ranks, 1) - metrics["i2t_r1"]) > 1e-9:
        raise ExerciseError("ranks look right but the recall they give disagrees with retrieval_metrics")
    print("i2t ranks: correct")
