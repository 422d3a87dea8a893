"""Tests for course_lib.methods.scan.attention: a per-pair loop that follows SCAN's reference code
literally (slicing, no masks), hand-worked values, masks, sharding, gradients, scale and errors."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from course_lib.core.losses import hinge_triplet_loss
from course_lib.methods.scan.attention import (
    _BLOCK_ELEMENTS,
    _block_shape,
    func_attention,
    scan_similarity,
)


# ---------------------------------------------------------------------------------------- reference
# Written from kuanghuei/SCAN's model.py structure: l2norm, func_attention (clipped_l2norm),
# cosine_similarity, xattn_score_t2i / xattn_score_i2t. Variable lengths by slicing, never masks.
def ref_l2norm(X, dim, eps=1e-8):
    norm = torch.pow(X, 2).sum(dim=dim, keepdim=True).sqrt() + eps
    return torch.div(X, norm)


def ref_func_attention(query, context, smooth, eps=1e-8):
    """query (b, queryL, d), context (b, sourceL, d) -> weightedContext (b, queryL, d), attnT."""
    batch_size, queryL = query.size(0), query.size(1)
    sourceL = context.size(1)
    queryT = torch.transpose(query, 1, 2)  # (b, d, queryL)
    attn = torch.bmm(context, queryT)  # (b, sourceL, queryL)
    attn = nn.LeakyReLU(0.1)(attn)
    attn = ref_l2norm(attn, 2, eps)
    attn = torch.transpose(attn, 1, 2).contiguous()  # (b, queryL, sourceL)
    attn = attn.view(batch_size * queryL, sourceL)
    attn = nn.Softmax(dim=1)(attn * smooth)
    attn = attn.view(batch_size, queryL, sourceL)
    attnT = torch.transpose(attn, 1, 2).contiguous()  # (b, sourceL, queryL)
    contextT = torch.transpose(context, 1, 2)  # (b, d, sourceL)
    weightedContext = torch.bmm(contextT, attnT)  # (b, d, queryL)
    return torch.transpose(weightedContext, 1, 2), attnT


def ref_cosine_similarity(x1, x2, dim=1, eps=1e-8):
    w12 = torch.sum(x1 * x2, dim)
    w1 = torch.norm(x1, 2, dim)
    w2 = torch.norm(x2, 2, dim)
    return w12 / (w1 * w2).clamp(min=eps)


def ref_scan(regions, n_regions, words, n_words, direction, lambda_softmax, agg, lambda_lse):
    """(N, T) scores with one Python loop per (image, caption) pair."""
    rows = []
    for i in range(regions.shape[0]):
        image = regions[i, :n_regions[i]].unsqueeze(0)  # (1, R_i, D)
        row = []
        for t in range(words.shape[0]):
            caption = words[t, :n_words[t]].unsqueeze(0)  # (1, L_t, D)
            if direction == "t2i":
                query, context = caption, image
            else:
                query, context = image, caption
            weighted, _ = ref_func_attention(query, context, lambda_softmax)
            sim = ref_cosine_similarity(query, weighted, dim=2)  # (1, Lq)
            if agg == "lse":
                sim = torch.log(torch.exp(sim * lambda_lse).sum(dim=1)) / lambda_lse
            else:
                sim = sim.mean(dim=1)
            row.append(sim[0])
        rows.append(torch.stack(row))
    return torch.stack(rows)


def make_inputs(n_images, n_texts, R, L, D, seed=0, dtype=torch.float64, garbage=1e3):
    """L2-normalised real items, variable lengths, padded slots full of garbage."""
    g = torch.Generator().manual_seed(seed)
    n_regions = torch.randint(1, R + 1, (n_images,), generator=g)
    n_words = torch.randint(1, L + 1, (n_texts,), generator=g)
    n_regions[0], n_words[0] = R, L  # at least one full-length item on each side
    region_mask = torch.arange(R)[None] < n_regions[:, None]  # (N, R)
    word_mask = torch.arange(L)[None] < n_words[:, None]  # (T, L)
    regions = nn.functional.normalize(torch.randn(n_images, R, D, generator=g, dtype=dtype), dim=-1)
    words = nn.functional.normalize(torch.randn(n_texts, L, D, generator=g, dtype=dtype), dim=-1)
    regions = torch.where(region_mask[..., None], regions, garbage * torch.randn_like(regions))
    words = torch.where(word_mask[..., None], words, garbage * torch.randn_like(words))
    return regions, region_mask, n_regions.tolist(), words, word_mask, n_words.tolist()


# ---------------------------------------------------------------------------------- reference match
@pytest.mark.parametrize("direction,agg,lambda_softmax,lambda_lse", [
    ("t2i", "lse", 9.0, 6.0), ("t2i", "mean", 9.0, 6.0), ("t2i", "lse", 1.0, 20.0),
    ("i2t", "lse", 4.0, 5.0), ("i2t", "mean", 4.0, 6.0), ("i2t", "lse", 20.0, 20.0),
])
def test_matches_reference_loop(direction, agg, lambda_softmax, lambda_lse):
    regions, region_mask, n_regions, words, word_mask, n_words = make_inputs(5, 7, 6, 8, 16)
    expected = ref_scan(regions, n_regions, words, n_words, direction, lambda_softmax, agg,
                        lambda_lse)
    for shard_size in (None, 1, 2, 3, 100):
        got = scan_similarity(regions, region_mask, words, word_mask, direction=direction,
                              lambda_softmax=lambda_softmax, agg=agg, lambda_lse=lambda_lse,
                              shard_size=shard_size)
        assert got.shape == (5, 7) and got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_sharding_never_changes_the_result():
    regions, region_mask, _, words, word_mask, _ = make_inputs(7, 11, 5, 9, 12, seed=1,
                                                               dtype=torch.float32)
    for direction in ("t2i", "i2t"):
        whole = scan_similarity(regions, region_mask, words, word_mask, direction, shard_size=1000)
        for shard_size in (1, 2, 3, 4, 5, 6, 10):  # most divide neither 7 nor 11
            got = scan_similarity(regions, region_mask, words, word_mask, direction,
                                  shard_size=shard_size)
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


def test_nan_in_padding_and_no_masks():
    regions, region_mask, n_regions, words, word_mask, n_words = make_inputs(3, 4, 4, 5, 8, seed=2)
    regions = regions.masked_fill(~region_mask[..., None], float("nan"))
    words = words.masked_fill(~word_mask[..., None], float("inf"))
    got = scan_similarity(regions, region_mask, words, word_mask)
    expected = ref_scan(regions, n_regions, words, n_words, "t2i", 9.0, "lse", 6.0)
    torch.testing.assert_close(got, expected)
    # Masks None = every item real = the reference on the full, unsliced tensors.
    full_r, full_w = regions.nan_to_num(0.5), words.nan_to_num(0.5, posinf=0.5)
    torch.testing.assert_close(scan_similarity(full_r, None, full_w, None, "i2t", agg="mean"),
                               ref_scan(full_r, [4] * 3, full_w, [5] * 4, "i2t", 9.0, "mean", 6.0))


# ------------------------------------------------------------------------------- hand-worked values
def test_one_region_two_words():
    e = torch.eye(3, dtype=torch.float64)
    regions = e[None, :1]  # one image, one region: e1
    words = e[None, :2]  # one caption: e1, e2
    # t2i: with one context item every word attends to it, so attended = e1 for both words and
    # the cosines are 1 and 0.
    assert scan_similarity(regions, None, words, None, agg="mean").item() == pytest.approx(0.5)
    lse = scan_similarity(regions, None, words, None, agg="lse", lambda_lse=6.0).item()
    assert lse == pytest.approx(math.log(math.exp(6.0) + 1.0) / 6.0)
    # i2t: the region (query) attends over the words. attn = [[1], [0]] (Lc=2, Lq=1); the
    # l2norm over the single query leaves it [1, 0]; softmax(lambda * [1, 0]) = [s, 1 - s].
    lam = 4.0
    s = math.exp(lam) / (math.exp(lam) + 1.0)
    cos = s / math.sqrt(s ** 2 + (1 - s) ** 2)  # cosine(e1, s e1 + (1 - s) e2)
    got = scan_similarity(regions, None, words, None, "i2t", lambda_softmax=lam, agg="mean")
    assert got.item() == pytest.approx(cos)


def test_two_by_two_orthogonal():
    e = torch.eye(2, dtype=torch.float64)
    regions, words = e[None], e[None]  # regions e1, e2; words e1, e2
    # attn = I; each word puts s = e^l / (e^l + 1) on its own region and 1 - s on the other.
    lam = 9.0
    s = math.exp(lam) / (math.exp(lam) + 1.0)
    cos = s / math.sqrt(s ** 2 + (1 - s) ** 2)
    assert scan_similarity(regions, None, words, None, lambda_softmax=lam,
                           agg="mean").item() == pytest.approx(cos)
    # LSE of two equal values c is c + log(2) / lambda_lse.
    assert scan_similarity(regions, None, words, None, lambda_softmax=lam,
                           lambda_lse=6.0).item() == pytest.approx(cos + math.log(2) / 6.0)


# ----------------------------------------------------------------------------------- func_attention
def test_func_attention_matches_reference_batched_formula():
    g = torch.Generator().manual_seed(3)
    query = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    context = torch.randn(4, 7, 8, generator=g, dtype=torch.float64)
    attended, weights = func_attention(query, context, lambda_softmax=9.0)
    ref_attended, ref_attnT = ref_func_attention(query, context, 9.0)
    torch.testing.assert_close(attended, ref_attended)
    torch.testing.assert_close(weights, ref_attnT.transpose(1, 2))
    # P = 1 on one side broadcasts.
    attended_b, _ = func_attention(query[:1], context, lambda_softmax=9.0)
    expected, _ = ref_func_attention(query[:1].expand(4, -1, -1), context, 9.0)
    torch.testing.assert_close(attended_b, expected)


def test_func_attention_masks_equal_slicing():
    regions, region_mask, n_regions, words, word_mask, n_words = make_inputs(4, 4, 6, 7, 8, seed=4)
    attended, weights = func_attention(words, regions, lambda_softmax=9.0, context_mask=region_mask,
                                       query_mask=word_mask)  # pair p = (caption p, image p)
    sums = weights.sum(-1)  # (P, Lq)
    torch.testing.assert_close(sums, word_mask.double())  # 1 on real queries, 0 on padded ones
    assert (weights.masked_select(~region_mask[:, None, :]) == 0).all()
    for p in range(4):
        ref_att, ref_attnT = ref_func_attention(words[p:p + 1, :n_words[p]],
                                                regions[p:p + 1, :n_regions[p]], 9.0)
        torch.testing.assert_close(attended[p, :n_words[p]], ref_att[0])
        torch.testing.assert_close(weights[p, :n_words[p], :n_regions[p]], ref_attnT[0].T)
        assert (attended[p, n_words[p]:] == 0).all()


# -------------------------------------------------------------------------------- gradients, dtypes
@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_gradients_match_reference_and_reach_both_inputs(direction):
    regions, region_mask, n_regions, words, word_mask, n_words = make_inputs(4, 4, 5, 6, 8, seed=5)
    regions.requires_grad_(True)
    words.requires_grad_(True)
    loss = hinge_triplet_loss(scan_similarity(regions, region_mask, words, word_mask, direction))
    grad_r, grad_w = torch.autograd.grad(loss, (regions, words))
    ref_loss = hinge_triplet_loss(ref_scan(regions, n_regions, words, n_words, direction,
                                           9.0, "lse", 6.0))
    ref_r, ref_w = torch.autograd.grad(ref_loss, (regions, words))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad_r, ref_r)
    torch.testing.assert_close(grad_w, ref_w)
    assert grad_r.abs().sum() > 0 and grad_w.abs().sum() > 0
    assert (grad_r[~region_mask] == 0).all() and (grad_w[~word_mask] == 0).all()


def test_dtypes_and_float32_default_shards():
    regions, region_mask, _, words, word_mask, _ = make_inputs(3, 5, 4, 6, 16, seed=6)
    exact = scan_similarity(regions, region_mask, words, word_mask)
    got32 = scan_similarity(regions.float(), region_mask, words.float(), word_mask)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, exact.float(), rtol=1e-5, atol=1e-5)
    got16 = scan_similarity(regions.bfloat16(), region_mask, words.bfloat16(), word_mask)
    assert got16.dtype == torch.bfloat16 and torch.isfinite(got16.float()).all()
    torch.testing.assert_close(got16.float(), got32, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_cpu():
    regions, region_mask, _, words, word_mask, _ = make_inputs(9, 13, 5, 7, 16, seed=8,
                                                               dtype=torch.float32)
    for direction in ("t2i", "i2t"):
        cpu = scan_similarity(regions, region_mask, words, word_mask, direction)
        gpu = scan_similarity(regions.cuda(), region_mask.cuda(), words.cuda(), word_mask.cuda(),
                              direction)
        assert gpu.device.type == "cuda"
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------------------- scale
def test_block_shape_respects_the_memory_budget():
    budget = _BLOCK_ELEMENTS["cpu"]
    for n_images, n_texts, per_pair in [(1000, 5000, 72), (1000, 5000, 36 * 32), (1, 5000, 72),
                                        (1000, 1, 72), (3, 4, 10 ** 9)]:
        bi, bt = _block_shape(n_images, n_texts, per_pair, None, budget)
        assert 1 <= bi <= n_images and 1 <= bt <= n_texts
        assert bi * bt * per_pair <= max(budget, per_pair)
    assert _block_shape(1000, 5000, 72, None, 1 << 19) == (85, 85)
    assert _block_shape(1, 5000, 72, None, 1 << 19) == (1, 5000)  # a short side grows the other
    assert _block_shape(10, 20, 72, 7, 1 << 19) == (7, 7)  # an explicit shard_size wins


def test_test_split_shape_scale():
    # The real shape of our test split, at a fifth of the size (1k x 5k takes a few s).
    regions, region_mask, n_regions, words, word_mask, n_words = make_inputs(
        200, 1000, 6, 12, 64, seed=7, dtype=torch.float32)
    start = time.perf_counter()
    with torch.no_grad():
        sims = scan_similarity(regions, region_mask, words, word_mask)
    seconds = time.perf_counter() - start
    assert sims.shape == (200, 1000) and torch.isfinite(sims).all()
    assert seconds < 30, f"200 x 1000 SCAN scores took {seconds:.1f} s"
    for i, t in [(0, 0), (17, 999), (199, 345)]:
        expected = ref_scan(regions[i:i + 1].double(), n_regions[i:i + 1], words[t:t + 1].double(),
                            n_words[t:t + 1], "t2i", 9.0, "lse", 6.0)
        assert sims[i, t].item() == pytest.approx(expected.item(), abs=1e-5)


# ------------------------------------------------------------------------------------------- errors
def _ok():
    regions, region_mask, _, words, word_mask, _ = make_inputs(2, 3, 4, 5, 8, dtype=torch.float32)
    return dict(regions=regions, region_mask=region_mask, words=words, word_mask=word_mask)


@pytest.mark.parametrize("change,error,match", [
    (dict(direction="text2image"), ValueError, r"\('t2i', 'i2t'\)"),
    (dict(agg="max"), ValueError, r"\('lse', 'mean'\)"),
    (dict(lambda_lse=0.0), ValueError, "lambda_lse"),
    (dict(lambda_softmax=-1.0), ValueError, "lambda_softmax"),
    (dict(shard_size=0), ValueError, "shard_size"),
    (dict(regions=torch.zeros(4, 8)), ValueError, r"regions must be 3-D"),
    (dict(words=torch.zeros(3, 5, 8, 1)), ValueError, r"words must be 3-D"),
    (dict(regions=[[[0.0]]]), TypeError, "torch tensor"),
    (dict(words=torch.zeros(3, 5, 8, dtype=torch.long)), TypeError, "floating point"),
    (dict(words=torch.zeros(3, 5, 7)), ValueError, "same joint space"),
    (dict(region_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
     r"region_mask must have shape \(2, 4\)"),
    (dict(word_mask=torch.ones(3, 5)), TypeError, r"bool tensor.*word_mask.bool\(\)"),
    (dict(region_mask=torch.tensor([[True] * 4, [False] * 4])), ValueError,
     r"image\(s\) have no real regions.*\[1\]"),
    (dict(word_mask=torch.zeros(3, 5, dtype=torch.bool)), ValueError,
     r"3 text\(s\) have no real words"),
])
def test_scan_similarity_errors(change, error, match):
    kwargs = {**_ok(), **change}
    with pytest.raises(error, match=match):
        scan_similarity(**kwargs)


def test_func_attention_errors():
    q, c = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="feature size D"):
        func_attention(q, torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match="pairs"):
        func_attention(q, torch.randn(3, 5, 4))
    with pytest.raises(ValueError, match=r"context_mask must have shape \(2, 5\)"):
        func_attention(q, c, context_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no real items"):
        func_attention(q, c, context_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_empty_gallery():
    kwargs = _ok()
    kwargs["regions"], kwargs["region_mask"] = kwargs["regions"][:0], kwargs["region_mask"][:0]
    assert scan_similarity(**kwargs).shape == (0, 3)
