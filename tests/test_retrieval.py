"""Tests for course_lib.core.retrieval: the exact FAISS index against torch brute force, input
handling (torch / numpy, 1-D queries, k larger than the gallery), storage sizes and errors; the
approximate IVF / HNSW indexes against brute force, recall_vs_exact on hand-built cases, and the
recall/latency table of index_tradeoff; the product-quantised kinds (IVF-PQ, HNSW-PQ) against
brute force, lossless on data a PQ can represent exactly, their code sizes and parameter checks;
training on a sample (train_size)."""

from __future__ import annotations

import warnings

import faiss
import numpy as np
import pytest
import torch

import course_lib.core.index_eval as index_eval
import course_lib.core.retrieval as retrieval
from course_lib.core.index_eval import (
    embedding_bytes,
    index_tradeoff,
    recall_vs_exact,
    time_single_queries,
    topk_recall,
)
from course_lib.core.retrieval import (
    INDEX_KINDS,
    as_float32_matrix,
    brute_force_topk,
    build_index,
    current_params,
    index_params,
    search,
    set_search_params,
)
from course_lib.core.timing import TimingResult


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
    with pytest.raises(ValueError, match=r"unknown index kind 'lsh'.*\['flat', 'hnsw', 'hnswpq', "
                                         r"'ivf', 'ivfpq'\]"):
        build_index(gallery, kind="lsh")
    assert set(INDEX_KINDS) == {"flat", "ivf", "hnsw", "ivfpq", "hnswpq"}
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
    return np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(result_idx, exact, strict=True)])


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
    assert index_params("ivfpq") == ["nlist", "nprobe", "m", "nbits"]
    assert index_params("hnswpq") == ["M", "ef_search", "ef_construction", "m", "nbits"]
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
    configs = index_eval.DEFAULT_TRADEOFF_CONFIGS
    assert [row["kind"] for row in rows] == [kind for kind, _ in configs]
    assert {kind for kind, _ in configs} == {"flat", "ivf", "hnsw"}
    for row in rows:
        assert set(row) == {"kind", "params", "recall_at_k", "ms_per_query", "build_s"}
        assert 0.0 <= row["recall_at_k"] <= 1.0 and row["ms_per_query"] >= 0 and row["build_s"] >= 0
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

    def fake_measure(fn, *, warmup, repeats):  # runs fn as often, reports fixed times
        timed.append((warmup, repeats))
        for _ in range(warmup + repeats):
            fn()
        return TimingResult.from_times([4.0, 1.0, 2.0], "cpu")  # median 2 ms

    monkeypatch.setattr(faiss.IndexFlatIP, "search", spy_search)
    monkeypatch.setattr(index_eval, "measure", fake_measure)
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


# ---- product quantisation, training samples ----------------------------------------------------

def lattice_gallery(n, n_sub, levels, seed):
    """(n, 2 * n_sub) float32 whose every 2-d sub-vector is one of `levels` fixed random points:
    a PQ with 2-d sub-vectors and at least `levels` centroids each represents it exactly."""
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((n_sub, levels, 2)).astype(np.float32)  # per sub-space
    picks = rng.integers(levels, size=(n, n_sub))  # (n, n_sub)
    return np.ascontiguousarray(points[np.arange(n_sub), picks].reshape(n, 2 * n_sub))


@pytest.mark.parametrize("kind, params", [("ivfpq", {"nlist": 1, "nprobe": 1}),
                                          ("hnswpq", {"ef_search": 64})])
def test_pq_codes_decode_to_the_vectors_where_they_can(kind, params):
    # 16 distinct sub-vectors per sub-space and 256 centroids: k-means puts a centroid on each, so
    # codes decode to the vectors themselves (IVF-PQ with one list codes x - mean, which takes 16
    # values per sub-space too) and every returned score is the true inner product. Up to 0.1%:
    # FAISS's k-means splits empty clusters by scaling a centroid by 1 +- 1/1024.
    gallery = lattice_gallery(10_000, 8, 16, seed=30)  # (10000, 16)
    queries = np.random.default_rng(31).standard_normal((20, 16)).astype(np.float32)
    scores, idx = search(build_index(gallery, kind, m=8, nbits=8, **params), queries, 10)
    true_scores = np.einsum("qe,qke->qk", queries, gallery[idx])  # (Q, k)
    np.testing.assert_allclose(scores, true_scores, rtol=3e-3, atol=1e-2)
    if kind == "ivfpq":  # one list, scanned whole, of exact codes: the exact top 10
        exact = brute_force_topk(torch.from_numpy(gallery), torch.from_numpy(queries), 10)
        np.testing.assert_allclose(scores, exact[0].numpy(), rtol=3e-3, atol=1e-2)
        assert brute_force_recall(idx, torch.from_numpy(gallery),
                                  torch.from_numpy(queries), 10) >= 0.95


@pytest.mark.parametrize("kind, params", [("ivfpq", {"nprobe": 64}), ("hnswpq", {"ef_search": 256}),
                                          ("hnswpq", {"M": 16, "ef_construction": 40})])
def test_pq_index_has_high_recall_at_generous_params(kind, params):
    # one number per sub-vector, 256 levels each: codes barely perturb the vectors. (Without
    # build_index's fix of its code-to-code table, HNSW-PQ reached 0.44 with M=16, 0.58 with M=32.)
    gallery, queries = random_embeddings(5000, 16, seed=32), random_embeddings(50, 16, seed=33)
    with warnings.catch_warnings():
        # 5000 < 39 * 256 training vectors: warned, tested elsewhere
        warnings.simplefilter("ignore")
        index = build_index(gallery, kind, m=16, nbits=8, **params)
    assert index.ntotal == 5000
    scores, idx = search(index, queries, k=10)
    assert brute_force_recall(idx, gallery, queries, 10) >= 0.9
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    true_scores = np.einsum("qe,qke->qk", queries.numpy(), gallery.numpy()[idx])  # (Q, k)
    errors = np.abs(scores - true_scores)  # approximate scores, but close (the tails of each
    assert errors.mean() < 0.005 and errors.max() < 0.05  # sub-space have fewer centroids)


def test_hnswpq_compares_nodes_by_inner_product():
    # the graph's node-to-node "distance" (negated by HNSW for inner product) must be the inner
    # product of the two decoded vectors, like the query-to-node one, not FAISS's squared L2
    gallery = random_embeddings(3000, 8, seed=43, normalize=False).numpy()
    index = build_index(gallery, "hnswpq", m=4, nbits=6)
    storage = faiss.downcast_index(index.storage)
    distances = storage.get_distance_computer()
    decoded = np.stack([storage.reconstruct(i) for i in range(20)])  # (20, 8)
    for i, j in [(0, 1), (2, 7), (5, 19), (3, 3)]:
        assert (distances.symmetric_dis(i, j)
                == pytest.approx(float(decoded[i] @ decoded[j]), rel=1e-5, abs=1e-5))


def test_pq_is_really_approximate():
    # 4-d sub-vectors of 16 centroids: 4 bytes for 64 floats, and a visible loss of recall
    gallery, queries = random_embeddings(2000, 32, seed=34), random_embeddings(50, 32, seed=35)
    index = build_index(gallery, "ivfpq", nlist=1, m=8, nbits=4)
    assert brute_force_recall(search(index, queries, 10)[1], gallery, queries, 10) < 0.8


@pytest.mark.parametrize("kind", ["ivfpq", "hnswpq"])
@pytest.mark.parametrize("m, nbits", [(16, 8), (8, 8), (8, 4), (4, 10)])
def test_pq_code_size_is_m_times_nbits_over_8(kind, m, nbits):
    gallery = random_embeddings(5000, 32, seed=36)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nbits=10 trains on < 39 vectors per centroid
        index = build_index(gallery, kind, m=m, nbits=nbits)
    pq = index.pq if kind == "ivfpq" else faiss.downcast_index(index.storage).pq
    assert (pq.M, pq.nbits, pq.code_size) == (m, nbits, m * nbits // 8)
    assert current_params(index)["m"] == m and current_params(index)["nbits"] == nbits


def test_pq_defaults_and_params():
    gallery = random_embeddings(10_000, 64, seed=37)
    ivfpq = build_index(gallery, "ivfpq")
    assert current_params(ivfpq) == {"nlist": 256, "nprobe": 8, "m": 16, "nbits": 8}  # 10000 // 39
    assert ivfpq.metric_type == faiss.METRIC_INNER_PRODUCT and ivfpq.code_size == 16
    hnswpq = build_index(gallery, "hnswpq", M=8, ef_search=20, ef_construction=30)
    assert current_params(hnswpq) == {"M": 8, "ef_search": 20, "ef_construction": 30,
                                      "m": 16, "nbits": 8}
    assert hnswpq.metric_type == faiss.METRIC_INNER_PRODUCT
    set_search_params(ivfpq, nprobe=32)  # the IVF / HNSW knobs work on the PQ kinds too
    set_search_params(hnswpq, ef_search=99)
    assert (ivfpq.nprobe, hnswpq.hnsw.efSearch) == (32, 99)
    with pytest.raises(ValueError, match="nprobe applies to IVF.*IndexHNSWPQ.*ef_search"):
        set_search_params(hnswpq, nprobe=4)
    # m defaults to dim / 4, or the largest divisor of dim below it
    for dim, m in [(64, 16), (32, 8), (30, 6), (7, 1), (3, 1)]:
        assert current_params(INDEX_KINDS["ivfpq"](dim, 20_000))["m"] == m


def test_pq_params_are_checked():
    gallery = random_embeddings(300, 12, seed=38)
    with pytest.raises(ValueError, match=r"m=5 sub-quantizers must divide the dimension 12"
                                         r".*\[1, 2, 3, 4, 6, 12\]"):
        build_index(gallery, "ivfpq", m=5)
    with pytest.raises(ValueError, match="m must be an integer >= 1"):
        build_index(gallery, "hnswpq", m=0)
    with pytest.raises(ValueError, match=r"nbits must be an integer in \[1, 16\], got 17"):
        build_index(gallery, "ivfpq", m=4, nbits=17)
    with pytest.raises(ValueError, match="nbits must be an integer >= 1"):
        build_index(gallery, "hnswpq", m=4, nbits=0)
    with pytest.raises(ValueError,
                       match=r"nbits=9 trains 512 centroids .* only 300 vectors.*nbits <= 8"):
        build_index(gallery, "ivfpq", m=4, nbits=9)
    with pytest.raises(ValueError, match=r"\['mm'\] for index kind 'hnswpq'"):
        build_index(gallery, "hnswpq", mm=4)
    with pytest.warns(UserWarning,
                      match=r"trained on 300 vectors, fewer than 39 per centroid \(9984\)"):
        build_index(gallery, "hnswpq", m=4, nbits=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough vectors: no warning
        build_index(gallery, "ivfpq", nlist=2, m=4, nbits=2)


def test_train_size_trains_on_a_sample():
    gallery = random_embeddings(2000, 16, seed=39)
    index = build_index(gallery, "ivf", train_size=500)
    assert index.ntotal == 2000  # every item is added ...
    assert index.nlist == 500 // 39 == 12  # ... but nlist is checked against the 500 that train
    queries = random_embeddings(10, 16, seed=40)
    set_search_params(index, nprobe=12)  # every list: exact whatever the centroids
    assert_same_topk(search(index, queries, 5), brute_force_topk(gallery, queries, 5))
    # the sample is fixed (seeded), and a train_size of at least N trains on everything
    centroids = [faiss.vector_to_array(faiss.downcast_index(built.quantizer).codes)
                 for built in (index, build_index(gallery, "ivf", train_size=500))]
    np.testing.assert_array_equal(*centroids)
    assert build_index(gallery, "ivf", train_size=5000).nlist == build_index(gallery, "ivf").nlist
    with pytest.raises(ValueError, match=r"nbits=8 trains 256 centroids .* only 100 vectors"):
        build_index(gallery, "hnswpq", train_size=100)
    with pytest.raises(ValueError, match="train_size must be an integer >= 1"):
        build_index(gallery, "ivf", train_size=0)
    assert build_index(gallery, "flat", train_size=10).ntotal == 2000  # nothing to train: ignored


def test_topk_recall_by_hand():
    exact = np.array([[0, 1, 2], [5, 6, 7]])
    assert topk_recall(exact, exact) == 1.0
    assert topk_recall(np.array([[2, 9, 0], [-1, -1, -1]]), exact) == pytest.approx((2 / 3 + 0) / 2)
    assert topk_recall(np.array([[1], [7]]), exact) == pytest.approx(1 / 3)  # fewer columns found
    with pytest.raises(ValueError, match="same Q queries"):
        topk_recall(exact[:1], exact)


def test_time_single_queries_searches_one_row_at_a_time(monkeypatch):
    index = build_index(random_embeddings(50, 8, seed=41))
    queries = random_embeddings(3, 8, seed=42).numpy()
    seen = []
    real_search = faiss.IndexFlatIP.search

    def recording_search(self, x, k, *a, **kw):
        seen.append((x.copy(), k))
        return real_search(self, x, k)

    monkeypatch.setattr(faiss.IndexFlatIP, "search", recording_search)
    result = time_single_queries(index, queries, k=100, warmup=1, repeats=4)
    assert result.repeats == 4
    assert [k for _, k in seen] == [50] * 5  # k capped at the gallery
    for i, (x, _) in enumerate(seen):  # cycling through the queries: 0, 1, 2, 0, 1
        np.testing.assert_array_equal(x, queries[i % 3:i % 3 + 1])


def test_blas_switch_is_set_and_restored():
    default = faiss.cvar.distance_compute_blas_threshold
    lowered = min(default, 10 * faiss.omp_get_max_threads())
    with retrieval.blas_switch(per_thread=10):
        assert faiss.cvar.distance_compute_blas_threshold == lowered
        with pytest.raises(RuntimeError), retrieval.blas_switch(per_thread=10**9):
            assert faiss.cvar.distance_compute_blas_threshold == lowered  # never raised by it
            raise RuntimeError  # and restored on the way out of an error
        assert faiss.cvar.distance_compute_blas_threshold == lowered
    assert faiss.cvar.distance_compute_blas_threshold == default
