"""Tests for course_lib.studies.index_scale: the gallery constructions against their definitions,
the GFLOP/s arithmetic against hand counts, storage sizes against FAISS's own serialisation and the
m * nbits / 8 rule, the study's configurations and skipping rule, one kind measured against
independent searches, and the smoke study end to end (10^5 items, as CI runs it)."""

from __future__ import annotations

import json
import math
import time

import faiss
import numpy as np
import pytest
import torch

import course_lib.studies.index_scale as index_scale
from course_lib.core.index_eval import topk_recall
from course_lib.core.retrieval import build_index
from course_lib.core.roofline import exact_search_flops, gflops
from course_lib.core.tiling import tile_rows
from course_lib.core.timing import TimingResult
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.studies.index_scale import (
    KINDS,
    code_bytes,
    index_bytes,
    measure_kind,
    mm_gflops,
    study_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def base_embeddings(n=300, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, dim)) * rng.uniform(0.5, 2.0, dim) + 3.0).astype(np.float32)


def test_tiled_gallery_keeps_the_real_rows_and_adds_scaled_noise():
    base = base_embeddings()
    gallery = tile_rows(base, 60_300, noise=0.25, seed=1)
    assert gallery.shape == (60_300, 8) and gallery.dtype == np.float32
    np.testing.assert_array_equal(gallery[:300], base)  # the real rows first, unchanged
    rows = np.arange(300, 60_300)
    noise = (gallery[300:] - base[rows % 300]) / base.std(axis=0)  # (n - N0, E) in units of std
    np.testing.assert_allclose(noise.std(axis=0), 0.25, rtol=0.03)  # noise * std per dimension
    np.testing.assert_allclose(noise.mean(axis=0), 0.0, atol=0.01)
    np.testing.assert_array_equal(tile_rows(base, 1000, noise=0.0)[300:600], base)  # exact tiles
    np.testing.assert_array_equal(tile_rows(base, 100), base[:100])  # fewer rows than N0
    np.testing.assert_array_equal(tile_rows(base, 5000, noise=0.25, seed=1),
                                  tile_rows(base, 5000, noise=0.25, seed=1))


def test_gaussian_gallery_matches_the_fitted_moments():
    base = base_embeddings(seed=2)
    base[:, 1] = 0.5 * base[:, 0] + 0.1 * base[:, 1]  # a correlation to reproduce
    gallery = tile_rows(base, 200_300, construction="gaussian", seed=3)
    np.testing.assert_array_equal(gallery[:300], base)
    drawn = gallery[300:].astype(np.float64)
    np.testing.assert_allclose(drawn.mean(axis=0), base.mean(axis=0), atol=0.02)
    np.testing.assert_allclose(np.cov(drawn, rowvar=False), np.cov(base, rowvar=False), atol=0.03)


def test_gallery_errors():
    base = base_embeddings()
    with pytest.raises(ValueError, match="'tiled' or 'gaussian'"):
        tile_rows(base, 10, construction="uniform")
    with pytest.raises(ValueError, match="n >= 1 and noise >= 0"):
        tile_rows(base, 0)
    with pytest.raises(ValueError, match="n >= 1 and noise >= 0"):
        tile_rows(base, 10, noise=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        tile_rows(np.full((3, 2), np.nan), 10, noise=0.25)


def test_flops_and_gflops_by_hand():
    assert exact_search_flops(2, 3, 4) == 48  # 2 x 3 scores, 4 multiplies + 4 adds each
    assert exact_search_flops(1000, 10**7, 64) == 1_280_000_000_000
    assert gflops(2e9, 1000.0) == pytest.approx(2.0)
    assert gflops(48, 1e-6) == pytest.approx(48.0)  # 48 flops in a nanosecond
    with pytest.raises(ValueError, match="positive"):
        gflops(1.0, 0.0)


def test_mm_gflops_multiplies_every_block_and_counts_by_hand(monkeypatch):
    queries = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    gallery = np.random.default_rng(5).standard_normal((10, 4)).astype(np.float32)
    monkeypatch.setattr(index_scale, "CHUNK", 4)  # blocks of 4, 4 and 2 gallery rows
    blocks, real_mm = [], torch.mm

    def spy_mm(a, b, out):
        blocks.append(b.T.clone())
        return real_mm(a, b, out=out)

    def fake_measure(fn, *, warmup, repeats):
        for _ in range(warmup + repeats):
            fn()
        return TimingResult.from_times([2.0] * repeats, "cpu")  # 2 ms per pass

    monkeypatch.setattr(index_scale.torch, "mm", spy_mm)
    monkeypatch.setattr(index_scale, "measure", fake_measure)
    rate = mm_gflops(queries, gallery)
    assert rate == pytest.approx(2 * 3 * 10 * 4 / 2e-3 / 1e9)  # 240 flops in 2 ms
    # a warm-up block, then passes over the gallery (the 2 ms pass is under a second: timed 1 + 3)
    passes = blocks[1:]
    assert len(passes) == 4 * 3
    np.testing.assert_array_equal(torch.cat(passes[:3]).numpy(), gallery)


def test_storage_sizes():
    gallery = np.random.default_rng(6).standard_normal((12_000, 16)).astype(np.float32)
    for kind, params, code in [("flat", {}, 64), ("ivf", {"nlist": 16}, 64), ("hnsw", {"M": 8}, 64),
                               ("ivfpq", {"nlist": 16, "m": 8, "nbits": 8}, 8),
                               ("ivfpq", {"nlist": 16, "m": 8, "nbits": 4}, 4),
                               ("hnswpq", {"M": 8, "m": 4, "nbits": 8}, 4)]:
        index = build_index(gallery, kind, **params)
        assert code_bytes(index) == code  # float32: 4 * 16; PQ: m * nbits / 8
        assert index_bytes(index) == len(faiss.serialize_index(index))
    # what one more item costs in an IVF-PQ index: its code and its 8-byte id, nothing else
    small = build_index(gallery[:6000], "ivfpq", train_size=6000, nlist=16, m=8, nbits=4)
    large = build_index(gallery, "ivfpq", train_size=6000, nlist=16, m=8, nbits=4)
    assert index_bytes(large) - index_bytes(small) == 6000 * (8 * 4 // 8 + 8)


def test_study_config():
    assert study_config("ivf", 100_000)[0]["nlist"] == 316  # sqrt(n) ...
    assert (study_config("ivfpq", 10**6)
            == ({"nlist": 1000, "nprobe": 16, "m": 16, "nbits": 8}, 50_000))
    assert study_config("ivf", 10**7)[0]["nlist"] == index_scale.NLIST_CAP  # ... capped
    assert study_config("ivf", 1000)[0]["nlist"] == 25  # never above n // 39
    assert study_config("flat", 10) == ({}, None)
    assert study_config("hnswpq", 10**6)[1] == index_scale.PQ_TRAIN
    with pytest.raises(ValueError, match="unknown index kind 'lsh'"):
        study_config("lsh", 10)


def test_measure_kind_against_independent_searches():
    base = base_embeddings(200, 16, seed=7)
    gallery = tile_rows(base, 20_000, noise=0.25, seed=8)
    queries = np.ascontiguousarray(base[:30] + 0.1)  # (Q, E) float32
    exact = faiss.IndexFlatIP(16)
    exact.add(gallery)
    exact_ids = exact.search(queries, 10)[1]  # (Q, 10)
    row, points, ids = measure_kind(gallery, queries, None, "flat", k=10, repeats=5)
    np.testing.assert_array_equal(ids, exact_ids)
    assert row["recall_at_k"] == 1.0 and points == [] and row["code_bytes"] == 64
    row, points, ids = measure_kind(gallery, queries, exact_ids, "ivf", k=10, repeats=5)
    assert row["params"] == {"nlist": 141, "nprobe": 16} and row["train_size"] == 50 * 141
    assert row["recall_at_k"] == topk_recall(ids, exact_ids)
    ivf_bytes = index_bytes(build_index(gallery, "ivf", nlist=141))
    assert row["bytes_per_item"] == pytest.approx(ivf_bytes / 20_000, rel=1e-3)
    assert [p["value"] for p in points] == list(index_scale.SWEEP["ivf"][1])
    main = next(p for p in points if p["value"] == 16)  # the default setting: the main row itself
    assert main["recall_at_k"] == row["recall_at_k"] and main["ms_single"] == row["ms_single"]
    recalls = [p["recall_at_k"] for p in points]
    assert recalls == sorted(recalls) and recalls[0] < recalls[-1]  # probing more never loses
    for r in [row, *points]:
        assert r["ms_single"] >= 0 and r["ms_batched"] >= 0 and r["single_repeats"] >= 5


def fake_embeddings(smoke, checkpoints, seed, n_queries, progress):
    base = base_embeddings(500, 16, seed=9)
    return base, np.ascontiguousarray(base[:n_queries] + 0.05), "fake embeddings"


def test_run_skips_a_kind_whose_build_would_take_too_long(monkeypatch, tmp_path):
    monkeypatch.setattr(index_scale, "load_embeddings", fake_embeddings)
    results = index_scale.run([4000, 8000], kinds=["hnsw", "ivf"], n_queries=20, repeats=5,
                              # < any build time, 0 s included
                              max_build_s=-1.0, out=tmp_path, progress=False)
    assert [(r["kind"], r["n"]) for r in results["indexes"]] == [("flat", 4000), ("ivf", 4000),
                                                                ("hnsw", 4000), ("flat", 8000)]
    assert [(s["kind"], s["n"]) for s in results["skipped"]] == [("ivf", 8000), ("hnsw", 8000)]
    ivf, hnsw = results["indexes"][1]["build_s"], results["indexes"][2]["build_s"]
    predicted = hnsw * 8000 * math.log(8000) / (4000 * math.log(4000))  # n log n, by hand
    assert f"about {predicted:.0f} s" in results["skipped"][1]["reason"]
    assert f"about {ivf * 2:.0f} s" in results["skipped"][0]["reason"]  # IVF: linear in n
    assert "at n=4,000 scaled as n)" in results["skipped"][0]["reason"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["skipped"] == results["skipped"]
    assert "skipped: its build would take" in (tmp_path / "results.md").read_text()
    assert (faiss.cvar.distance_compute_blas_threshold
            == results["meta"]["blas_threshold"]["faiss_default"])


def test_smoke_study_end_to_end(tmp_path):
    start = time.perf_counter()
    results = index_scale.main(["--smoke", "--out", str(tmp_path), "--checkpoints",
                                str(tmp_path / "none")])
    seconds = time.perf_counter() - start
    meta = results["meta"]
    assert meta["sizes"] == [100_000] and meta["queries"] == 100 and meta["mode"] == "smoke"
    assert meta["torch_threads"] == meta["faiss_threads"] == 1
    # no checkpoint
    assert meta["embeddings"].startswith("random-weight LightningDOT (smoke config")
    assert [r["kind"] for r in results["indexes"]] == list(KINDS)
    rows = {r["kind"]: r for r in results["indexes"]}
    # the embedding's dimension E: float32 codes of 4 E bytes
    width = LightningDOTConfig.smoke().hidden
    assert rows["flat"]["recall_at_k"] == 1.0 and rows["flat"]["code_bytes"] == 4 * width
    assert rows["ivfpq"]["code_bytes"] == rows["hnswpq"]["code_bytes"] == 16
    assert rows["ivfpq"]["bytes_per_item"] < 32 and rows["hnsw"]["bytes_per_item"] > 4 * width
    for r in results["indexes"] + results["sweep"]:
        assert 0.0 <= r["recall_at_k"] <= 1.0 and r["ms_single"] >= 0 and r["ms_batched"] >= 0
    assert {(p["kind"], p["knob"]) for p in results["sweep"]} == {
        ("ivf", "nprobe"), ("ivfpq", "nprobe"), ("hnsw", "ef_search"), ("hnswpq", "ef_search")}
    (exact,) = results["exact_vs_mm"]
    assert exact["gflop"] == pytest.approx(2 * 100 * 100_000 * width / 1e9)
    assert exact["fraction"] == pytest.approx(exact["faiss_gflops"] / exact["mm_gflops"])
    assert exact["default_ms"] >= 0 and 0 < exact["fraction"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["sizes"] == [100_000]
    markdown = (tmp_path / "results.md").read_text()
    for heading in ("| n | index | parameters |", "**Storage**", "**Recall vs latency**",
                    "**Exact batched search vs matrix multiply**"):
        assert heading in markdown
    print(f"smoke study: {seconds:.1f} s")  # CI budget: well under a minute on one thread
