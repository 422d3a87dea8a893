"""Checker of lesson 02: SCAN's func_attention."""

import torch
import torch.nn.functional as F

from course_lib.methods.scan.attention import func_attention

from .errors import ExerciseError


def _attend(query, context, lam, *, norm_over_query=True, softmax_over_context=True, clip=True):
    """SCAN's func_attention with one step switchable, to recognise a learner's mistake."""
    attn = torch.bmm(context, query.transpose(1, 2))  # (P, Lc, Lq)
    if clip:
        attn = F.leaky_relu(attn, 0.1)
    attn = attn / (attn.norm(dim=2 if norm_over_query else 1, keepdim=True) + 1e-8)
    weights = torch.softmax(lam * attn, dim=1 if softmax_over_context else 2)  # (P, Lc, Lq)
    return torch.bmm(weights.transpose(1, 2), context)  # (P, Lq, D)


def check_func_attention(fn, lambda_softmax: float = 9.0) -> None:
    """fn(query (P, Lq, D), context (P, Lc, D), lambda_softmax) -> attended (P, Lq, D), as SCAN."""
    generator = torch.Generator().manual_seed(0)
    query = F.normalize(torch.randn(3, 4, 8, generator=generator, dtype=torch.float64), dim=-1)
    context = F.normalize(torch.randn(3, 6, 8, generator=generator, dtype=torch.float64), dim=-1)
    expected, _ = func_attention(query, context, lambda_softmax)
    got = fn(query.clone(), context.clone(), lambda_softmax)
    got = got[0] if isinstance(got, tuple) else got  # (attended, weights) is fine too
    if tuple(got.shape) != tuple(expected.shape):
        raise ExerciseError(f"attended must be (P, Lq, D) = {tuple(expected.shape)}, got "
                            f"{tuple(got.shape)}: one attended context vector per query item")
    if torch.allclose(got, expected, atol=1e-8):
        print("func_attention: correct")
        return
    mistakes = [
        (dict(norm_over_query=False), "you L2-normalised over the context axis; SCAN's "
                                      "clipped_l2norm normalises over the query axis"),
        (dict(softmax_over_context=False), "the softmax runs over the query axis; each query "
                                           "item's weights must sum to 1 over the context items"),
        (dict(clip=False), "the LeakyReLU(0.1) before the normalisation is missing (SCAN's "
                           "clipped_l2norm)"),
        (dict(lam=1.0), "lambda_softmax is missing: multiply the normalised scores by it before "
                        "the softmax"),
    ]
    for switches, message in mistakes:
        if torch.allclose(got, _attend(query, context, **{"lam": lambda_softmax, **switches}),
                          atol=1e-8):
            raise ExerciseError(message)
    worst = (got - expected).abs().max().item()
    raise ExerciseError(f"attended vectors differ from SCAN's by up to {worst:.3g}; follow the "
                        "steps: context . query^T, LeakyReLU(0.1), L2-norm over queries, times "
                        "lambda, softmax over context, weighted sum of context")
