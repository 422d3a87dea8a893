"""Notebook helpers: tiling keeps each caption with an original image; tables show the numbers."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch

from course_lib.core.tiling import tile_rows
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.notebook import plot_latency, recall_table, setup, tile_gallery


@pytest.fixture(scope="module")
def test_split():
    return make_benchmark(SyntheticConfig.smoke(n_train=20, n_val=5, n_test=12, n_pretrain=5,
                                                n_compositional=2), seed=1)["test"]


def test_tile_gallery_sizes_and_originals_last(test_split):
    small = tile_gallery(test_split, 5)
    assert small.n_images == 5 and small.image_ids == test_split.image_ids[:5]
    big = tile_gallery(test_split, 30)
    assert big.n_images == 30
    assert big.image_ids[-12:] == test_split.image_ids  # originals last, in order
    assert big.image_ids[:18] == [test_split.image_ids[i % 12] for i in range(18)]  # the copies
    assert big.captions == test_split.captions  # every caption kept, each with its original image
    assert all(big.image_ids[i] == test_split.image_ids[j]
               for i, j in zip(big.txt2img, test_split.txt2img, strict=True))
    with pytest.raises(ValueError, match="at least one image"):
        tile_gallery(test_split, 0)


def test_tile_rows():
    x = torch.arange(6).view(3, 2)
    assert tile_rows(x, 7).tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5], [0, 1]]


def test_recall_table_shows_each_number_and_missing_ones():
    table = recall_table({"A": {"i2t_r1": 12.34, "t2i_r1": 5.0, "ar": 8.67},
                          "B": {"i2t_r1": None, "t2i_r1": 7.25}})
    lines = table.splitlines()
    assert "i2t R@1" in lines[0] and "AR" in lines[0]
    assert (lines[1].split() == ["A", "12.3", "5.0", "8.7"]
            and lines[2].split() == ["B", "–", "7.2", "–"])


def test_plot_latency_draws_extrapolated_points_hollow():
    rows = [{"n": 10, "ms_per_query": 1.0, "measured": True},
            {"n": 100, "ms_per_query": 9.0, "measured": True},
            {"n": 1000, "ms_per_query": 90.0, "measured": False}]
    ax = plot_latency({"slow": rows})
    lines = ax.get_lines()
    assert (len(lines) == 2 and list(lines[1].get_xdata()) == [1000]
            and lines[1].get_markerfacecolor() == "none")


def test_setup_seeds_and_returns_a_device(capsys):
    threads = torch.get_num_threads()
    try:
        device = setup(seed=3, cpu_threads=1)
        assert torch.get_num_threads() == 1
        first = torch.rand(1)
        setup(seed=3, show=False)
        assert torch.equal(first, torch.rand(1)) and isinstance(device, torch.device)
        assert "torch" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)


def test_chance_recall_against_a_simulation():
    from course_lib.notebook import chance_recall

    rng = np.random.default_rng(0)
    for n, k, r in ((40, 1, 1), (40, 5, 1), (50, 1, 5), (50, 10, 5)):
        hits = [bool((rng.permutation(n)[:k] < r).any()) for _ in range(20_000)]
        assert chance_recall(n, k, r) == pytest.approx(100 * np.mean(hits), abs=1.0)
    assert chance_recall(1000, 1) == pytest.approx(0.1)
    assert chance_recall(10, 20) == 100.0


def test_compare_recalls_says_too_small_to_tell_at_chance():
    from course_lib.notebook import compare_recalls, near_chance

    # three models at chance (1 in 40) over 40 queries: no verdict, whatever the gap
    line = compare_recalls("t2i R@1", "A", 5.0, "B", 0.0, n=40, chance=2.5)
    assert "too small to tell" in line and "A higher" not in line
    assert near_chance(2.5, 40, 2.5) and not near_chance(47.0, 5000, 0.1)
    assert compare_recalls("R@1", "A", 47.2, "B", 7.0, n=5000, chance=0.1).endswith("A higher")
    same = compare_recalls("R@1", "A", 17.6, "B", 17.0, n=5000, chance=0.1)
    assert same.endswith("no clear difference")
    assert compare_recalls("R@1", "A", 10.0, "B", 30.0, n=5000).endswith("B higher")


def test_recovery_verdict_refuses_a_share_of_chance():
    from course_lib.notebook import recovery_verdict

    # issue 13: three models at chance (1 in 40) over 40 captions; "recovers
    # 100%" must not be claimed
    line, reached = recovery_verdict("rerank@1", 2.5, "cross-encoder", 2.5, n=40,
                                     target=95, chance=2.5)
    assert reached is None and "too small to tell" in line and "at least" not in line
    line, reached = recovery_verdict("rerank@1", 0.0, "cross-encoder", 0.0, n=40,
                                     target=95, chance=2.5)
    assert reached is None and "too small to tell" in line
    # a smoke run: 5.5 over 200 captions against chance 2.5 is within the noise of 5.5 itself
    line, reached = recovery_verdict("rerank@40", 5.5, "cross-encoder", 5.5, n=200,
                                     target=95, chance=2.5)
    assert reached is None and "too small to tell" in line
    # clear numbers: 5,000 queries, a cross-encoder at 20% against chance 0.1%
    line, reached = recovery_verdict("rerank@20", 19.5, "cross-encoder", 20.0, n=5000,
                                     target=95, chance=0.1)
    assert reached is True and "98%" in line and "at least the 95% target" in line
    line, reached = recovery_verdict("rerank@5", 18.8, "cross-encoder", 20.0, n=5000,
                                     target=95, chance=0.1)
    assert reached is False and "within noise" in line
    line, reached = recovery_verdict("rerank@1", 10.0, "cross-encoder", 20.0, n=5000,
                                     target=95, chance=0.1)
    assert reached is False and "clearly short" in line and "50%" in line


def test_compare_rates_needs_a_gap_beyond_noise():
    from course_lib.notebook import compare_rates

    # smoke-sized: 1.0% of 50 captions' mined negatives vs 0.6% at random is no evidence either way
    small = "too small to tell at these sizes"
    assert compare_rates("false negatives", "mined", 1.0, 50, "random", 0.6, 50).endswith(small)
    assert compare_rates("false negatives", "mined", 0.4, 50, "random", 1.0, 50).endswith(small)
    assert "no event" in compare_rates("fn", "mined", 0.0, 50, "random", 0.0, 50)
    line = compare_rates("false negatives", "mined", 12.0, 2000, "random", 3.0, 2000)
    assert line.endswith("mined higher") and "4.0x" in line
    assert compare_rates("fn", "mined", 1.0, 2000, "random", 6.0, 2000).endswith("random higher")


def test_compare_ar_says_too_small_to_tell_at_chance():
    from course_lib.notebook import chance_recall, compare_ar

    def metrics(i2t, t2i):
        return {f"{d}_r{k}": v[k] for d, v in (("i2t", i2t), ("t2i", t2i)) for k in (1, 5, 10)}

    n_images, n_texts = 100, 500
    at_chance = metrics({k: chance_recall(n_texts, k, 5) for k in (1, 5, 10)},
                        {k: chance_recall(n_images, k) for k in (1, 5, 10)})
    a_bit_above = {key: value + 2.0 for key, value in at_chance.items()}
    line = compare_ar("pre-training?", "PT", a_bit_above, "no PT", at_chance, n_images, n_texts)
    assert "too small to tell" in line and "PT higher" not in line
    good = metrics({1: 60.0, 5: 85.0, 10: 92.0}, {1: 45.0, 5: 75.0, 10: 85.0})
    better = {key: value + 6.0 for key, value in good.items()}
    assert compare_ar("q", "A", better, "B", good, 1000, 5000).endswith("A higher")
    assert compare_ar("q", "A", good, "B", good, 1000, 5000).endswith("no clear difference")


def test_check_verdict_refuses_chance_level_zero_and_extrapolated_evidence():
    # lessons 05-07 printed "met" for 0.4 vs 0.8 at chance, 0.0 vs 0.0 - 1,
    # and extrapolated speed-ups
    from course_lib.notebook import chance_recall, check_verdict

    chance = chance_recall(200, k=5)  # a smoke gallery's R@5 of a random ranking: 2.5
    small = "too small to tell"
    assert check_verdict(True, (0.4, 0.8), n=500, chance=chance).startswith(small)  # 05 (a)
    assert check_verdict(True, (0.0, 0.0), n=50, chance=1.0).startswith(small)  # 06 (a)
    assert check_verdict(True, measured=False).startswith(small)  # 07, extrapolated
    assert check_verdict(True, (40.0, 41.0), n=5000, chance=0.1) == "met"
    assert check_verdict(False, (20.0, 41.0), n=5000, chance=0.1) == "not met"


def test_curve_summary_reads_the_last_points_and_says_whether_val_still_rises():
    from course_lib.core.history import History
    from course_lib.notebook import curve_summary

    def history(*vals):
        return History([{"step": 100 * (i + 1), "eval": True, "cpu_seconds": 10.0 * (i + 1),
                         "val_t2i_r1": v, "train_t2i_r1": v + 5} for i, v in enumerate(vals)])

    # 15 points over 1,000 queries: far beyond the noise
    rising = curve_summary("a", history(5.0, 20.0))
    assert "after 200 steps (20 CPU-s of training) t2i R@1 val 20.0, train[:n] 25.0" in rising
    assert "still rising" in rising
    # 0.5 points: within the noise
    assert "flat within noise" in curve_summary("b", history(20.0, 20.5))
    # 5 points: beyond the noise of 1,000 queries (about 2.5), within that of 100 (about 8)
    assert "still rising" in curve_summary("g", history(20.0, 25.0))
    assert "flat within noise" in curve_summary("g", history(20.0, 25.0), n_queries=100)
    assert "rising" not in curve_summary("c", history(20.0))  # one point: no trend to read
    missed = curve_summary("e", history(5.0, 20.0), target=25)
    assert missed.endswith("; the target 25: missed by 5.0")
    assert curve_summary("f", history(20.0), target=20).endswith("; the target 20: met")
    assert "target" not in rising
    with pytest.raises(ValueError, match="learning_curve_splits"):
        curve_summary("d", History([{"step": 1, "loss": 1.0}]))
