"""SCAN's stacked cross attention (Lee et al., ECCV 2018): one score per (image, text) pair.

Regions (N, R, D) and words (T, L, D) come L2-normalised from their encoders. "t2i": each word
(query) attends over the image's regions (context); "i2t": each region over the caption's words.
Attention is SCAN's `func_attention` with `clipped_l2norm`: attn = context . query^T (Lc, Lq);
LeakyReLU(0.1); L2-normalise over the query axis (x / (||x|| + eps)); softmax over the context axis
of lambda_softmax * attn; attended = weights . context. Each query item scores cosine(query_item,
attended_item), aggregated over the real query items by LogSumExp, log(sum exp(lambda_lse r)) /
lambda_lse, or the mean.

Padding (SCAN's code slices instead): a bool mask marks real items; padded slots are zeroed, get
zero weight and are left out of the aggregation, which equals slicing up to rounding
(tests/test_scan.py). `scan_similarity` scores blocks of images x texts, so memory stays flat in the
gallery size, and never builds the attended vectors: the cosine comes from the raw scores and the
context's Gram matrix (`_score_block`), at a cost independent of D.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course_lib.methods.queries import check_direction

AGGREGATIONS = ("lse", "mean")
# numbers in one block's (Bc, Lc, Bq, Lq) attention: CPU 2 MB of float32 (cache-sized), GPU 64 MB
_BLOCK_ELEMENTS = {"cpu": 1 << 19, "other": 1 << 24}


# ----------------------------------------------------------------------------- checks
def _check_items(x, name: str, shape_hint: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor {shape_hint}, not {type(x).__name__}; "
                        "wrap it with torch.as_tensor(...)")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D {shape_hint}, got shape {tuple(x.shape)}; "
                         "a single item set needs a leading batch axis: x.unsqueeze(0)")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}; use {name}.float()")


def _check_mask(mask, items: torch.Tensor, name: str, items_name: str, all_real: bool = False):
    """`mask` (bool, True = real item, on `items`' first two axes); None: None, or all True."""
    if mask is None:
        return items.new_ones(items.shape[:2], dtype=torch.bool) if all_real else None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        kind = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = real item), got {kind}; "
                        f"convert it with {name}.bool() or ({name} != 0)")
    if tuple(mask.shape) != tuple(items.shape[:2]):
        raise ValueError(f"{name} must have shape {tuple(items.shape[:2])} (the first two axes of "
                         f"{items_name}), got {tuple(mask.shape)}")
    if mask.device != items.device:
        raise ValueError(f"{name} is on {mask.device} but {items_name} on {items.device}; "
                         f"move it with {name}.to({items_name}.device)")
    return mask


def _check_nonempty(mask: torch.Tensor, owner: str, item: str) -> None:
    empty = (~mask.any(dim=1)).nonzero().flatten()
    if len(empty):
        raise ValueError(f"{len(empty)} {owner}(s) have no real {item}s (first: "
                         f"{empty[:5].tolist()}), so their score is undefined; drop them or "
                         f"mark at least one {item} True in the mask")


# ----------------------------------------------------------------------------- attention
def _attention_weights(attn: torch.Tensor, lambda_softmax: float, context_bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """SCAN's weights from attn = context . query^T, (P, Lc, Lq) or (Bc, Lc, Bq, Lq), context_bias 0
    or -inf (padded): they sum to 1 over dim 1 (SCAN's softmax over the transpose, no copy)."""
    attn = F.leaky_relu(attn, 0.1)  # clipped_l2norm, step 1
    # step 2: l2norm over the query axis; the clamp keeps sqrt's gradient finite on a zero row
    norm = attn.pow(2).sum(dim=-1, keepdim=True).clamp(min=eps * eps).sqrt()
    logits = torch.addcmul(context_bias, attn, lambda_softmax / (norm + eps))  # bias + attn * scale
    return torch.softmax(logits, dim=1)


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where mask is True (real), -inf where False (padded)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def func_attention(query: torch.Tensor, context: torch.Tensor, lambda_softmax: float = 9.0,
                   context_mask: torch.Tensor | None = None, eps: float = 1e-8, *,
                   query_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SCAN's attention for P (query set, context set) pairs -> (attended (P, Lq, D), weights (P,
    Lq, Lc)), rows summing to 1 over the real context (the reference returns the transpose).

    query (P, Lq, D), context (P, Lc, D): a P of 1 broadcasts. context_mask (P, Lc), query_mask (P,
    Lq): bool, True = real; padded query items get zero rows and no share of the l2norm.
    """
    _check_items(query, "query", "(P, Lq, D)")
    _check_items(context, "context", "(P, Lc, D)")
    if query.shape[-1] != context.shape[-1]:
        raise ValueError(f"query and context must share the feature size D, got {query.shape[-1]} "
                         f"and {context.shape[-1]}; project both into one joint space first")
    if query.shape[0] != context.shape[0] and 1 not in (query.shape[0], context.shape[0]):
        raise ValueError(f"query has {query.shape[0]} pairs and context {context.shape[0]}; they "
                         "must match (or one be 1, to broadcast)")
    context_mask = _check_mask(context_mask, context, "context_mask", "context")
    query_mask = _check_mask(query_mask, query, "query_mask", "query")
    if context_mask is not None:
        _check_nonempty(context_mask, "context set", "item")
        context = context.masked_fill(~context_mask.unsqueeze(-1), 0)
    if query_mask is not None:
        # a zero query adds nothing to the query-axis norm
        query = query.masked_fill(~query_mask.unsqueeze(-1), 0)

    attn = context @ query.transpose(1, 2)  # (P, Lc, Lq)
    bias = (attn.new_zeros(()) if context_mask is None
            else _bias(context_mask.unsqueeze(-1), attn.dtype))  # (P, Lc, 1)
    weights = _attention_weights(attn, lambda_softmax, bias, eps).transpose(1, 2)  # (P, Lq, Lc)
    if query_mask is not None:
        weights = weights * query_mask.unsqueeze(-1)
    return weights @ context, weights  # attended (P, Lq, D)


# ----------------------------------------------------------------------------- similarity
def _score_block(context, context_mask, context_gram, query, query_mask, query_norm,
                 lambda_softmax, agg, lambda_lse, eps):
    """Bc context sets (Bc, Lc, D) against Bq query sets (Bq, Lq, D) -> (Bc, Bq); padded slots are
    zero. context_gram (Bc, Lc, Lc) = (c . c'), query_norm (Bq, Lq)."""
    (n_ctx, len_ctx, dim), (n_query, len_query) = context.shape, query.shape[:2]
    # every context item against every query item in one matmul
    attn = context.reshape(-1, dim) @ query.reshape(-1, dim).T  # (Bc * Lc, Bq * Lq)
    attn = attn.view(n_ctx, len_ctx, n_query, len_query)
    bias = _bias(context_mask[:, :, None, None], attn.dtype)  # (Bc, Lc, 1, 1)
    weights = _attention_weights(attn, lambda_softmax, bias, eps)  # (Bc, Lc, Bq, Lq)

    # cosine(q, a) with a = sum_c w_c c, without building the (Bc, Bq, Lq, D) attended vectors:
    #   q . a = sum_c w_c (q . c)              -- the raw scores we already have;
    #   |a|^2 = sum_c w_c sum_c' (c . c') w_c'  -- through the context's Gram matrix (Lc x Lc).
    dots = (weights * attn).sum(1)  # (Bc, Bq, Lq)
    gram_weights = torch.bmm(context_gram, weights.reshape(n_ctx, len_ctx, -1)).view_as(weights)
    # the clamp keeps sqrt's gradient finite
    attended_norm = (gram_weights * weights).sum(1).clamp(min=eps * eps).sqrt()  # (Bc, Bq, Lq)
    cosine = dots / (query_norm * attended_norm).clamp(min=eps)  # SCAN's cosine_similarity
    # aggregated over the real query items -> (Bc, Bq)
    if agg == "lse":  # log(sum exp(lambda r)) / lambda; padded items add exp(-inf) = 0
        logits = (cosine * lambda_lse).masked_fill(~query_mask, float("-inf"))
        return torch.logsumexp(logits, dim=-1) / lambda_lse
    return (cosine * query_mask).sum(-1) / query_mask.sum(-1)


def _block_shape(n_images: int, n_texts: int, per_pair: int, shard_size: int | None,
                 budget: int) -> tuple[int, int]:
    """(images, texts) per block: `shard_size` each, or ~budget // per_pair pairs, squarish."""
    if shard_size is not None:
        return min(shard_size, n_images), min(shard_size, n_texts)
    pairs = max(1, budget // max(per_pair, 1))
    block_images = max(1, min(n_images, math.isqrt(pairs)))
    block_texts = max(1, min(n_texts, pairs // block_images))
    block_images = max(1, min(n_images, pairs // block_texts))
    return block_images, block_texts


def scan_similarity(regions: torch.Tensor, region_mask: torch.Tensor | None, words: torch.Tensor,
                    word_mask: torch.Tensor | None, direction: str = "t2i",
                    lambda_softmax: float = 9.0, agg: str = "lse", lambda_lse: float = 6.0,
                    shard_size: int | None = None, eps: float = 1e-8) -> torch.Tensor:
    """SCAN's score of every image against every text -> (N, T), differentiable, in the inputs'
    dtype (half computed in float32) and device.

    regions (N, R, D), words (T, L, D); region_mask (N, R), word_mask (T, L): bool, None = all real.
    direction "t2i" aggregates over the caption's words, "i2t" over the image's regions. SCAN's
    best: t2i lambda_softmax 9 with lse 6 or mean; i2t lambda_softmax 4 with lse 5 (Flickr30k) or 20
    (COCO). shard_size: images and texts per block; changes memory and speed, never the result.
    """
    check_direction(direction)
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS} (LogSumExp or mean), got {agg!r}")
    if not lambda_softmax >= 0:
        raise ValueError(f"lambda_softmax must be >= 0 (SCAN uses 4-9), got {lambda_softmax}")
    if agg == "lse" and not lambda_lse > 0:
        raise ValueError(f"lambda_lse must be > 0 for agg='lse' (SCAN uses 5-20), got {lambda_lse}")
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int)
                                   or shard_size < 1):
        raise ValueError(f"shard_size must be a positive int or None, got {shard_size!r}")
    _check_items(regions, "regions", "(n_images, n_regions, D)")
    _check_items(words, "words", "(n_texts, n_words, D)")
    if regions.shape[-1] != words.shape[-1]:
        raise ValueError(f"regions have D = {regions.shape[-1]} features but words "
                         f"{words.shape[-1]}; both encoders must project into the same joint space")
    if regions.device != words.device:
        raise ValueError(f"regions are on {regions.device} but words on {words.device}; "
                         "move both to one device")
    region_mask = _check_mask(region_mask, regions, "region_mask", "regions", all_real=True)
    word_mask = _check_mask(word_mask, words, "word_mask", "words", all_real=True)
    _check_nonempty(region_mask, "image", "region")
    _check_nonempty(word_mask, "text", "word")

    out_dtype = torch.promote_types(regions.dtype, words.dtype)
    work = torch.promote_types(out_dtype, torch.float32)  # half inputs: float32 arithmetic
    n_images, n_texts = regions.shape[0], words.shape[0]
    # padded slots zeroed add nothing to any dot product, norm or Gram matrix
    regions = regions.to(work).masked_fill(~region_mask.unsqueeze(-1), 0)  # (N, R, D)
    words = words.to(work).masked_fill(~word_mask.unsqueeze(-1), 0)  # (T, L, D)
    sides = [(regions, region_mask), (words, word_mask)]  # t2i: words attend over regions
    (context, context_mask), (query, query_mask) = sides if direction == "t2i" else sides[::-1]
    context_gram = context @ context.transpose(1, 2)  # (n_context_sets, Lc, Lc)
    query_norm = torch.linalg.vector_norm(query, dim=-1)  # (n_query_sets, Lq)

    budget = _BLOCK_ELEMENTS["cpu" if regions.device.type == "cpu" else "other"]
    block_images, block_texts = _block_shape(n_images, n_texts, regions.shape[1] * words.shape[1],
                                             shard_size, budget)
    out = regions.new_empty((n_images, n_texts))  # (N, T), filled block by block
    for i0 in range(0, n_images, block_images):
        for t0 in range(0, n_texts, block_texts):
            images, texts = slice(i0, i0 + block_images), slice(t0, t0 + block_texts)
            c, q = (images, texts) if direction == "t2i" else (texts, images)
            block = _score_block(context[c], context_mask[c], context_gram[c], query[q],
                                 query_mask[q], query_norm[q], lambda_softmax, agg, lambda_lse, eps)
            out[images, texts] = block if direction == "t2i" else block.T
    return out.to(out_dtype)
