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


# ----------------------------------------------------------------------------- lesson 01

def _score_batches(seed: int = 0):
    """Square (B, B) score matrices, rows images and columns texts, positives on the diagonal."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for batch in (2, 5, 16):
        yield torch.randn(batch, batch, generator=generator, dtype=torch.float64).tanh()


def _hinge_directions(scores, margin: float, max_violation: bool):
    """The two halves of VSE++'s loss (wrong texts per image, wrong images per text), and the
    sum-of-hinges total with the diagonal left in: the usual mistakes, to recognise them."""
    positives = scores.diagonal().view(-1, 1)  # (B, 1)
    cost_text = (margin + scores - positives).clamp(min=0)  # (B, B) rows: images
    cost_image = (margin + scores - positives.t()).clamp(min=0)  # (B, B) columns: texts
    with_diagonal = float(cost_text.sum() + cost_image.sum())
    eye = scores.new_ones(scores.shape[0]).diag().bool()
    cost_text, cost_image = cost_text.masked_fill(eye, 0), cost_image.masked_fill(eye, 0)
    if max_violation:
        return float(cost_text.max(1).values.sum()), float(cost_image.max(0).values.sum()), with_diagonal
    return float(cost_text.sum()), float(cost_image.sum()), with_diagonal


def check_hinge_loss(fn, margin: float = 0.2) -> None:
    """fn(scores, margin, max_violation) -> VSE++'s hinge loss, summed over the batch."""
    from .losses import hinge_triplet_loss

    def close(a, b):
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))

    for max_violation in (False, True):
        label = "max-violation" if max_violation else "sum of hinges"
        for scores in _score_batches():
            expected = float(hinge_triplet_loss(scores, margin, max_violation))
            got = float(fn(scores.clone(), margin, max_violation))
            if close(got, expected):
                continue
            batch = scores.shape[0]
            per_image, per_text, with_diagonal = _hinge_directions(scores, margin, max_violation)
            if close(got * batch, expected):
                raise ExerciseError(f"{label}: you averaged over the batch; VSE++ returns the sum")
            if not max_violation and close(got, with_diagonal):
                raise ExerciseError(f"{label}: the positives count as their own negatives (each adds "
                                    "`margin`); zero the diagonal of both cost matrices")
            if close(got, per_image) or close(got, per_text):
                raise ExerciseError(f"{label}: only one direction is counted; add wrong texts per image "
                                    "(rows) and wrong images per text (columns)")
            raise ExerciseError(f"{label}: expected {expected:.6f} on a {batch}x{batch} batch, got {got:.6f}; "
                                "check the hinge [margin + S(i, j) - S(i, i)]_+ and the axis of each max")
    print("hinge loss: correct (sum of hinges and max-violation)")


# ----------------------------------------------------------------------------- lesson 02

def _attend(query, context, lam, *, norm_over_query=True, softmax_over_context=True, clip=True):
    """SCAN's func_attention with one step switchable, to recognise a learner's mistake."""
    import torch
    import torch.nn.functional as F

    attn = torch.bmm(context, query.transpose(1, 2))  # (P, Lc, Lq)
    if clip:
        attn = F.leaky_relu(attn, 0.1)
    attn = attn / (attn.norm(dim=2 if norm_over_query else 1, keepdim=True) + 1e-8)
    weights = torch.softmax(lam * attn, dim=1 if softmax_over_context else 2)  # (P, Lc, Lq)
    return torch.bmm(weights.transpose(1, 2), context)  # (P, Lq, D)


def check_func_attention(fn, lambda_softmax: float = 9.0) -> None:
    """fn(query (P, Lq, D), context (P, Lc, D), lambda_softmax) -> attended (P, Lq, D), as SCAN."""
    import torch
    import torch.nn.functional as F

    from .scan import func_attention

    generator = torch.Generator().manual_seed(0)
    query = F.normalize(torch.randn(3, 4, 8, generator=generator, dtype=torch.float64), dim=-1)
    context = F.normalize(torch.randn(3, 6, 8, generator=generator, dtype=torch.float64), dim=-1)
    expected, _ = func_attention(query, context, lambda_softmax)
    got = fn(query.clone(), context.clone(), lambda_softmax)
    got = got[0] if isinstance(got, tuple) else got
    if tuple(got.shape) != tuple(expected.shape):
        raise ExerciseError(f"attended must be (P, Lq, D) = {tuple(expected.shape)}, got {tuple(got.shape)}: "
                            "one attended context vector per query item")
    if torch.allclose(got, expected, atol=1e-8):
        print("func_attention: correct")
        return
    mistakes = [
        (dict(norm_over_query=False), "you L2-normalised over the context axis; SCAN's clipped_l2norm "
                                      "normalises over the query axis"),
        (dict(softmax_over_context=False), "the softmax runs over the query axis; each query item's weights "
                                           "must sum to 1 over the context items"),
        (dict(clip=False), "the LeakyReLU(0.1) before the normalisation is missing (SCAN's clipped_l2norm)"),
    ]
    for switches, message in mistakes:
        if torch.allclose(got, _attend(query, context, lambda_softmax, **switches), atol=1e-8):
            raise ExerciseError(message)
    if torch.allclose(got, _attend(query, context, 1.0), atol=1e-8):
        raise ExerciseError("lambda_softmax is missing: multiply the normalised scores by it before the softmax")
    worst = (got - expected).abs().max().item()
    raise ExerciseError(f"attended vectors differ from SCAN's by up to {worst:.3g}; follow the steps: "
                        "context . query^T, LeakyReLU(0.1), L2-norm over queries, times lambda, softmax "
                        "over context, weighted sum of context")
