"""data_scripts/extract_features.py end to end on a tiny Karpathy-format fixture written here.

Random-weight timm backbones (resnet18, a tiny ViT), on the CPU, offline. Features are checked
against independent computations: the same backbone run through
course_lib.core.encoders.PixelEncoder on the same pixels, grid pooling against a loop over hand-cut
bins, boxes against hand-worked values. Then the loaders read the files back, a resumed run must
give byte-identical files, and VSE++ / LightningDOT fit on the features unchanged (the bench dict is
the only switch).
"""

import json

import numpy as np
import pytest
import torch
from test_data_scripts import load_script

from course_lib.core.encoders import PixelEncoder
from course_lib.core.settings import seed_everything
from course_lib.data.datasets import pixels_to_tensor, read_image
from course_lib.data.features import load_feature_bench, read_pooled
from course_lib.data.karpathy import read_karpathy
from course_lib.data.split import RetrievalSplit
from course_lib.data.synthetic_files import write_karpathy
from course_lib.data.tokenizer import tokenizer_for

pytestmark = pytest.mark.usefixtures("one_thread")
extract = load_script("extract_features")

SIZES = {"train": 6, "val": 2, "test": 3}
WORDS = ["red", "blue", "green", "circle", "square", "left", "right", "big", "small"]
RESNET = ["--backbone", "resnet18", "--no-pretrained", "--image-size", "96", "--workers",
          "0", "--quiet"]
VIT_KWARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}
VIT = ["--backbone", "vit_tiny_patch16_224", "--no-pretrained", "--model-kwargs",
       json.dumps(VIT_KWARGS), "--workers", "0", "--quiet"]


def write_fixture(root):
    """Karpathy-format splits with 40 x 48 PNGs (not square: resizing squashes), 5 captions each."""
    rng = np.random.default_rng(0)
    splits = {}
    for name, n in SIZES.items():
        txt2img = np.repeat(np.arange(n), 5)
        splits[name] = RetrievalSplit(
            name=name, captions=[" ".join(rng.choice(WORDS, 4)) for _ in txt2img], txt2img=txt2img,
            image_ids=[f"{name}{i}" for i in range(n)],
            images=rng.integers(0, 256, size=(n, 40, 48, 3), dtype=np.uint8))
    write_karpathy(splits, root, dataset_name="fixture")
    return root / "dataset_fixture.json"


def run(json_path, out, *options):
    return extract.main(["--karpathy-json", str(json_path), "--images", str(json_path.parent),
                         "--out", str(out), *options])


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """One resnet18 extraction (float32, shards of 4 images, batches of 3), shared by the tests."""
    root = tmp_path_factory.mktemp("fixture")
    json_path = write_fixture(root)
    assert run(json_path, root / "features", *RESNET, "--dtype", "float32", "--shard-size", "4",
               "--batch-size", "3") == 0
    return json_path, root / "features"


def test_grid_boxes_and_pooling_by_hand():
    boxes = extract.grid_boxes(2, 2)  # row-major cells of a 2 x 2 grid
    np.testing.assert_allclose(boxes[1], [0.5, 0, 1, 0.5, 0.5, 0.5, 0.25])
    np.testing.assert_allclose(boxes[2], [0, 0.5, 0.5, 1, 0.5, 0.5, 0.25])
    # 3 cells into 2 bins: adaptive pooling's overlapping [0, 2) and [1, 3)
    assert extract.cell_bins(3, 2) == [(0, 2), (1, 3)]
    np.testing.assert_allclose(extract.grid_boxes(3, 3, grid=2)[3],
                               [1 / 3, 1 / 3, 1, 1, 2 / 3, 2 / 3, 4 / 9], rtol=1e-6)
    tokens = torch.randn(2, 3 * 5, 4)  # (B, h*w, C) for h=3, w=5
    pooled = extract.pool_grid(tokens, 3, 5, 2)  # (B, 4, C)
    grid = tokens.view(2, 3, 5, 4)
    for cell, ((y0, y1), (x0, x1)) in enumerate((r, c) for r in extract.cell_bins(3, 2)
                                                for c in extract.cell_bins(5, 2)):
        torch.testing.assert_close(pooled[:, cell], grid[:, y0:y1, x0:x1].mean((1, 2)))
    assert extract.pool_grid(tokens, 3, 5, None) is tokens


def test_cnn_grid_features_match_the_backbone(resnet):
    json_path, out = resnet
    manifest = json.loads((out / "features.json").read_text())
    assert manifest["complete"] and manifest["native_grid"] == [3, 3] and manifest["dim"] == 512
    assert manifest["split_sizes"] == SIZES and not (out / "shards").exists()
    with np.load(out / "regions.npz") as z:
        ids, regions, pooled = list(z["image_ids"]), z["regions"], z["pooled"]
        assert (regions.shape == (11, 9, 512) and regions.dtype == np.float32
                and pooled.shape == (11, 512))
        assert z["region_mask"].all() and z["region_mask"].shape == (11, 9)
        np.testing.assert_array_equal(z["boxes"],
                                      np.broadcast_to(extract.grid_boxes(3, 3), (11, 9, 7)))
    assert ids[:2] == ["train0", "train1"] and ids[-1] == "test2"
    # resnet's pooling is the mean over its grid
    np.testing.assert_allclose(pooled, regions.mean(1), rtol=1e-4, atol=1e-5)
    # the same weights (same seed) through PixelEncoder on independently prepared pixels
    seed_everything(0)
    encoder = PixelEncoder("resnet18", pretrained=False).eval()
    pixels = torch.stack([pixels_to_tensor(read_image(json_path.parent / "images" / f"{i}.png", 96))
                          for i in ("val1", "test0")])  # (2, 3, 96, 96), ImageNet-normalised
    with torch.no_grad():
        want = encoder({"pixels": pixels})
    rows = [ids.index("val1"), ids.index("test0")]
    torch.testing.assert_close(torch.from_numpy(regions[rows]), want.tokens, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.from_numpy(pooled[rows]), want.pooled, rtol=1e-4, atol=1e-4)


def test_loaders_read_the_features_back(resnet):
    json_path, out = resnet
    with np.load(out / "regions.npz") as z:
        row = {i: r for r, i in enumerate(z["image_ids"])}
        regions, pooled = z["regions"], z["pooled"]
    test = read_karpathy(json_path, split="test", regions_file=out / "regions.npz")
    assert test.regions.shape == (3, 9, 512) and test.boxes.shape == (3, 9, 7)
    np.testing.assert_array_equal(test.regions, regions[[row[i] for i in test.image_ids]])
    np.testing.assert_array_equal(read_pooled(out / "regions.npz", test),
                                  pooled[[row[i] for i in test.image_ids]])
    bench = load_feature_bench(out, regions_dtype=np.float16)
    assert (set(bench) == {"train", "val", "test", "full", "pretrain"}
            and bench["pretrain"] is bench["train"])
    assert bench["train"].name == "train" and bench["train"].regions.dtype == np.float16
    full = bench["full"]
    assert full.n_images == 11 and full.n_text_queries == 15 and full.n_image_queries == 3
    assert full.image_ids[full.query_images[0]] == "test0"
    assert np.shares_memory(bench["val"].regions, full.regions)  # read once, views per split
    np.testing.assert_array_equal(bench["val"].regions,
                                  regions[[row["val0"], row["val1"]]].astype(np.float16))
    assert (bench["test"].info["features"]["backbone"] == "resnet18"
            and bench["test"].image_paths is None)
    # for the methods that read pixels
    with_pixels = load_feature_bench(out, image_root=json_path.parent)
    assert with_pixels["test"].image_paths[2].endswith("images/test2.png")


def test_resume_after_an_interruption_gives_identical_files(resnet, tmp_path, monkeypatch, capsys):
    json_path, whole = resnet
    out = tmp_path / "features"
    save, calls = extract._save_shard, []

    def crash_on_second_shard(*args):
        calls.append(args[0].name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C or a killed Colab runtime
        save(*args)

    monkeypatch.setattr(extract, "_save_shard", crash_on_second_shard)
    options = (*RESNET, "--dtype", "float32", "--shard-size", "4", "--batch-size", "3")
    with pytest.raises(KeyboardInterrupt):
        run(json_path, out, *options)
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard_00000.npz"]
    with pytest.raises(ValueError, match="not finished.*again"):
        load_feature_bench(out)
    monkeypatch.setattr(extract, "_save_shard", save)
    capsys.readouterr()
    assert run(json_path, out, *options) == 0
    assert "2 shards computed, 1 reused" in capsys.readouterr().out
    for name in ("regions.npz", "features.json"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert run(json_path, out, *options) == 0  # a finished folder: nothing to do
    assert "already complete" in capsys.readouterr().out
    assert run(json_path, out, *RESNET, "--dtype", "float32", "--shard-size", "4",
               "--grid", "2") == 1
    assert "other settings (grid: None there, 2 now)" in capsys.readouterr().err


def test_vit_patch_tokens_pooled_to_a_grid(resnet, tmp_path):
    json_path, _ = resnet
    out = tmp_path / "vit"
    assert run(json_path, out, *VIT, "--grid", "2", "--splits", "test") == 0  # default float16
    manifest = json.loads((out / "features.json").read_text())
    assert manifest["native_grid"] == [4, 4] and manifest["image_size"] == [32, 32]
    with np.load(out / "regions.npz") as z:
        assert (list(z["image_ids"]) == ["test0", "test1", "test2"]
                and z["regions"].dtype == np.float16)
        # (3, 4, 32), (3, 32)
        regions, pooled = z["regions"].astype(np.float32), z["pooled"].astype(np.float32)
        np.testing.assert_array_equal(z["boxes"][0, 1],
                                      np.float32([0.5, 0, 1, 0.5, 0.5, 0.5, 0.25]))
    seed_everything(0)
    encoder = PixelEncoder("vit_tiny_patch16_224", pretrained=False, **VIT_KWARGS).eval()
    paths = [json_path.parent / "images" / f"test{i}.png" for i in range(3)]
    pixels = torch.stack([torch.from_numpy(np.array(read_image(p, 32))) for p in paths])
    pixels = pixels.permute(0, 3, 1, 2).float() / 255 * 2 - 1  # ViT's mean = std = 0.5
    with torch.no_grad():
        want = encoder({"pixels": pixels})
    # [CLS] dropped; (B, 2 rows, 2, 2 cols, 2, C)
    patches = want.tokens[:, 1:].view(3, 2, 2, 2, 2, 32)
    cells = patches.mean((2, 4)).reshape(3, 4, 32)  # each cell: the mean of its 2 x 2 patches
    # float16 storage
    torch.testing.assert_close(torch.from_numpy(regions), cells, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(torch.from_numpy(pooled), want.pooled, rtol=1e-2, atol=2e-3)  # [CLS]
    assert set(load_feature_bench(out)) == {"test"}


def test_methods_fit_and_rank_on_the_features_unchanged(resnet, tmp_path):
    from transformers import BertTokenizerFast

    from course_lib.evaluation import evaluate
    from course_lib.methods.lightningdot.method import LightningDOTMethod
    from course_lib.methods.lightningdot.model import LightningDOTConfig
    from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

    bench = load_feature_bench(resnet[1])
    # a BERT WordPiece tokenizer saved to a folder: the pretrained-tokenizer path, offline
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
             *sorted({w for c in bench["train"].captions
                                                                     for w in c.split()})]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "bert-tok")
    wordpiece = tokenizer_for(bench["train"], name=str(tmp_path / "bert-tok"))
    # [CLS] first
    assert wordpiece("red circle")["input_ids"][0] == 2 and len(wordpiece) == len(vocab)
    method = VsePPMethod(VsePPConfig.smoke(max_steps=3, batch_size=6), progress=False)
    method.fit(bench, wordpiece, cache_dir=tmp_path / "checkpoints")
    metrics, how = evaluate(method, bench["test"], (1, 5, 10))
    # 3 images
    assert how == "t2i on all 15 queries; i2t on all 3 queries" and metrics["t2i_r5"] == 100.0
    assert 0 <= metrics["i2t_r1"] <= 100
    indices, scores = method.rank(bench["full"], "t2i", 5)
    assert indices.shape == (15, 5) and torch.isfinite(scores).all()
    # LightningDOT: grid cells have no detector classes, so its pre-training drops SMRC-kl
    config = LightningDOTConfig.smoke(pretrain_tasks={"cmr": 1, "vmlm": 1, "smrfr": 1},
                                      pretrain_steps=2, finetune_steps=2, batch_size=6)
    dot = LightningDOTMethod(config, progress=False).fit(bench, tokenizer_for(bench["train"]))
    indices, scores = dot.rank(bench["test"], "i2t", 5)
    assert indices.shape == (3, 5) and torch.isfinite(scores).all()


def test_clear_errors(resnet, tmp_path, monkeypatch, capsys):
    json_path, _ = resnet
    assert run(tmp_path / "nothing.json", tmp_path / "o", *RESNET) == 1
    assert "download_data.py" in capsys.readouterr().err
    assert run(json_path, tmp_path / "o", *RESNET, "--splits", "test,restval") == 1
    assert "no split 'restval'; its splits are ['test', 'train', 'val']" in capsys.readouterr().err
    assert extract.main(["--karpathy-json", str(json_path), "--images", str(tmp_path), "--out",
                         str(tmp_path / "o"), *RESNET]) == 1
    # every split's, before anything is written
    assert "11 of the 11 images" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    (tmp_path / "file").write_text("")
    assert run(json_path, tmp_path / "file", *RESNET) == 1
    assert "is a file" in capsys.readouterr().err
    assert run(json_path, tmp_path / "o", *RESNET, "--model-kwargs", "{img_size: 64}") == 1
    assert "--model-kwargs must be a JSON object" in capsys.readouterr().err
    assert run(json_path, tmp_path / "o", *RESNET, "--grid", "5") == 1
    assert "3 x 3 grid; pick a grid between 1 and 3" in capsys.readouterr().err
    assert run(json_path, tmp_path / "o", *VIT, "--image-size", "64") == 1
    assert "does not take (64, 64) px inputs" in capsys.readouterr().err

    import timm

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(timm, "create_model", offline)
    assert run(json_path, tmp_path / "o", "--backbone", "resnet18", "--pretrained",
               "--workers", "0") == 1
    assert "could not load timm model 'resnet18' with pretrained weights" in capsys.readouterr().err


def test_the_benchmark_and_lesson_08_load_the_same_training_data(resnet):
    """A model's name hashes its training data, image paths included: the benchmark (which reads the
    photo folder from features.json) and lesson 08 (which names it) must load the same bench, so
    that one trains what the other loads."""
    from course_lib.core.stages import data_digest
    from course_lib.data.features import extracted_images

    json_path, out = resnet
    assert extracted_images(out) == json_path.parent.resolve()
    benchmark = load_feature_bench(out, regions_dtype=np.float16, image_root=extracted_images(out))
    lesson = load_feature_bench(out, regions_dtype=np.float16,
                                image_root=json_path.parent.resolve())
    assert data_digest(benchmark["train"]) == data_digest(lesson["train"])
    # paths count
    assert data_digest(benchmark["train"]) != data_digest(load_feature_bench(out)["train"])
