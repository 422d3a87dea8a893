"""Tests for course_lib.core.metrics against independent loop references and hand-worked cases."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib.core.metrics import (
    coco_1k_metrics,
    format_metrics,
    metrics_from_ranks,
    retrieval_metrics,
    retrieval_ranks,
)


# --------------------------------------------------------------------------------------- references
def naive_ranks(sims: np.ndarray, txt2img) -> tuple[list[int], list[int]]:
    """Ranks with plain Python loops: rank = number of wrong candidates scoring at least as high
    (for i2t, as the image's best caption: the best over its captions of that count)."""
    n_images, n_texts = sims.shape
    i2t = []
    for i in range(n_images):
        best = None
        for j in range(n_texts):
            if txt2img[j] != i:
                continue
            rank = sum(1 for other in range(n_texts)
                       if txt2img[other] != i and sims[i, other] >= sims[i, j])
            best = rank if best is None else min(best, rank)
        i2t.append(best)
    t2i = []
    for j in range(n_texts):
        true_score = sims[txt2img[j], j]
        t2i.append(sum(1 for other in range(n_images)
                       if other != txt2img[j] and sims[other, j] >= true_score))
    return i2t, t2i


def naive_metrics(sims: np.ndarray, txt2img, ks) -> dict[str, float]:
    i2t, t2i = naive_ranks(sims, txt2img)
    out, recalls = {}, []
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in ks:
            out[f"{name}_r{k}"] = 100.0 * sum(r < k for r in ranks) / len(ranks)
            recalls.append(out[f"{name}_r{k}"])
        ordered = sorted(ranks)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        out[f"{name}_medr"] = float(int(median) + 1)
        out[f"{name}_meanr"] = sum(ranks) / len(ranks) + 1
    out["rsum"] = sum(recalls)
    out["ar"] = sum(recalls) / len(recalls)
    return out


def vsepp_argsort_ranks(sims: np.ndarray, captions_per_image: int):
    """The VSE++ evaluation code's way (argsort per row); equals ours when scores are distinct."""
    n_images = sims.shape[0]
    i2t = np.zeros(n_images, dtype=int)
    for i in range(n_images):
        order = np.argsort(sims[i])[::-1]
        i2t[i] = min(np.where(order == j)[0][0]
                     for j in range(captions_per_image * i, captions_per_image * (i + 1)))
    t2i = np.zeros(sims.shape[1], dtype=int)
    for j in range(sims.shape[1]):
        order = np.argsort(sims[:, j])[::-1]
        t2i[j] = np.where(order == j // captions_per_image)[0][0]
    return i2t, t2i


def assert_same_metrics(got: dict, expected: dict):
    assert set(expected) <= set(got)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


# -------------------------------------------------------------------------------------- hand-worked
def test_hand_worked_two_images_four_captions():
    # Captions 0, 1 describe image 0; captions 2, 3 describe image 1.
    sims = np.array([[0.9, 0.1, 0.8, 0.3],
                     [0.2, 0.7, 0.6, 0.5]])
    txt2img = [0, 0, 1, 1]
    # i2t: image 0's best caption is 0 (0.9), nothing beats it -> rank 0.
    #      image 1's best caption is 2 (0.6); caption 1 (0.7) beats it -> rank 1.
    # t2i: text 0: column (0.9, 0.2), true 0.9 -> 0;  text 1: (0.1, 0.7), true 0.1 -> 1;
    #      text 2: (0.8, 0.6), true 0.6 -> 1;         text 3: (0.3, 0.5), true 0.5 -> 0.
    # So R@1 = 50 both ways, R@5 = R@10 = 100; median of {0, 1} is 0.5 -> floor + 1 = 1;
    # mean rank 0.5 -> meanr 1.5; rsum = 50+100+100+50+100+100 = 500; ar = 500/6.
    m = retrieval_metrics(sims, txt2img)
    i2t, t2i = retrieval_ranks(sims, txt2img)
    assert i2t.tolist() == [0, 1] and t2i.tolist() == [0, 1, 1, 0]
    expected = {"i2t_r1": 50.0, "i2t_r5": 100.0, "i2t_r10": 100.0, "i2t_medr": 1.0,
                "i2t_meanr": 1.5, "t2i_r1": 50.0, "t2i_r5": 100.0, "t2i_r10": 100.0,
                "t2i_medr": 1.0, "t2i_meanr": 1.5, "rsum": 500.0, "ar": 500.0 / 6}
    assert_same_metrics(m, expected)


def test_ties_are_counted_pessimistically():
    # Image 0's caption ties with caption 1 (0.5 vs 0.5): a wrong caption scoring as high counts
    # as ahead, so image 0 gets rank 1, and so does text 0 against image 1 (column 0.5 vs 0.5).
    # Image 1: caption 1 scores 0.2 and caption 0 beats it -> rank 1; text 1 likewise rank 1.
    sims = np.array([[0.5, 0.5],
                     [0.5, 0.2]])
    i2t, t2i = retrieval_ranks(sims, [0, 1])
    assert i2t.tolist() == [1, 1] and t2i.tolist() == [1, 1]


def test_own_captions_tied_with_the_best_are_not_counted_against_it():
    # image 0's two captions tie at 0.9; the only wrong caption scores 0.9 too -> rank 1, not 2
    sims = np.array([[0.9, 0.9, 0.9],
                     [0.0, 0.0, 1.0]])
    i2t, _ = retrieval_ranks(sims, [0, 0, 1])
    assert i2t.tolist() == [1, 0]


@pytest.mark.parametrize("n_images", [2, 10, 37])
def test_a_constant_score_matrix_is_at_chance_or_worse(n_images):
    # a collapsed model gives every pair one score: it must not look perfect (it did, R@1 100,
    # when ties counted optimistically)
    txt2img = np.repeat(np.arange(n_images), 5)
    m = retrieval_metrics(np.zeros((n_images, 5 * n_images), dtype=np.float32), txt2img, ks=(1,))
    assert m["t2i_r1"] <= 100.0 / n_images and m["i2t_r1"] <= 100.0 * 5 / (5 * n_images - 4)
    assert m["t2i_r1"] == 0.0 and m["i2t_r1"] == 0.0  # the stated rule: every truth ranked last


def test_k_larger_than_gallery_gives_full_recall():
    sims = np.random.default_rng(0).normal(size=(3, 6))
    m = retrieval_metrics(sims, [0, 0, 1, 1, 2, 2], ks=(1, 50))
    assert m["i2t_r50"] == 100.0 and m["t2i_r50"] == 100.0


# --------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("n_images,ks", [(12, (1, 5, 10)), (40, (5, 10, 20)), (1, (1,))])
def test_five_captions_matches_naive_and_vsepp(n_images, ks):
    rng = np.random.default_rng(n_images)
    sims = rng.normal(size=(n_images, 5 * n_images))
    txt2img = np.repeat(np.arange(n_images), 5)
    got = retrieval_metrics(sims, txt2img, ks)
    assert_same_metrics(got, naive_metrics(sims, txt2img, ks))
    i2t, t2i = retrieval_ranks(sims, txt2img)
    ref_i2t, ref_t2i = vsepp_argsort_ranks(sims, 5)  # distinct scores: identical ranks
    assert i2t.tolist() == ref_i2t.tolist() and t2i.tolist() == ref_t2i.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ks", [(1, 5, 10), (5, 10, 20)])
def test_variable_captions_with_ties_matches_naive(seed, ks):
    rng = np.random.default_rng(seed)
    n_images = 25
    counts = rng.integers(1, 8, size=n_images)  # 1..7 captions per image
    txt2img = rng.permutation(np.repeat(np.arange(n_images), counts))  # captions in any order
    sims = np.round(rng.normal(size=(n_images, len(txt2img))), 1)  # rounding makes many ties
    assert_same_metrics(retrieval_metrics(sims, txt2img, ks), naive_metrics(sims, txt2img, ks))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_chunked_equals_unchunked(chunk_size):
    rng = np.random.default_rng(5)
    sims = np.round(rng.normal(size=(20, 100)), 1).astype(np.float32)
    txt2img = np.repeat(np.arange(20), 5)
    whole = retrieval_ranks(sims, txt2img)
    chunked = retrieval_ranks(sims, txt2img, chunk_size=chunk_size)
    assert all((a == b).all() for a, b in zip(whole, chunked, strict=True))
    assert (retrieval_metrics(sims, txt2img, chunk_size=chunk_size)
            == retrieval_metrics(sims, txt2img))


def test_torch_and_numpy_agree_across_dtypes_and_layouts():
    rng = np.random.default_rng(3)
    sims = np.round(rng.normal(size=(15, 75)), 2).astype(np.float16)
    txt2img = np.repeat(np.arange(15), 5)
    reference = retrieval_metrics(sims, txt2img)
    tensor = torch.from_numpy(sims.astype(np.float32)).requires_grad_(True)
    assert retrieval_metrics(tensor, torch.from_numpy(txt2img)) == reference
    assert retrieval_metrics(tensor.half(), txt2img.tolist()) == reference
    assert retrieval_metrics(tensor.double(), txt2img) == reference
    # Transposed storage, negative strides and read-only arrays are read without complaint.
    assert retrieval_metrics(np.asfortranarray(sims), txt2img) == reference
    flipped = sims[::-1]
    assert retrieval_metrics(flipped, (14 - txt2img)) == reference
    frozen = sims.copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert retrieval_metrics(frozen, txt2img) == reference


def test_metrics_from_ranks_keys_and_sums():
    m = metrics_from_ranks(np.array([0, 3, 9]), np.array([0, 0, 1, 20]), ks=(1, 5, 10))
    # i2t: ranks 0, 3, 9 -> R@1 33.3, R@5 66.7, R@10 100; t2i: 0, 0, 1, 20 -> 50, 75, 75.
    assert m["i2t_r1"] == pytest.approx(100 / 3) and m["i2t_r5"] == pytest.approx(200 / 3)
    assert m["t2i_r1"] == 50.0 and m["t2i_r5"] == 75.0 and m["t2i_r10"] == 75.0
    assert m["rsum"] == pytest.approx(100 / 3 + 200 / 3 + 100 + 50 + 75 + 75)
    assert m["ar"] == pytest.approx(m["rsum"] / 6)
    assert m["i2t_medr"] == 4.0 and m["t2i_medr"] == 1.0  # medians 3 and 0.5


# ------------------------------------------------------------------------------------------ COCO 1K
def test_coco_1k_is_the_mean_over_sequential_folds():
    rng = np.random.default_rng(7)
    n_images, n_folds = 50, 5
    counts = rng.integers(4, 7, size=n_images)
    txt2img = rng.permutation(np.repeat(np.arange(n_images), counts))
    sims = rng.normal(size=(n_images, len(txt2img)))
    ks = (1, 5, 10)
    folds = []
    for f in range(n_folds):
        images = np.arange(f * 10, (f + 1) * 10)
        texts = np.flatnonzero(np.isin(txt2img, images))
        folds.append(naive_metrics(sims[images][:, texts], txt2img[texts] - f * 10, ks))
    got = coco_1k_metrics(sims, txt2img, n_folds=n_folds, ks=ks)
    for key in folds[0]:
        if key not in ("rsum", "ar"):
            assert got[key] == pytest.approx(np.mean([m[key] for m in folds])), key
    recalls = [got[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks]
    assert got["rsum"] == pytest.approx(sum(recalls))  # not 6x: VSE++'s print bug not copied
    assert got["ar"] == pytest.approx(sum(recalls) / 6)
    assert coco_1k_metrics(torch.from_numpy(sims), txt2img, n_folds=n_folds) == pytest.approx(got)


def test_coco_1k_rejects_uneven_folds():
    with pytest.raises(ValueError, match="equal folds"):
        coco_1k_metrics(np.zeros((7, 7)), np.arange(7), n_folds=5)


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("sims,txt2img,ks,message", [
    (np.zeros(5), [0] * 5, (1,), "must be 2-D"),
    (np.zeros((2, 3, 4)), [0, 1, 1], (1,), "must be 2-D"),
    (np.zeros((2, 4)), [0, 0, 1], (1,), "3 entries but sims has 4 texts"),
    (np.zeros((2, 4)), [0, 0, 1, 2], (1,), r"must lie in \[0, 2\)"),
    (np.zeros((2, 4)), [0, 0, 1, -1], (1,), r"must lie in \[0, 2\)"),
    (np.zeros((3, 4)), [0, 0, 1, 1], (1,), r"no caption \(first: \[2\]\)"),
    (np.array([[0.0, np.nan], [0.0, 0.0]]), [0, 1], (1,), "NaN .*row 0"),
    (np.zeros((2, 2)), [0, 1], (), "ks is empty"),
    (np.zeros((2, 2)), [0, 1], (0,), ">= 1"),
    (np.zeros((2, 2)), [0.0, 1.0], (1,), "integer"),
])
def test_clear_errors(sims, txt2img, ks, message):
    with pytest.raises(ValueError, match=message):
        retrieval_metrics(sims, txt2img, ks)


def test_type_errors():
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        retrieval_metrics([[1.0, 0.0], [0.0, 1.0]], [0, 1])
    with pytest.raises(TypeError, match="floating-point"):
        retrieval_metrics(np.eye(2, dtype=int), [0, 1])


def test_format_metrics_one_line():
    m = retrieval_metrics(np.eye(3), [0, 1, 2], ks=(1, 5))
    line = format_metrics(m)
    assert "\n" not in line
    assert line == ("i2t R@1/5 100.0/100.0 medr 1 | t2i R@1/5 100.0/100.0 medr 1 | "
                    "rsum 400.0 AR 100.0")


# -------------------------------------------------------------------------------------------- scale
_SCALE_SCRIPT = textwrap.dedent("""
    import json, resource, time
    import numpy as np
    from course_lib.core.metrics import retrieval_metrics

    def rss_mb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) / 1024

    n_images, n_texts = 5000, 25000  # COCO 5K test: 5k images x 25k captions, float32 = 500 MB
    rng = np.random.default_rng(0)
    sims = np.empty((n_images, n_texts), dtype=np.float32)
    for start in range(0, n_images, 250):  # filled in slices: no big temporaries
        rng.random(out=sims[start:start + 250], dtype=np.float32)
    txt2img = np.repeat(np.arange(n_images), 5)
    retrieval_metrics(sims[:50, :250], txt2img[:250])  # warm up torch's kernels
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = rss_mb("VmRSS")
    start = time.perf_counter()
    m = retrieval_metrics(sims, txt2img)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "extra_mb": rss_mb("VmHWM") - before,
                      "input_mb": sims.nbytes / 2**20, "t2i_r10": m["t2i_r10"]}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_coco_5k_scale_memory_and_time():
    done = subprocess.run([sys.executable, "-c", _SCALE_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n5k x 25k float32: {report['seconds']:.2f} s, extra peak {report['extra_mb']:.0f} MB")
    assert report["extra_mb"] < 300, report
    assert report["seconds"] < 20, report
    assert 0 <= report["t2i_r10"] <= 100


def test_t2i_ranks_of_sampled_queries_match_the_full_evaluation():
    # a sample of text queries against the whole gallery gives those texts' ranks in the full matrix
    from course_lib.core.metrics import recall_at_k, retrieval_ranks, t2i_ranks

    rng = np.random.default_rng(5)
    sims = rng.normal(size=(40, 200)).round(1).astype(np.float32)  # ties included
    txt2img = np.repeat(np.arange(40), 5)
    full = retrieval_ranks(sims, txt2img)[1]
    sample = rng.choice(200, size=30, replace=False)
    assert np.array_equal(t2i_ranks(sims[:, sample], txt2img[sample]), full[sample])
    # independent loop
    loop = [sum(sims[i, t] >= sims[txt2img[t], t] for i in range(40) if i != txt2img[t])
            for t in sample]
    assert np.array_equal(t2i_ranks(sims[:, sample], txt2img[sample], chunk_size=7), loop)
    assert recall_at_k([0, 3, 12], (1, 5)) == {1: pytest.approx(100 / 3), 5: pytest.approx(200 / 3)}


def test_query_subsets_rank_those_queries_against_the_whole_gallery():
    # the full setting: some texts / images are queries, every image / caption is a candidate
    rng = np.random.default_rng(11)
    sims = rng.normal(size=(30, 150)).round(1).astype(np.float32)
    txt2img = np.repeat(np.arange(30), 5)
    i2t, t2i = retrieval_ranks(sims, txt2img)
    q_txt, q_img = np.arange(100, 150), np.arange(20, 30)
    sub_i2t, sub_t2i = retrieval_ranks(sims, txt2img, query_texts=q_txt, query_images=q_img,
                                       chunk_size=4)
    assert np.array_equal(sub_t2i, t2i[q_txt]) and np.array_equal(sub_i2t, i2t[q_img])
    m = retrieval_metrics(sims, txt2img, query_texts=q_txt, query_images=q_img)
    assert m == metrics_from_ranks(i2t[q_img], t2i[q_txt])
    with pytest.raises(ValueError, match="query_texts"):
        retrieval_ranks(sims, txt2img, query_texts=[150])


def test_ranks_from_top_k_match_the_dense_ranks():
    from course_lib.core.metrics import ranks_from_top_k

    rng = np.random.default_rng(3)
    sims = torch.from_numpy(rng.normal(size=(25, 125)).round(1).astype(np.float32))
    txt2img = np.repeat(np.arange(25), 5)
    i2t, t2i = retrieval_ranks(sims, txt2img)
    k = 10
    top = torch.topk(sims.T, k, dim=1)  # t2i lists (T, k)
    got = ranks_from_top_k(top.values, top.indices == torch.from_numpy(txt2img)[:, None])
    # equal wherever the dense rank is below k and the list boundary does not cut a tie
    boundary_tie = (sims.T >= top.values[:, -1:]).sum(1) > k
    clean = ~boundary_tie.numpy()
    assert np.array_equal(got[clean & (t2i < k)], t2i[clean & (t2i < k)])
    assert (got[clean & (t2i >= k)] == k).all() and clean.mean() > 0.5
    top = torch.topk(sims, k, dim=1)  # i2t lists (N, k)
    got = ranks_from_top_k(top.values,
                           torch.from_numpy(txt2img)[top.indices] == torch.arange(25)[:, None])
    boundary_tie = (sims >= top.values[:, -1:]).sum(1) > k
    clean = ~boundary_tie.numpy()
    assert np.array_equal(got[clean & (i2t < k)], i2t[clean & (i2t < k)])
    assert (got[clean & (i2t >= k)] == k).all() and clean.mean() > 0.5


def test_checked_queries_names_the_problem():
    from course_lib.core.metrics import checked_queries

    assert checked_queries(None, 5, "q") is None
    assert checked_queries(torch.tensor([4, 0]), 5, "q").tolist() == [4, 0]
    with pytest.raises(ValueError, match=r"q must index \[0, 5\)"):
        checked_queries([5], 5, "q")
    with pytest.raises(ValueError, match="1-D vector"):
        checked_queries([[1]], 5, "q")
