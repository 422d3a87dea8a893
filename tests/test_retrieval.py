"""Tests for course_lib.retrieval: the exact FAISS index against torch brute force, input
handling (torch / numpy, 1-D queries, k larger than the gallery), storage sizes and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.retrieval import (INDEX_KINDS, as_float32_matrix, brute_force_topk, build_index,
                                  embedding_bytes, search)


def random_embeddings(n, dim, seed, normalize=True):
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))  # (n, E)
    return torch.nn.functional.normalize(x, dim=1) if normalize else x


def assert_same_topk(faiss_result, torch_result, gap=1e-5):
    """Scores allclose; indices equal wherever a score is clearly apart from its neighbours
    (FAISS and torch sum in different orders, so near-ties may swap)."""
    f_scores, f_idx = faiss_result
    t_scores, t_idx = (t.cpu().numpy() for t in torch_result)
    assert f_scores.shape == t_scores.shape == f_idx.shape == t_idx.shape
    np.testing.assert_allclose(f_scores, t_scores, rtol=1e-5, atol=1e-5)
    diffs = np.abs(np.diff(t_scores, axis=1))  # (Q, k-1) gaps between consecutive ranks
    distinct = np.ones_like(t_scores, dtype=bool)
    distinct[:, 1:] &= diffs > gap
    distinct[:, :-1] &= diffs > gap
    assert distinct.mean() > 0.9  # the comparison below really compares something
    np.testing.assert_array_equal(f_idx[distinct], t_idx[distinct])


@pytest.mark.parametrize("n, dim, q, k", [(1, 8, 1, 1), (7, 16, 3, 5), (100, 32, 20, 10),
                                          (2000, 64, 50, 10), (300, 24, 1, 300)])
def test_faiss_topk_matches_brute_force(n, dim, q, k):
    gallery, queries = random_embeddings(n, dim, seed=n), random_embeddings(q, dim, seed=n + 1)
    index = build_index(gallery)
    assert index.ntotal == n and index.d == dim
    assert_same_topk(search(index, queries, k), brute_force_topk(gallery, queries, k))


def test_unnormalised_vectors_use_raw_inner_products():
    # LightningDOT does not normalise: the index must rank by dot product, not cosine
    gallery = torch.tensor([[1.0, 0.0], [10.0, 1.0], [0.0, 3.0]])
    scores, indices = search(build_index(gallery), torch.tensor([[1.0, 1.0]]), k=3)
    np.testing.assert_array_equal(indices, [[1, 2, 0]])
    np.testing.assert_allclose(scores, [[11.0, 3.0, 1.0]])


def test_k_larger_than_gallery_is_capped():
    gallery, queries = random_embeddings(5, 8, seed=0), random_embeddings(2, 8, seed=1)
    scores, indices = search(build_index(gallery), queries, k=10)
    assert scores.shape == indices.shape == (2, 5)
    assert (indices >= 0).all()  # no FAISS -1 padding
    np.testing.assert_array_equal(np.sort(indices, axis=1), np.tile(np.arange(5), (2, 1)))
    t_scores, t_idx = brute_force_topk(gallery, queries, k=10)
    assert t_scores.shape == (2, 5)


def test_one_query_as_a_vector_and_inputs_of_any_type():
    gallery = random_embeddings(50, 16, seed=3)
    query = random_embeddings(1, 16, seed=4)[0]  # (E,)
    from_torch = search(build_index(gallery), query, k=4)
    from_numpy = search(build_index(gallery.numpy().astype(np.float64)), query.numpy(), k=4)
    assert from_torch[1].shape == (1, 4)
    np.testing.assert_array_equal(from_torch[1], from_numpy[1])
    assert_same_topk(from_torch, brute_force_topk(gallery, query, k=4))


def test_index_holds_a_copy():
    gallery = random_embeddings(10, 8, seed=5)
    index = build_index(gallery)
    before = search(index, gallery[:3], k=3)
    gallery.mul_(-1)  # changing the tensor afterwards must not change the index
    after = search(index, -gallery[:3], k=3)
    np.testing.assert_array_equal(before[1], after[1])


def test_float32_conversion_is_contiguous():
    x = torch.randn(6, 4, dtype=torch.float64).T  # non-contiguous float64 (4, 6)
    out = as_float32_matrix(x)
    assert out.dtype == np.float32 and out.flags["C_CONTIGUOUS"] and out.shape == (4, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_brute_force_on_gpu_matches_faiss():
    gallery, queries = random_embeddings(500, 32, seed=6), random_embeddings(8, 32, seed=7)
    result = brute_force_topk(gallery.cuda(), queries.cuda(), k=10)
    assert result[0].device.type == "cuda"
    assert_same_topk(search(build_index(gallery.cuda()), queries, 10), result)


def test_embedding_bytes():
    assert embedding_bytes(1, 768) == 3072  # one LightningDOT vector
    assert embedding_bytes(36, 2048) == 294_912  # its 36 region features: 96x more
    assert embedding_bytes(1000, 64, np.float16) == 128_000
    assert embedding_bytes(10, 8, torch.float64) == 640
    with pytest.raises(ValueError, match=">= 0"):
        embedding_bytes(-1, 8)


def test_errors_are_clear():
    gallery = random_embeddings(10, 8, seed=8)
    with pytest.raises(ValueError, match=r"unknown index kind 'ivf'.*\['flat'\]"):
        build_index(gallery, kind="ivf")
    assert "flat" in INDEX_KINDS
    with pytest.raises(ValueError, match="2-D"):
        build_index(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="empty"):
        build_index(torch.zeros(0, 8))
    bad = gallery.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf in 1 of 10 rows"):
        build_index(bad)
    index = build_index(gallery)
    with pytest.raises(ValueError, match="dimension 4 .* 8-d"):
        search(index, torch.zeros(1, 4), k=1)
    with pytest.raises(ValueError, match="k must be"):
        search(index, gallery[:1], k=0)
    with pytest.raises(ValueError, match="NaN"):
        search(index, bad[3:4], k=1)
    with pytest.raises(ValueError, match="same E"):
        brute_force_topk(gallery, torch.zeros(2, 5), k=1)
    with pytest.raises(TypeError, match="numbers"):
        as_float32_matrix(np.array([["a", "b"]]))
