"""The pixel stem: per-cell targets against a hand-worked scene, the heads' shapes, learning on a
tiny benchmark, the cache (a second call loads, config and code change the name) and bad configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.core.train import Trainer
from course_lib.data.scenes import Scenes
from course_lib.methods import pixel_stem
from course_lib.methods.pixel_stem import (
    CellDataset,
    PixelStem,
    PixelStemConfig,
    cell_accuracy,
    cell_targets,
    pixel_stem_stage,
    train_pixel_stem,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = {"n_train": 40, "n_val": 60, "n_test": 10, "n_pretrain": 400, "n_compositional": 1}
TINY = {"channels": (8, 16, 16), "batch_size": 32, "lr": 3e-3}


def test_cell_targets_by_hand():
    """Scene 0: a big green triangle in the centre (cell 4) and a small cyan circle bottom right
    (cell 8), slot 2 empty; scene 1: a small yellow ring top left (cell 0)."""
    scenes = Scenes(shape=np.array([[2, 0, -1], [5, -1, -1]], np.int8),
                    color=np.array([[1, 7, -1], [3, -1, -1]], np.int8),
                    size=np.array([[1, 0, -1], [0, -1, -1]], np.int8),
                    cell=np.array([[4, 8, -1], [0, -1, -1]], np.int8),
                    n_objects=np.array([2, 1], np.int8))
    _ = -1
    got = cell_targets(scenes)
    # 0 empty, else 1 + shape * 8 + colour: triangle green 1 + 2 * 8 + 1, circle cyan 1 + 0 +
    # 7, ring yellow 1 + 40 + 3
    assert got["object"].tolist() == [[0, 0, 0, 0, 18, 0, 0, 0, 8], [44, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert got["size"].tolist() == [[_, _, _, _, 1, _, _, _, 0], [0, _, _, _, _, _, _, _, _]]
    assert cell_targets(scenes, rows=[1])["object"].tolist() == got["object"][1:].tolist()


def test_dataset_matches_the_ground_truth_and_heads_have_their_shapes(bench):
    data = CellDataset(bench["pretrain"])
    item = data[3]
    assert item["pixels"].shape == (3, 32, 32)
    assert int((item["object"] > 0).sum()) == int(bench["pretrain"].scenes.n_objects[3])
    for pool in ("flatten", "cells"):
        stem = PixelStem(PixelStemConfig(**TINY, head_pool=pool))
        out = stem(torch.stack([data[i]["pixels"] for i in range(5)]))
        assert ({k: tuple(v.shape) for k, v in out.items()}
                == {"object": (5, 9, 49), "size": (5, 9, 2)})


@pytest.fixture(scope="module")
def trained(bench, tmp_path_factory):
    config = PixelStemConfig(**TINY, max_steps=300)
    path = tmp_path_factory.mktemp("stem") / pixel_stem_stage(bench, config).file_name
    stem, history = train_pixel_stem(bench, config, checkpoint_path=path, progress=False)
    return config, path, stem, history


def test_stem_learns_above_chance(trained, bench):
    config, _, stem, history = trained
    torch.manual_seed(config.seed)
    before = cell_accuracy(PixelStem(config), bench["val"])
    after = cell_accuracy(stem, bench["val"])
    # evaluated on val at the end
    assert history.rows(eval=True)[-1]["color"] == pytest.approx(after["color"])
    losses = history.column("loss", eval=False)
    assert losses[-1] < 0.5 * losses[0]
    assert after["occupancy"] > 58  # a constant guess: ~50 (4-5 objects in 9 cells)
    assert after["occupancy"] > before["occupancy"] + 8


def test_the_cache_loads_and_its_name_covers_config_data_and_code(trained, bench, monkeypatch):
    config, path, stem, history = trained
    assert path.exists() and path.name.startswith("pixel_stem-")

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stem checkpoint must be loaded, not retrained")

    monkeypatch.setattr(Trainer, "_train_step", no_training)
    again, again_history = train_pixel_stem(bench, config, checkpoint_path=path, progress=False)
    for a, b in zip(stem.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert again_history == history
    name = path.name
    other_lr = PixelStemConfig(**{**TINY, "lr": 1e-3}, max_steps=300)
    assert pixel_stem_stage(bench, other_lr).file_name != name
    assert pixel_stem_stage(bench, PixelStemConfig(**TINY, max_steps=301)).file_name != name
    assert pixel_stem_stage({"pretrain": bench["val"]}, config).file_name != name
    monkeypatch.setattr(pixel_stem, "STEM_FORMAT_VERSION", pixel_stem.STEM_FORMAT_VERSION + 1)
    assert pixel_stem_stage(bench, config).file_name != name


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="head_pool"):
        PixelStemConfig(head_pool="max")
    with pytest.raises(ValueError, match="channels"):
        PixelStemConfig(channels=(8, 16))
