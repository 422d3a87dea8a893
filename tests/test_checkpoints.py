"""Checkpoint names change with anything that changes what training produces, and only then."""

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.checkpoints import checkpoint_name, data_digest, model_device
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.lightningdot.method import LightningDOTMethod
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

SIZES = dict(n_train=30, n_val=10, n_test=10, n_pretrain=10, n_compositional=2)


def make_bench(**knobs) -> dict:
    return make_benchmark(SyntheticConfig.smoke(**{**SIZES, **knobs}), seed=0)


@pytest.fixture(scope="module")
def data():
    bench = make_bench()
    return bench, build_word_tokenizer(bench["train"].captions)


def test_name_tracks_config_data_vocabulary_and_extra(data):
    bench, tokenizer = data
    name = checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer)
    assert name.startswith("m-") and name.endswith(".pt")
    assert checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer) == name
    assert checkpoint_name("other", {"lr": 1e-3}, bench["train"], tokenizer) != name
    assert checkpoint_name("m", {"lr": 2e-4}, bench["train"], tokenizer) != name
    assert checkpoint_name("m", {"lr": 1e-3}, bench["val"], tokenizer) != name
    bigger_vocab = build_word_tokenizer(bench["train"].captions + ["zebra"])
    assert checkpoint_name("m", {"lr": 1e-3}, bench["train"], bigger_vocab) != name
    assert checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer, "teacher-a") != name


@pytest.mark.parametrize("knob", [{"region_noise": 0.3}, {"clutter": 2.0}, {"pixel_noise": 0.1}])
def test_name_tracks_the_data_itself_not_only_its_captions_and_shapes(data, knob):
    bench, tokenizer = data
    # same captions, vocabulary, sizes and shapes; other pixels / regions
    other = make_bench(**knob)
    assert other["train"].captions == bench["train"].captions
    assert other["train"].regions.shape == bench["train"].regions.shape
    config = {"lr": 1e-3}
    assert checkpoint_name("m", config, other["train"], tokenizer) != checkpoint_name(
        "m", config, bench["train"], tokenizer)


@pytest.mark.parametrize("field", ["images", "regions", "boxes", "region_mask", "region_classes",
                                   "txt2img", "image_paths"])
def test_name_tracks_one_changed_value_of_every_array(data, field):
    bench, tokenizer = data
    split = bench["train"]
    name = checkpoint_name("m", {}, split, tokenizer)
    if field == "image_paths":
        paths = [f"/data/{i}.jpg" for i in range(split.n_images)]
        with_paths = dataclasses.replace(split, image_paths=paths)
        moved = dataclasses.replace(split, image_paths=paths[:-1] + ["/data/other.jpg"])
        assert checkpoint_name("m", {}, with_paths, tokenizer) not in (
            name, checkpoint_name("m", {}, moved, tokenizer))
        return
    value = getattr(split, field).copy()
    flat = value.reshape(-1)  # a view: one value in the middle changes
    middle = len(flat) // 2 + 1
    if field == "txt2img":  # two captions swap images: same counts, other pairs
        value[[0, -1]] = value[[-1, 0]]
    elif value.dtype == bool:
        flat[middle] = ~flat[middle]
    else:
        flat[middle] += 1
    changed = dataclasses.replace(split, **{field: value})
    assert checkpoint_name("m", {}, changed, tokenizer) != name
    # a copy: same name
    assert checkpoint_name("m", {}, dataclasses.replace(split), tokenizer) == name


def test_data_digest_is_cheap(data):
    import time

    split = make_bench(n_train=2000)["train"]  # 2k images: 1/5 of the default train split
    start = time.perf_counter()
    digest = data_digest(split)
    assert time.perf_counter() - start < 0.1  # about 4 ms; 10k images about 20 ms
    assert set(digest) >= {"captions", "txt2img", "images", "regions", "boxes", "region_mask"}


def test_lightningdot_finetuned_name_tracks_the_pretraining_corpus(data):
    bench, tokenizer = data
    more = make_bench(n_pretrain=20)  # same train split, a bigger pre-training corpus
    assert more["train"].captions == bench["train"].captions
    np.testing.assert_array_equal(more["train"].regions, bench["train"].regions)
    method = LightningDOTMethod(LightningDOTConfig.smoke())
    name = method.checkpoint_file(bench, tokenizer)
    assert name.startswith("lightningdot-") and name == method.checkpoint_file(bench, tokenizer)
    assert method.checkpoint_file(more, tokenizer) != name
    assert (method.pretrain_checkpoint_file(more, tokenizer)
            != method.pretrain_checkpoint_file(bench, tokenizer))
    # only the pre-training corpus's region features change: both names change
    noisy = dataclasses.replace(bench["pretrain"], regions=bench["pretrain"].regions + 0.01)
    noisy_bench = {**bench, "pretrain": noisy}
    assert (method.pretrain_checkpoint_file(noisy_bench, tokenizer)
            != method.pretrain_checkpoint_file(bench, tokenizer))
    assert method.checkpoint_file(noisy_bench, tokenizer) != name
    # without pre-training the corpus plays no part
    plain = LightningDOTMethod(LightningDOTConfig.smoke(pretrain_steps=0))
    assert plain.pretrain_checkpoint_file(bench, tokenizer) is None
    assert plain.checkpoint_file(more, tokenizer) == plain.checkpoint_file(bench, tokenizer)


def test_method_checkpoint_file_is_the_name_fit_uses(data, tmp_path, monkeypatch):
    bench, tokenizer = data
    method = VsePPMethod(VsePPConfig.smoke(), progress=False)
    monkeypatch.setattr(method, "train", lambda *args: (None, None))  # name only, no training
    method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert method.checkpoint_path == tmp_path / method.checkpoint_file(bench, tokenizer)
    assert method.checkpoint_file(bench, tokenizer) == checkpoint_name(
        "vsepp", method.config.to_dict(), bench["train"], tokenizer, version=method.format_version)


def test_a_name_hashes_what_the_model_is_trained_from_not_its_code(data, monkeypatch):
    """The name covers config, data, vocabulary, extra files and the declared format version; the
    source text of the code that trains it plays no part (an edit that changes no number
    keeps it)."""
    bench, tokenizer = data
    method = VsePPMethod(VsePPConfig.smoke())
    name = method.checkpoint_file(bench, tokenizer)
    assert name == checkpoint_name("vsepp", method.config.to_dict(), bench["train"],
                                   tokenizer, version=1)
    assert (set(method.fingerprint(bench, tokenizer))
            == {"format", "version", "config", "vocab", "data", "extra"})
    monkeypatch.setattr(VsePPMethod, "format_version", 2)  # a deliberate change of layout or recipe
    assert method.checkpoint_file(bench, tokenizer) != name
    monkeypatch.setattr(VsePPMethod, "format_version", 1)
    monkeypatch.setattr(VsePPMethod, "checkpoint_extra",
                        lambda self, bench, tok: ("other-stage.pt",))
    assert method.checkpoint_file(bench, tokenizer) != name
    monkeypatch.undo()
    assert method.checkpoint_file(bench, tokenizer) == name


def test_a_later_stage_field_leaves_an_earlier_stage_name_alone(data):
    """LightningDOT's fine-tuning fields do not enter its pre-training checkpoint's name; every
    other field does, so a field added without a stage tag can only retrain, never serve a
    stale stage."""
    bench, tokenizer = data
    base = LightningDOTConfig.smoke()
    first = LightningDOTMethod(base).pretrain_checkpoint_file(bench, tokenizer)
    finetune_only = {"finetune_steps": 7, "finetune_lr": 0.5}
    for field, value in finetune_only.items():
        other = LightningDOTMethod(dataclasses.replace(base, **{field: value}))
        assert other.pretrain_checkpoint_file(bench, tokenizer) == first, field
        assert (other.checkpoint_file(bench, tokenizer)
                != LightningDOTMethod(base).checkpoint_file(bench, tokenizer))
    shared = [f.name for f in dataclasses.fields(base)
              if f.name not in finetune_only and not f.metadata.get("switch")]
    assert set(base.to_dict(without_stages=("finetune",))) == set(shared)
    for field in ("hidden", "mask_prob", "pretrain_lr", "seed"):
        value = getattr(base, field) * 2 if field != "seed" else 5
        other = LightningDOTMethod(dataclasses.replace(base, **{field: value}))
        assert other.pretrain_checkpoint_file(bench, tokenizer) != first, field


def test_model_device():
    model = torch.nn.Linear(2, 2)
    assert model_device(model).type == "cpu" and model_device(model, "cpu").type == "cpu"
