"""Tests for course_lib.retrieval: the exact FAISS index against torch brute force, input
handling (torch / numpy, 1-D queries, k larger than the gallery), storage sizes and errors; the
approximate IVF / HNSW indexes against brute force, recall_vs_exact on hand-built cases, and the
recall/latency table of index_tradeoff."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

import course_lib.retrieval as retrieval
from course_lib.retrieval import (INDEX_KINDS, as_float32_matrix, brute_force_topk, build_index,
                                  embedding_bytes, index_params, index_tradeoff, recall_vs_exact,
                                  search, set_search_params)
from course_lib.timing import TimingResult


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
    with pytest.raises(ValueError, match=r"unknown index kind 'lsh'.*\['flat', 'hnsw', 'ivf'\]"):
        build_index(gallery, kind="lsh")
    assert {"flat", "ivf", "hnsw"} <= set(INDEX_KINDS)
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


# ---- approximate indexes -------------------------------------------------------------------------

def brute_force_recall(result_idx, gallery, queries, k):
    """k-recall@k computed with python sets against torch's exact top-k."""
    exact = brute_force_topk(gallery, queries, k)[1].numpy()  # (Q, k)
    return np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(result_idx, exact)])


@pytest.fixture(scope="module")
def unit_data():
    return random_embeddings(2000, 32, seed=10), random_embeddings(100, 32, seed=11)


@pytest.mark.parametrize("kind, params", [("ivf", {"nprobe": 32}), ("hnsw", {"ef_search": 128}),
                                          ("hnsw", {"M": 16, "ef_construction": 40,
                                                    "ef_search": 128})])
def test_approximate_index_has_high_recall(unit_data, kind, params):
    gallery, queries = unit_data
    index = build_index(gallery, kind, **params)
    assert index.ntotal == 2000 and index.is_trained
    scores, idx = search(index, queries, k=10)
    assert brute_force_recall(idx, gallery, queries, 10) >= 0.9
    # whatever it returns, it scores exactly: the inner products of those gallery items
    true_scores = np.einsum("qe,qke->qk", queries.numpy(), gallery.numpy()[idx])  # (Q, k)
    np.testing.assert_allclose(scores, true_scores, rtol=1e-5, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 0).all()  # best first


def test_ivf_recall_grows_with_nprobe(unit_data):
    gallery, queries = unit_data
    index = build_index(gallery, "ivf")
    nlist = index.nlist
    recalls = []
    for nprobe in (1, 2, 4, 8, 16, 32, nlist):
        assert set_search_params(index, nprobe=nprobe) is index and index.nprobe == nprobe
        recalls.append(brute_force_recall(search(index, queries, 10)[1], gallery, queries, 10))
    assert recalls == sorted(recalls)  # probing more lists never loses a neighbour
    assert recalls[0] < 0.5 and recalls[-1] == 1.0  # really approximate, and exact at the end


def test_hnsw_recall_grows_with_ef_search(unit_data):
    gallery, queries = unit_data
    index = build_index(gallery, "hnsw", ef_search=10)
    low = brute_force_recall(search(index, queries, 10)[1], gallery, queries, 10)
    set_search_params(index, ef_search=256)
    assert index.hnsw.efSearch == 256
    high = brute_force_recall(search(index, queries, 10)[1], gallery, queries, 10)
    assert low < 0.95 <= high


@pytest.mark.parametrize("normalize", [True, False])
def test_ivf_probing_every_list_is_exact(normalize):
    gallery = random_embeddings(1000, 32, seed=12, normalize=normalize)
    queries = random_embeddings(30, 32, seed=13, normalize=normalize)
    index = build_index(gallery, "ivf", nlist=16, nprobe=16)
    assert index.nlist == 16 and index.nprobe == 16
    assert_same_topk(search(index, queries, 10), brute_force_topk(gallery, queries, 10))
    set_search_params(index, nprobe=1)  # approximate again ...
    set_search_params(index, nprobe=10_000)  # ... and exact: nprobe is capped at nlist
    assert index.nprobe == 16
    assert_same_topk(search(index, queries, 10), brute_force_topk(gallery, queries, 10))


def test_tiny_galleries_build_and_search_exactly():
    for n in (1, 5, 38):
        gallery, queries = random_embeddings(n, 8, seed=n), random_embeddings(4, 8, seed=n + 1)
        for kind in ("ivf", "hnsw"):
            result = search(build_index(gallery, kind), queries, k=3)
            assert_same_topk(result, brute_force_topk(gallery, queries, k=3))


def test_nlist_default_and_clamping():
    ivf = INDEX_KINDS["ivf"]  # builder(dim, n, **params) -> untrained index
    assert ivf(32, 40_000).nlist == 800  # 4 sqrt(n), under the cap 40_000 // 39 = 1025
    assert ivf(32, 2000).nlist == 2000 // 39 == 51  # 4 sqrt(2000) = 179 lists would be too many
    assert ivf(32, 10).nlist == 1  # fewer than 39 points: one list, i.e. exhaustive
    assert ivf(32, 2000).nprobe == 8 and ivf(32, 100).nprobe == 2  # default capped at nlist
    gallery = random_embeddings(100, 32, seed=14)
    with pytest.warns(UserWarning, match=r"nlist=50 needs 1950 training vectors.*nlist <= 2"):
        index = build_index(gallery, "ivf", nlist=50, nprobe=50)
    assert (index.nlist, index.nprobe) == (2, 2)
    assert_same_topk(search(index, gallery[:5], 5), brute_force_topk(gallery, gallery[:5], 5))


def test_hnsw_params_are_applied():
    index = build_index(random_embeddings(50, 8, seed=15), "hnsw", M=8, ef_search=20,
                        ef_construction=30)
    hnsw = index.hnsw
    assert (hnsw.nb_neighbors(1), hnsw.efSearch, hnsw.efConstruction) == (8, 20, 30)
    assert index.metric_type == faiss.METRIC_INNER_PRODUCT


def test_bad_index_params_are_explained():
    gallery = random_embeddings(100, 8, seed=16)
    assert index_params("ivf") == ["nlist", "nprobe"]
    assert index_params("hnsw") == ["M", "ef_search", "ef_construction"]
    assert index_params("flat") == []
    with pytest.raises(ValueError, match=r"\['nprob'\] for .*'ivf'.*\['nlist', 'nprobe'\]"):
        build_index(gallery, "ivf", nprob=4)
    with pytest.raises(ValueError, match=r"'hnsw'.*\['M', 'ef_search', 'ef_construction'\]"):
        build_index(gallery, "hnsw", efSearch=4)
    with pytest.raises(ValueError, match="'flat'.*none"):
        build_index(gallery, nprobe=4)
    with pytest.raises(ValueError, match="nprobe must be an integer >= 1, got 0"):
        build_index(gallery, "ivf", nprobe=0)
    with pytest.raises(ValueError, match="nlist must be an integer >= 1"):
        build_index(gallery, "ivf", nlist=2.5)
    with pytest.raises(ValueError, match="M must be an integer >= 2"):
        build_index(gallery, "hnsw", M=1)
    with pytest.raises(ValueError, match="ef_search must be an integer >= 1"):
        build_index(gallery, "hnsw", ef_search=True)
    with pytest.raises(ValueError, match="unknown index kind"):
        index_params("lsh")


def test_set_search_params_errors():
    gallery = random_embeddings(100, 8, seed=17)
    flat, ivf, hnsw = (build_index(gallery, kind) for kind in ("flat", "ivf", "hnsw"))
    with pytest.raises(ValueError, match="nothing to set"):
        set_search_params(ivf)
    with pytest.raises(ValueError, match="nprobe applies to IVF.*IndexHNSWFlat.*ef_search"):
        set_search_params(hnsw, nprobe=4)
    with pytest.raises(ValueError, match="ef_search applies to HNSW.*IndexIVFFlat.*nprobe"):
        set_search_params(ivf, ef_search=4)
    with pytest.raises(ValueError, match="IndexFlatIP.*exact index"):
        set_search_params(flat, ef_search=4)
    with pytest.raises(ValueError, match="nprobe must be"):
        set_search_params(ivf, nprobe=-1)


def id_subset_index(gallery, ids):
    """An exact index over gallery[ids] that answers with the original ids: a hand-made
    'approximate' index that can only ever find the items in ids."""
    index = faiss.IndexIDMap(faiss.IndexFlatIP(gallery.shape[1]))
    index.add_with_ids(gallery[ids], np.asarray(ids, dtype=np.int64))
    return index


def test_recall_vs_exact_on_hand_built_cases():
    gallery = np.array([[4.0, 0.0], [3.0, 0.0], [2.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    queries = np.array([[1.0, 0.0], [-1.0, 0.0]], dtype=np.float32)
    exact = build_index(gallery)  # top-2: {0, 1} for the first query, {3, 2} for the second
    assert recall_vs_exact(exact, exact, queries, k=2) == 1.0
    assert recall_vs_exact(build_index(gallery), exact, queries, k=4) == 1.0
    missing_0 = id_subset_index(gallery, [1, 2, 3])  # top-2: {1, 2} and {3, 2}
    assert recall_vs_exact(missing_0, exact, queries, k=2) == pytest.approx((1 / 2 + 1) / 2)
    assert recall_vs_exact(missing_0, exact, queries[:1], k=1) == 0.0  # item 0 is the best
    assert recall_vs_exact(missing_0, exact, queries, k=4) == pytest.approx(3 / 4)  # k capped
    only_0 = id_subset_index(gallery, [0])  # one item: pads nothing, finds 0 only
    assert recall_vs_exact(only_0, exact, queries, k=2) == pytest.approx((1 / 2 + 0) / 2)
    with pytest.raises(ValueError, match="2-d and 3-d"):
        recall_vs_exact(exact, build_index(np.eye(3)), queries, k=1)


def test_recall_vs_exact_matches_brute_force(unit_data):
    gallery, queries = unit_data
    index = build_index(gallery, "ivf", nprobe=4)
    recall = recall_vs_exact(index, build_index(gallery), queries, 10)
    assert recall == pytest.approx(brute_force_recall(search(index, queries, 10)[1], gallery,
                                                      queries, 10))
    assert 0.0 < recall < 1.0


def test_index_tradeoff_rows():
    gallery, queries = random_embeddings(500, 32, seed=18), random_embeddings(20, 32, seed=19)
    rows = index_tradeoff(gallery, queries, k=5, warmup=1, repeats=3)
    configs = retrieval.DEFAULT_TRADEOFF_CONFIGS
    assert [row["kind"] for row in rows] == [kind for kind, _ in configs]
    assert {kind for kind, _ in configs} == {"flat", "ivf", "hnsw"}
    for row in rows:
        assert set(row) == {"kind", "params", "recall_at_k", "ms_per_query", "build_s"}
        assert 0.0 <= row["recall_at_k"] <= 1.0 and row["ms_per_query"] > 0 and row["build_s"] > 0
    assert rows[0]["params"] == {} and rows[0]["recall_at_k"] == 1.0
    nlist = 500 // 39
    ivf_rows = [row for row in rows if row["kind"] == "ivf"]
    assert [row["params"]["nprobe"] for row in ivf_rows] == [2, 8, nlist]  # 32 capped at nlist
    assert all(row["params"]["nlist"] == nlist for row in ivf_rows)
    assert ivf_rows[-1]["recall_at_k"] == 1.0  # every list probed
    hnsw = [row["params"] for row in rows if row["kind"] == "hnsw"]
    assert [p["ef_search"] for p in hnsw] == [16, 64, 256] and hnsw[0]["M"] == 32


def test_index_tradeoff_times_one_query_at_a_time(monkeypatch):
    gallery, queries = random_embeddings(200, 16, seed=20), random_embeddings(7, 16, seed=21)
    batch_sizes, timed = [], []
    real_search = faiss.IndexFlatIP.search

    def spy_search(self, x, k, *args, **kwargs):
        batch_sizes.append(len(x))
        return real_search(self, x, k, *args, **kwargs)

    def fake_benchmark(fn, *, warmup, repeats):  # runs fn as often, reports fixed times
        timed.append((warmup, repeats))
        for _ in range(warmup + repeats):
            fn()
        return TimingResult.from_times([4.0, 1.0, 2.0], "cpu")  # median 2 ms

    monkeypatch.setattr(faiss.IndexFlatIP, "search", spy_search)
    monkeypatch.setattr(retrieval, "benchmark", fake_benchmark)
    (row,) = index_tradeoff(gallery, queries, k=3, configs=[("flat", {})], warmup=2, repeats=9)
    assert timed == [(0, 1), (2, 9)]  # the build once, then the searches
    assert row["ms_per_query"] == 2.0 and row["build_s"] == 0.002
    assert batch_sizes.count(1) == 11 and batch_sizes.count(7) == 2  # timed: batches of one
    assert row["recall_at_k"] == 1.0


def test_index_tradeoff_errors():
    gallery = random_embeddings(100, 8, seed=22)
    with pytest.raises(ValueError, match=r"\(kind, params dict\) pair"):
        index_tradeoff(gallery, gallery[:3], configs=["ivf"])
    with pytest.raises(ValueError, match="unknown parameter"):
        index_tradeoff(gallery, gallery[:3], configs=[("ivf", {"ef_search": 4})])
    with pytest.raises(ValueError, match="at least one query"):
        index_tradeoff(gallery, torch.zeros(0, 8))
    with pytest.raises(ValueError, match="k must be"):
        index_tradeoff(gallery, gallery[:3], k=0)
