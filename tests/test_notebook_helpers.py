"""The notebook helpers: tiling keeps every caption with an original image, the table shows the numbers."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.notebook import plot_latency, recall_table, setup, tile_gallery, tile_rows


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
    assert all(big.image_ids[i] == test_split.image_ids[j] for i, j in zip(big.txt2img, test_split.txt2img))
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
    assert lines[1].split() == ["A", "12.3", "5.0", "8.7"] and lines[2].split() == ["B", "–", "7.2", "–"]


def test_plot_latency_draws_extrapolated_points_hollow():
    rows = [{"n": 10, "ms_per_query": 1.0, "measured": True}, {"n": 100, "ms_per_query": 9.0, "measured": True},
            {"n": 1000, "ms_per_query": 90.0, "measured": False}]
    ax = plot_latency({"slow": rows})
    lines = ax.get_lines()
    assert len(lines) == 2 and list(lines[1].get_xdata()) == [1000] and lines[1].get_markerfacecolor() == "none"


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
