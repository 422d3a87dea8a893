"""Datasets and collate functions on a hand-made RetrievalSplit (and the synthetic one if there)."""

import numpy as np
import pytest
import torch
from PIL import Image

from course_lib.data.datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CaptionDataset,
    ImageDataset,
    PairCollate,
    PairDataset,
    TextCollate,
    collate_images,
    make_loader,
    pixels_to_tensor,
)
from course_lib.data.split import RetrievalSplit
from course_lib.data.tokenizer import build_word_tokenizer

WORDS = "a red blue green circle square triangle left of right above below big small".split()


def make_toy_split(n_images=4, captions_per_image=3, size=16, n_regions=3, dim=8, n_classes=5,
                   seed=0, name="toy") -> RetrievalSplit:
    """A small split with every field filled; captions interleaved so order bugs show."""
    rng = np.random.default_rng(seed)
    txt2img = np.tile(np.arange(n_images), captions_per_image)  # (T,) 0 1 2 3 0 1 2 3 ...
    captions = [" ".join(rng.choice(WORDS, size=rng.integers(3, 8))) + f" img{i}" for i in txt2img]
    mask = np.ones((n_images, n_regions), dtype=bool)
    mask[:, -1] = rng.random(n_images) < 0.5  # some padded slots
    return RetrievalSplit(
        name=name, captions=captions, txt2img=txt2img,
        image_ids=[f"{name}_{i:04d}" for i in range(n_images)],
        images=rng.integers(0, 256, size=(n_images, size, size, 3), dtype=np.uint8),
        regions=rng.normal(size=(n_images, n_regions, dim)).astype(np.float32),
        boxes=rng.random((n_images, n_regions, 7)).astype(np.float32),
        region_mask=mask,
        region_classes=rng.dirichlet(np.ones(n_classes),
                                     size=(n_images, n_regions)).astype(np.float32),
        info={"seed": seed},
    )


@pytest.fixture
def toy():
    return make_toy_split()


@pytest.fixture
def tok(toy):
    return build_word_tokenizer(toy.captions)


def test_region_items_shapes_and_dtypes(toy):
    ds = ImageDataset(toy, "regions")
    assert len(ds) == 4
    item = ds[2]
    assert item["index"] == 2
    assert item["regions"].shape == (3, 8) and item["regions"].dtype == torch.float32
    assert item["boxes"].shape == (3, 7) and item["region_mask"].dtype == torch.bool
    assert item["region_classes"].shape == (3, 5)
    np.testing.assert_array_equal(item["regions"].numpy(), toy.regions[2])
    batch = collate_images([ds[i] for i in range(4)])
    assert batch["regions"].shape == (4, 3, 8) and batch["region_mask"].shape == (4, 3)
    assert batch["index"].tolist() == [0, 1, 2, 3] and batch["index"].dtype == torch.long


def test_region_classes_optional(toy):
    toy.region_classes = None
    assert "region_classes" not in ImageDataset(toy, "regions")[0]


def test_pixels_normalisation_of_a_known_image(toy):
    toy.images[0] = np.array([255, 128, 0], dtype=np.uint8)  # a flat colour
    raw = ImageDataset(toy, "pixels", normalize=False)[0]["pixels"]
    assert raw.shape == (3, 16, 16) and raw.dtype == torch.float32
    np.testing.assert_allclose(raw.mean(dim=(1, 2)).numpy(), [1.0, 128 / 255, 0.0], atol=1e-6)
    norm = ImageDataset(toy, "pixels")[0]["pixels"]
    expect = (np.array([1.0, 128 / 255, 0.0]) - IMAGENET_MEAN) / IMAGENET_STD
    np.testing.assert_allclose(norm.mean(dim=(1, 2)).numpy(), expect, atol=1e-5)
    assert float(norm.std(dim=(1, 2)).max()) < 1e-5
    # a random image: normalisation is exactly (x - mean) / std per channel
    x = pixels_to_tensor(toy.images[1], normalize=False)
    y = pixels_to_tensor(toy.images[1])
    np.testing.assert_allclose(y[1].numpy(),
                               ((x[1] - IMAGENET_MEAN[1]) / IMAGENET_STD[1]).numpy(), atol=1e-6)


def test_lazy_pixels_equal_in_memory_pixels(toy, tmp_path):
    paths = []
    for i, image in enumerate(toy.images):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(image).save(paths[-1])
    lazy = RetrievalSplit("lazy", toy.captions, toy.txt2img, toy.image_ids, image_paths=paths)
    for i in range(toy.n_images):
        torch.testing.assert_close(ImageDataset(lazy, "pixels")[i]["pixels"],
                                   ImageDataset(toy, "pixels")[i]["pixels"])
    resized = ImageDataset(lazy, "pixels", image_size=24)[0]["pixels"]
    assert resized.shape == (3, 24, 24)
    torch.testing.assert_close(resized, ImageDataset(toy, "pixels", image_size=24)[0]["pixels"])
    assert ImageDataset(lazy, "pixels", image_size=(8, 12))[0]["pixels"].shape == (3, 8, 12)


def test_captions_and_text_collate(toy, tok):
    ds = CaptionDataset(toy)
    assert len(ds) == toy.n_texts and ds[5] == {"index": 5, "text": toy.captions[5]}
    batch = TextCollate(tok, max_length=6)([ds[i] for i in range(4)])
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 6
    assert (batch["input_ids"][:, 0] == tok.cls_token_id).all()
    assert batch["text"] == toy.captions[:4] and batch["index"].tolist() == [0, 1, 2, 3]
    plain = TextCollate(tok)(["a red circle", "a red circle left of a big blue square"])
    assert plain["input_ids"].shape == (2, 11)  # padded to the longest: 9 words + [CLS] + [SEP]
    assert plain["attention_mask"][0].tolist() == [1] * 5 + [0] * 6


def test_pairs_point_at_their_image(toy, tok):
    ds = PairDataset(toy, "regions")
    assert len(ds) == toy.n_texts
    for t in (0, 5, 11):
        item = ds[t]
        assert item["text"] == toy.captions[t] and item["txt_index"] == t
        assert item["img_index"] == toy.txt2img[t]
        assert item["text"].endswith(f"img{item['img_index']}")
        np.testing.assert_array_equal(item["regions"].numpy(), toy.regions[toy.txt2img[t]])
    batch = PairCollate(tok, 40)([ds[t] for t in range(6)])
    assert batch["img_index"].tolist() == toy.txt2img[:6].tolist()
    assert batch["txt_index"].tolist() == list(range(6))
    assert batch["regions"].shape == (6, 3, 8) and batch["input_ids"].shape[0] == 6
    pix = PairDataset(toy, "pixels", normalize=False)[7]
    np.testing.assert_allclose(pix["pixels"].permute(1, 2, 0).numpy() * 255,
                               toy.images[toy.txt2img[7]], atol=1e-3)


def test_make_loader_picks_the_collate(toy, tok):
    images = next(iter(make_loader(ImageDataset(toy, "pixels"), 3)))
    assert images["pixels"].shape == (3, 3, 16, 16)
    texts = next(iter(make_loader(CaptionDataset(toy), 5, tokenizer=tok)))
    assert texts["input_ids"].shape[0] == 5
    pairs = list(make_loader(PairDataset(toy), 4, tokenizer=tok, shuffle=True,
                             generator=torch.Generator().manual_seed(0)))
    assert sorted(torch.cat([b["txt_index"] for b in pairs]).tolist()) == list(range(toy.n_texts))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        make_loader(CaptionDataset(toy), 4)
    with pytest.raises(TypeError, match="make_loader knows"):
        make_loader(torch.utils.data.TensorDataset(torch.zeros(3)), 2)


def test_errors_say_what_to_do(toy):
    bare = RetrievalSplit("bare", toy.captions, toy.txt2img, toy.image_ids)
    with pytest.raises(ValueError, match="no region features.*synthetic.*regions_file"):
        ImageDataset(bare, "regions")
    with pytest.raises(ValueError, match="no pixels.*image_root"):
        PairDataset(bare, "pixels")
    with pytest.raises(ValueError, match="modality must be one of"):
        ImageDataset(toy, "patches")


def test_synthetic_split_through_a_loader():
    synthetic = pytest.importorskip("course_lib.data.synthetic")
    bench = synthetic.make_benchmark(synthetic.SyntheticConfig.smoke(), seed=0, progress=False)
    split = bench["test"]
    tok = build_word_tokenizer(bench["train"].captions)
    batch = next(iter(make_loader(PairDataset(split, "regions"), 8, tokenizer=tok)))
    r, d = split.regions.shape[1:]
    assert batch["regions"].shape == (8, r, d) and batch["boxes"].shape == (8, r, 7)
    assert batch["img_index"].tolist() == split.txt2img[:8].tolist()
    # test captions use the training vocabulary
    assert (batch["input_ids"] != tok.unk_token_id).all()
    pixels = next(iter(make_loader(ImageDataset(split, "pixels"), 4)))["pixels"]
    assert pixels.shape == (4, 3, *split.images.shape[1:3])
