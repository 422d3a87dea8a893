"""write_karpathy / load_synthetic round trips, and read_karpathy's options on the written files.

The reader on a hand-written Flickr30k / COCO fixture, with its error cases, is in
test_data_scripts.py.
"""

import json

import numpy as np
import pytest
from test_datasets import make_toy_split

from course_lib.data.datasets import read_image
from course_lib.data.karpathy import read_karpathy
from course_lib.data.split import concatenate
from course_lib.data.synthetic_files import load_synthetic, png_bytes, write_karpathy

ARRAY_FIELDS = ("txt2img", "images", "regions", "boxes", "region_mask", "region_classes")


def assert_same_split(got, want):
    """Every field that the data carries is identical (paths and info may differ)."""
    assert got.captions == want.captions
    assert got.image_ids == want.image_ids
    for name in ARRAY_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
    for name in ("scenes", "meanings"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            ta, tb = a.to_arrays(), b.to_arrays()
            assert ta.keys() == tb.keys()
            for key in ta:
                assert ta[key].dtype == tb[key].dtype, (name, key)
                np.testing.assert_array_equal(ta[key], tb[key], err_msg=f"{name}.{key}")


@pytest.fixture
def toy_splits():
    return {name: make_toy_split(n_images=n, seed=k, name=name)
            for k, (name, n) in enumerate([("train", 6), ("val", 3), ("test", 4)])}


def test_toy_round_trip_and_file_format(toy_splits, tmp_path):
    summary = write_karpathy(toy_splits, tmp_path)
    assert summary["n_images"] == 13 and summary["n_texts"] == 39 and summary["bytes"] > 0
    data = json.loads((tmp_path / "dataset_synthetic.json").read_text())
    assert data["dataset"] == "synthetic"
    assert [img["imgid"] for img in data["images"]] == list(range(13))
    sentids = [s["sentid"] for img in data["images"] for s in img["sentences"]]
    assert sorted(sentids) == list(range(39))
    first = data["images"][0]
    assert (first["split"] == "train" and first["filepath"] == "images"
            and first["filename"] == "train_0000.png")
    assert first["sentids"] == [s["sentid"] for s in first["sentences"]]
    assert all(s["imgid"] == 0 and s["tokens"] == s["raw"].split() for s in first["sentences"])
    assert (tmp_path / "images" / "test_0003.png").is_file()
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["splits"]["val"]["n_texts"] == 9 and info["seed"] == 0
    for name, split in toy_splits.items():
        back = load_synthetic(tmp_path, name)
        assert back.name == name and back.image_paths[0].endswith(".png")
        assert_same_split(back, split)  # toy captions are interleaved: the order must come back too
    full = load_synthetic(tmp_path, "full", load_pixels=False)
    assert full.images is None and full.n_images == 13
    want = concatenate(list(toy_splits.values()), "full")
    want.images = None
    assert_same_split(full, want)


def test_reader_options_on_written_files(toy_splits, tmp_path):
    write_karpathy(toy_splits, tmp_path)
    json_path = tmp_path / "dataset_synthetic.json"
    # without image_root: captions only, grouped by image as in the file
    plain = read_karpathy(json_path, split="test", captions_per_image=2)
    assert plain.image_paths is None and plain.images is None and plain.regions is None
    assert plain.n_texts == 8 and plain.txt2img.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plain.captions[:2] == [toy_splits["test"].captions[t] for t in (0, 4)]
    pooled = read_karpathy(json_path, tmp_path, split=("train", "val"), captions_per_image=None)
    assert pooled.name == "train+val" and pooled.n_images == 9 and pooled.n_texts == 27
    resized = read_karpathy(json_path, tmp_path, "val", load_pixels=True, image_size=(8, 10),
                            regions_file=tmp_path / "regions.npz")
    assert resized.images.shape == (3, 8, 10, 3) and resized.images.dtype == np.uint8
    np.testing.assert_array_equal(resized.boxes, toy_splits["val"].boxes)
    np.testing.assert_array_equal(read_image(resized.image_paths[1]), toy_splits["val"].images[1])


def test_writer_refuses_bad_input(toy_splits, tmp_path):
    toy_splits["test"].image_ids[0] = "train_0000"
    with pytest.raises(ValueError, match="unique"):
        write_karpathy(toy_splits, tmp_path)
    toy_splits["test"].images = None
    with pytest.raises(ValueError, match="no pixels"):
        write_karpathy({"test": toy_splits["test"]}, tmp_path)
    with pytest.raises(FileNotFoundError, match="make_synthetic.py"):
        load_synthetic(tmp_path / "nothing")


def test_unknown_split_in_load_synthetic(toy_splits, tmp_path):
    write_karpathy(toy_splits, tmp_path)
    with pytest.raises(ValueError, match=r"no split 'pretrain'.*\['test', 'train', 'val'\]"):
        load_synthetic(tmp_path, "pretrain")


@pytest.fixture(scope="module")
def synthetic_bench():
    synthetic = pytest.importorskip("course_lib.data.synthetic")
    cfg = synthetic.SyntheticConfig.smoke()
    return synthetic.make_benchmark(cfg, seed=0, progress=False)


def test_synthetic_round_trip_is_identical(synthetic_bench, tmp_path):
    write_karpathy(synthetic_bench, tmp_path)
    assert not (tmp_path / "images" / "full").exists()
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["seed"] == synthetic_bench["test"].info.get("seed")
    assert set(info["splits"]) == set(synthetic_bench) - {"full"}
    for name, split in synthetic_bench.items():
        back = load_synthetic(tmp_path, name)
        assert back.n_images == split.n_images and back.name == split.name
        assert_same_split(back, split)
        assert back.info.keys() == split.info.keys()
        assert (back.info["seed"] == split.info["seed"]
                and back.info["config"] == split.info["config"])
    comp = load_synthetic(tmp_path, "compositional", load_pixels=False)
    want = synthetic_bench["compositional"]
    for key, value in want.info.items():
        # array-valued info (twin_of, is_twin) comes back as arrays
        if isinstance(value, np.ndarray):
            assert comp.info[key].dtype == value.dtype
            np.testing.assert_array_equal(comp.info[key], value)


@pytest.mark.parametrize("shape", [(32, 32, 3), (7, 13, 3), (1, 1, 3)])
def test_png_bytes_is_lossless_for_pil(shape, tmp_path):
    pixels = np.random.default_rng(1).integers(0, 256, size=shape, dtype=np.uint8)
    (tmp_path / "x.png").write_bytes(png_bytes(pixels))
    back = read_image(tmp_path / "x.png")
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, pixels)
