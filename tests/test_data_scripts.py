"""data_scripts on tiny data, and read_karpathy on a fixture in exactly Karpathy's format.

The fixture is written here: a Flickr30k-style file (no filepath) and a COCO-style one (filepath
train2014 / val2014, a restval split, an image with 6 sentences), with small generated JPEGs.
Downloads use file:// URLs of zips made here (Flickr8k's shaped as its official ones and
Karpathy's); nothing touches the network.
"""

import importlib.util
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from course_lib.data.karpathy import read_karpathy
from course_lib.data.synthetic_files import load_synthetic

ROOT = Path(__file__).resolve().parents[1]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "data_scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sentence(words, imgid, sentid):
    return {"tokens": words.split(), "raw": words.capitalize() + " .", "imgid": imgid,
            "sentid": sentid}


def _entry(imgid, split, filename, n_sentences, filepath=None):
    words = ["a dog runs", "Two Men talk", "a red bus", "kids play outside", "a cat sleeps",
             "people walk", "a bird flies"]
    first = imgid * 10
    entry = {"split": split, "filename": filename, "imgid": imgid,
             "sentids": list(range(first, first + n_sentences)),
             "sentences": [_sentence(f"{words[k]} {imgid}", imgid, first + k)
                           for k in range(n_sentences)]}
    if filepath:
        entry["filepath"] = filepath
        entry["cocoid"] = 1000 + imgid
    return entry


def _jpeg(path, size, seed):
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=95)


def write_fixture(root: Path) -> dict:
    """Karpathy-format files and images under root; returns their paths."""
    flickr = [_entry(i, split, f"{100 + i}.jpg", 5)
              for i, split in enumerate(["train", "train", "train", "val", "test", "test"])]
    coco = [_entry(0, "train", "COCO_train2014_000000000010.jpg", 5, "train2014"),
            _entry(1, "restval", "COCO_val2014_000000000020.jpg", 6, "val2014"),  # 6 captions
            _entry(2, "restval", "COCO_val2014_000000000030.jpg", 5, "val2014"),
            _entry(3, "val", "COCO_val2014_000000000040.jpg", 5, "val2014"),
            _entry(4, "test", "COCO_val2014_000000000050.jpg", 5, "val2014")]
    coco[2]["sentences"][0]["tokens"] = []  # falls back to raw
    for i, img in enumerate(flickr):
        _jpeg(root / "flickr" / "flickr30k-images" / img["filename"], (24, 32), i)
    for i, img in enumerate(coco):
        _jpeg(root / "coco" / img["filepath"] / img["filename"], (20 + 4 * (i % 2), 30), 10 + i)
    paths = {"flickr": root / "flickr" / "dataset_flickr30k.json",
             "coco": root / "coco" / "dataset_coco.json"}
    paths["flickr"].write_text(json.dumps({"images": flickr, "dataset": "flickr30k"}))
    paths["coco"].write_text(json.dumps({"images": coco, "dataset": "coco"}))
    return paths


@pytest.fixture
def fixture(tmp_path):
    return write_fixture(tmp_path)


# --------------------------------------------------------------------- read_karpathy on the fixture


def test_flickr_test_split(fixture):
    images = fixture["flickr"].parent / "flickr30k-images"
    split = read_karpathy(fixture["flickr"], images, "test", load_pixels=True)
    assert split.name == "test" and split.image_ids == ["104", "105"]
    assert split.n_texts == 10 and split.txt2img.tolist() == [0] * 5 + [1] * 5
    assert split.captions[1] == "two men talk 4"  # tokens joined and lower-cased
    assert split.image_paths[0] == str(images / "104.jpg")
    assert split.images.shape == (2, 24, 32, 3) and split.images.dtype == np.uint8
    assert split.info["dataset"] == "flickr30k"
    assert read_karpathy(fixture["flickr"], split="train").n_images == 3


def test_coco_train_restval_filepath_and_caption_count(fixture):
    root = fixture["coco"].parent
    train = read_karpathy(fixture["coco"], root, ("train", "restval"))
    assert train.name == "train+restval" and train.n_images == 3
    assert train.n_texts == 15  # the 6-caption image keeps its first 5
    assert train.image_paths[1] == str(root / "val2014" / "COCO_val2014_000000000020.jpg")
    assert train.image_ids[0] == "COCO_train2014_000000000010"
    assert train.captions[10] == "a dog runs 2"  # from raw: "A dog runs 2 ." lower-cased
    assert train.captions[11] == "two men talk 2"
    assert read_karpathy(fixture["coco"], split="restval", captions_per_image=None).n_texts == 11
    with pytest.raises(ValueError, match="different sizes.*image_size"):
        read_karpathy(fixture["coco"], root, ("train", "restval"), load_pixels=True)
    resized = read_karpathy(fixture["coco"], root, ("train", "restval"), load_pixels=True,
                            image_size=16)
    assert resized.images.shape == (3, 16, 16, 3)


def test_regions_file_aligned_by_image_id(fixture, tmp_path):
    ids = np.array(["105", "999", "104"])  # another order, and an extra id
    regions = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    np.savez(tmp_path / "feats.npz", image_ids=ids, regions=regions, boxes=np.zeros((3, 2, 7)),
             region_mask=np.ones((3, 2), bool))
    split = read_karpathy(fixture["flickr"], split="test", regions_file=tmp_path / "feats.npz")
    np.testing.assert_array_equal(split.regions, regions[[2, 0]])
    assert split.boxes.dtype == np.float32 and split.region_classes is None
    with pytest.raises(ValueError) as info:
        read_karpathy(fixture["flickr"], split="train", regions_file=tmp_path / "feats.npz")
    assert "feats.npz" in str(info.value) and "lacks 3 of the 3 image ids" in str(info.value)


def test_error_missing_json(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        read_karpathy(tmp_path / "dataset_flickr30k.json")
    message = str(info.value)
    assert "dataset_flickr30k.json not found" in message
    assert "caption_datasets.zip" in message and "download_data.py" in message


def test_error_not_a_karpathy_file(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list.json is not a Karpathy split file.*'images'"):
        read_karpathy(tmp_path / "list.json")
    (tmp_path / "broken.json").write_text('{"images": [')
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        read_karpathy(tmp_path / "broken.json")


def test_error_wrong_split_lists_the_splits(fixture):
    with pytest.raises(ValueError) as info:
        read_karpathy(fixture["coco"], split="testall")
    message = str(info.value)
    assert "dataset_coco.json" in message and "'testall'" in message
    assert "['restval', 'test', 'train', 'val']" in message


def test_error_malformed_entry_names_index_and_key(fixture):
    data = json.loads(fixture["coco"].read_text())
    del data["images"][3]["filename"]
    fixture["coco"].write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"dataset_coco.json: image entry 3 .*no 'filename' key"):
        read_karpathy(fixture["coco"], split="val")
    del data["images"][1]["split"]
    fixture["coco"].write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"image entry 1 has no 'split' key"):
        read_karpathy(fixture["coco"], split="test")


def test_error_missing_image_names_path_and_root(fixture):
    root = fixture["flickr"].parent / "flickr30k-images"
    (root / "105.jpg").unlink()
    with pytest.raises(FileNotFoundError) as info:
        read_karpathy(fixture["flickr"], root, "test")
    message = str(info.value)
    assert "1 of 2 images" in message and str(root / "105.jpg") in message
    assert f"image_root='{root}'" in message and "--check" in message
    with pytest.raises(FileNotFoundError, match="image_root"):
        # root one level too high
        read_karpathy(fixture["flickr"], fixture["flickr"].parent, "train")


# -------------------------------------------------------------------------------- make_synthetic.py


def test_make_synthetic_writes_what_load_synthetic_reads(tmp_path, capsys):
    synthetic = pytest.importorskip("course_lib.data.synthetic")
    from test_karpathy import assert_same_split

    script = load_script("make_synthetic")
    summary = script.main(["--smoke", "--seed", "3", "--out", str(tmp_path / "syn"), "--quiet"])
    printed = capsys.readouterr().out
    assert "wrote" in printed and "load_synthetic" in printed
    assert summary["n_images"] > 0 and summary["bytes"] > 0
    want = synthetic.make_benchmark(synthetic.SyntheticConfig.smoke(), seed=3, progress=False)
    for name in ("test", "full"):
        assert_same_split(load_synthetic(tmp_path / "syn", name), want[name])
    # a second run needs --overwrite, and leaves no stale files behind
    with pytest.raises(SystemExit):
        script.main(["--smoke", "--out", str(tmp_path / "syn"), "--quiet"])
    assert "--overwrite" in capsys.readouterr().err
    script.main(["--smoke", "--no-pretrain", "--seed", "4", "--out", str(tmp_path / "syn"),
                 "--overwrite", "--quiet"])
    with pytest.raises(ValueError, match="no split 'pretrain'"):
        load_synthetic(tmp_path / "syn", "pretrain")
    n_files = len(list((tmp_path / "syn" / "images").glob("*.png")))
    info = json.loads((tmp_path / "syn" / "info.json").read_text())
    assert n_files == sum(s["n_images"] for s in info["splits"].values()) and info["seed"] == 4


@pytest.mark.parametrize("make_bad, expect", [
    (lambda d: (d / "file.txt").write_text("x") and d / "file.txt", "is a file"),
    (lambda d: (d / "notes.txt").write_text("x") and d, "not empty"),
])
def test_make_synthetic_bad_out(tmp_path, capsys, make_bad, expect):
    script = load_script("make_synthetic")
    with pytest.raises(SystemExit) as info:
        script.main(["--smoke", "--out", str(make_bad(tmp_path))])
    assert info.value.code == 2 and expect in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--scenes", "5", "--out", str(tmp_path / "new")])
    assert "at least 12" in capsys.readouterr().err


# --------------------------------------------------------------------------------- download_data.py


def _zip(path: Path, files: dict[str, Path]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, src in files.items():
            z.write(src, name)
    return path.as_uri()


@pytest.fixture
def mirror(fixture, tmp_path, monkeypatch):
    """The download script pointed at file:// zips of the fixture."""
    script = load_script("download_data")
    web = tmp_path / "web"
    web.mkdir()
    monkeypatch.setattr(script, "KARPATHY_SPLITS_URL", _zip(web / "caption_datasets.zip", {
        "dataset_flickr30k.json": fixture["flickr"], "dataset_coco.json": fixture["coco"]}))
    coco = fixture["coco"].parent
    urls = {}
    for name in ("train2014", "val2014"):
        urls[name] = _zip(web / f"{name}.zip",
                          {f"{name}/{p.name}": p for p in (coco / name).glob("*.jpg")})
    monkeypatch.setattr(script, "COCO_IMAGE_URLS", urls)
    return script, fixture


def test_download_coco_from_file_urls(mirror, tmp_path, capsys):
    script, _ = mirror
    out = tmp_path / "data" / "coco"
    out.mkdir(parents=True)
    (out / "val2014.zip.part").write_bytes(b"stale bytes of an interrupted run")
    assert script.main(["coco", "--out", str(out), "--quiet"]) == 0
    assert "coco is complete" in capsys.readouterr().out
    assert not list(out.glob("*.zip")) and not list(out.glob("*.part"))
    split = read_karpathy(out / "dataset_coco.json", out, ("train", "restval"), load_pixels=True,
                          image_size=8)
    assert split.images.shape == (3, 8, 8, 3)
    assert script.main(["coco", "--out", str(out), "--check"]) == 0
    assert script.main(["coco", "--out", str(out), "--quiet"]) == 0  # nothing left to fetch


def test_download_flickr30k_prints_form_instructions_and_checks(mirror, tmp_path, capsys):
    script, fixture = mirror
    out = tmp_path / "f30k"
    assert script.main(["flickr30k", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert (script.FLICKR30K_FORM_URL in printed and "flickr30k-images" in printed
            and "--check" in printed)
    assert (out / "dataset_flickr30k.json").is_file()
    assert script.main(["flickr30k", "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    assert "6 of 6 images are missing" in err and "flickr30k-images" in err
    (fixture["flickr"].parent / "flickr30k-images").rename(out / "flickr30k-images")
    assert script.main(["flickr30k", "--out", str(out), "--check"]) == 0
    assert "read_karpathy(" in capsys.readouterr().out


def test_download_failure_says_what_to_do_offline(mirror, tmp_path, capsys):
    script, _ = mirror
    script.KARPATHY_SPLITS_URL = (tmp_path / "missing.zip").as_uri()
    assert script.main(["coco", "--out", str(tmp_path / "c"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "could not download" in err and "Offline?" in err and "make_synthetic.py" in err
    with pytest.raises(SystemExit):
        script.main(["coco", "--out", str(Path(script.__file__))])


def test_download_resumes_a_partial_file(tmp_path, monkeypatch):
    """A server that honours Range: the .part file is continued, not restarted."""
    script = load_script("download_data")
    payload = bytes(range(256)) * 40
    seen = []

    class Response(io.BytesIO):
        def __init__(self, body, status):
            super().__init__(body)
            self.status, self.headers = status, {"Content-Length": str(len(body))}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_urlopen(request, timeout=None):
        seen.append(request.headers.get("Range"))
        start = int(request.headers["Range"][6:-1]) if request.headers.get("Range") else 0
        return Response(payload[start:], 206 if start else 200)

    monkeypatch.setattr(script.urllib.request, "urlopen", fake_urlopen)
    dest = tmp_path / "big.zip"
    (tmp_path / "big.zip.part").write_bytes(payload[:1000])
    script.download("https://example.invalid/big.zip", dest, progress=False)
    assert seen == ["bytes=1000-"] and dest.read_bytes() == payload


F8K_SPLITS = {"train": ["1001_aa.jpg", "1003_cc.jpg"], "val": ["1002_bb.jpg"],
              "test": ["1000_dd.jpg"]}
F8K_COLOURS = ["red", "blue", "green", "black", "white"]


def _f8k_caption(i, k):
    """Caption k of photo i in Flickr8k.token.txt, and its tokens written out by hand."""
    colour = F8K_COLOURS[k]
    raw = f"A {colour.upper()} dog's ball, number {i}{k} ."
    return raw, ["a", colour, "dog", "s", "ball", "number", f"{i}{k}"]


@pytest.fixture
def flickr8k_mirror(tmp_path, monkeypatch):
    """The download script on file:// zips shaped as Flickr8k's official ones and Karpathy's."""
    script = load_script("download_data")
    web, src = tmp_path / "web8k", tmp_path / "src8k"
    web.mkdir()
    # token-file order, not sorted
    order = ["1003_cc.jpg", "1001_aa.jpg", "1002_bb.jpg", "1000_dd.jpg"]
    photos = {}
    for i, name in enumerate(order):
        _jpeg(src / "Flicker8k_Dataset" / name, (24, 32), 20 + i)
        photos[f"Flicker8k_Dataset/{name}"] = src / "Flicker8k_Dataset" / name
    (src / "fork").write_bytes(b"\0\5\26\7 resource fork")
    photos["__MACOSX/Flicker8k_Dataset/._1000_dd.jpg"] = src / "fork"  # as in the published zip
    lines = [f"{name}#{k}\t{_f8k_caption(i, k)[0]}" for i, name in enumerate(order)
             for k in range(5)]
    lines.insert(7, "1001_aa.jpg.1#0\tA stray entry in no split list .")
    (src / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    text = {"Flickr8k.token.txt": src / "Flickr8k.token.txt"}
    for split, name in (("train", "trainImages"), ("val", "devImages"), ("test", "testImages")):
        (src / f"Flickr_8k.{name}.txt").write_text("\n".join(F8K_SPLITS[split]) + "\n")
        text[f"Flickr_8k.{name}.txt"] = src / f"Flickr_8k.{name}.txt"
    entries = [("train", "1001_aa.jpg"), ("train", "1003_cc.jpg"), ("val", "1002_bb.jpg"),
               ("test", "1000_dd.jpg")]  # Karpathy's own order
    karpathy = {"dataset": "flickr8k",
                "images": [_entry(i, split, name, 5) for i, (split, name) in enumerate(entries)]}
    (src / "dataset_flickr8k.json").write_text(json.dumps(karpathy))
    monkeypatch.setattr(script, "KARPATHY_SPLITS_URL", _zip(web / "caption_datasets.zip", {
        "dataset_flickr8k.json": src / "dataset_flickr8k.json"}))
    monkeypatch.setattr(script, "FLICKR8K_IMAGES_URL", _zip(web / "Flickr8k_Dataset.zip", photos))
    monkeypatch.setattr(script, "FLICKR8K_TEXT_URL", _zip(web / "Flickr8k_text.zip", text))
    return script, {"karpathy": karpathy, "order": order}


def test_download_flickr8k_with_karpathys_split_file(flickr8k_mirror, tmp_path, capsys):
    script, want = flickr8k_mirror
    out = tmp_path / "data" / "flickr8k"
    assert script.main(["flickr8k", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "Karpathy's, from caption_datasets.zip" in printed and "flickr8k is complete" in printed
    assert f"image_root={str(out / 'images')!r}" in printed
    assert json.loads((out / "dataset_flickr8k.json").read_text()) == want["karpathy"]
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(want["order"])
    assert (sorted(p.name for p in out.iterdir())
            == [".images.done", "dataset_flickr8k.json", "images"])
    split = read_karpathy(out / "dataset_flickr8k.json", out / "images", split="train",
                          load_pixels=True)
    assert split.image_ids == ["1001_aa", "1003_cc"] and split.n_texts == 10
    assert split.images.shape == (2, 24, 32, 3)
    assert script.main(["flickr8k", "--out", str(out), "--check"]) == 0
    assert script.main(["flickr8k", "--out", str(out), "--quiet"]) == 0  # nothing left to fetch
    assert "already in" in capsys.readouterr().out


def test_download_flickr8k_builds_the_split_file_from_the_official_text(flickr8k_mirror, tmp_path,
                                                                        capsys):
    script, want = flickr8k_mirror
    script.KARPATHY_SPLITS_URL = (tmp_path / "missing.zip").as_uri()
    out = tmp_path / "f8k"
    assert script.main(["flickr8k", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert ("built from the official Flickr8k_text.zip" in printed
            and "could not download" in printed)
    data = json.loads((out / "dataset_flickr8k.json").read_text())
    assert (data["dataset"] == "flickr8k"
            and [img["filename"] for img in data["images"]] == want["order"])
    split_of = {name: split for split, names in F8K_SPLITS.items() for name in names}
    for imgid, img in enumerate(data["images"]):
        i = want["order"].index(img["filename"])
        assert img["split"] == split_of[img["filename"]] and img["filepath"] == ""
        assert img["imgid"] == imgid and img["sentids"] == list(range(5 * imgid, 5 * imgid + 5))
        assert len(img["sentences"]) == 5
        for k, sentence in enumerate(img["sentences"]):
            raw, tokens = _f8k_caption(i, k)
            assert sentence == {"raw": raw, "tokens": tokens, "imgid": imgid,
                                "sentid": 5 * imgid + k}
    assert (sorted(p.name for p in out.iterdir())
            == [".images.done", "dataset_flickr8k.json", "images"])
    train = read_karpathy(out / "dataset_flickr8k.json", out / "images", split="train")
    assert train.image_ids == ["1003_cc", "1001_aa"] and train.n_texts == 10
    assert train.captions[0] == "a red dog s ball number 00"
    assert (read_karpathy(out / "dataset_flickr8k.json", out / "images", split="val").image_ids
            == ["1002_bb"])


def test_download_flickr8k_check_names_a_missing_image(flickr8k_mirror, tmp_path, capsys):
    script, _ = flickr8k_mirror
    out = tmp_path / "f8k"
    assert script.main(["flickr8k", "--out", str(out), "--splits-only", "--quiet"]) == 0
    assert not (out / "images").exists()
    assert script.main(["flickr8k", "--out", str(out), "--quiet"]) == 0
    (out / "images" / "1002_bb.jpg").unlink()
    capsys.readouterr()
    assert script.main(["flickr8k", "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    assert "1 of 4 images are missing" in err and str(out / "images" / "1002_bb.jpg") in err
    assert "Flickr8k_Dataset.zip" in err


def test_download_flickr8k_offline_says_what_to_do(flickr8k_mirror, tmp_path, capsys):
    script, _ = flickr8k_mirror
    script.KARPATHY_SPLITS_URL = (tmp_path / "missing.zip").as_uri()
    script.FLICKR8K_TEXT_URL = (tmp_path / "missing_text.zip").as_uri()
    assert script.main(["flickr8k", "--out", str(tmp_path / "f"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "could not download" in err and "Offline?" in err and "make_synthetic.py" in err
    assert "Flickr8k_text.zip" in err
