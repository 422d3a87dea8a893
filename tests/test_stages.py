"""A stage's file name changes with anything that changes what training produces, and only then
(core.stages.Stage); each method says what its stages are made of."""

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.checkpoints import model_device
from course_lib.core.stages import Stage, config_fields, data_digest
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.lightningdot.method import FINETUNE_FIELDS, LightningDOTMethod
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

SIZES = dict(n_train=30, n_val=10, n_test=10, n_pretrain=10, n_compositional=2)


def checkpoint_name(prefix, reads, data, vocabulary, *starts_from, version=1) -> str:
    return Stage(prefix, reads, data, vocabulary, starts_from, version).file_name


def make_bench(**knobs) -> dict:
    return make_benchmark(SyntheticConfig.smoke(**{**SIZES, **knobs}), seed=0)


@pytest.fixture(scope="module")
def data():
    bench = make_bench()
    return bench, build_word_tokenizer(bench["train"].captions)


def test_name_tracks_config_data_vocabulary_and_what_it_starts_from(data):
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
    parent = Stage("p", {"lr": 1e-3}, bench["train"], tokenizer)
    assert (checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer, parent)
            == checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer, parent.file_name))
    # an absent parent (None) is no parent
    assert checkpoint_name("m", {"lr": 1e-3}, bench["train"], tokenizer, None) == name
    assert checkpoint_name("m", {"lr": 1e-3}, bench["train"], None) != name  # reads no text


def test_config_fields_reads_every_field_but_those_left_out():
    config = VsePPConfig.smoke()
    every = config_fields(config)
    assert list(every) == [f.name for f in dataclasses.fields(config)]
    assert every["max_steps"] == config.max_steps
    assert set(every) - set(config_fields(config, without=("lr", "seed"))) == {"lr", "seed"}
    with pytest.raises(ValueError, match="no fields \\['lrr'\\]"):
        config_fields(config, without=("lrr",))


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
    name = method.stage(bench, tokenizer).file_name
    assert name.startswith("lightningdot-") and name == method.stage(bench, tokenizer).file_name
    assert method.stage(more, tokenizer).file_name != name
    assert (method.pretrain_stage(more, tokenizer).file_name
            != method.pretrain_stage(bench, tokenizer).file_name)
    # only the pre-training corpus's region features change: both names change
    noisy = dataclasses.replace(bench["pretrain"], regions=bench["pretrain"].regions + 0.01)
    noisy_bench = {**bench, "pretrain": noisy}
    assert (method.pretrain_stage(noisy_bench, tokenizer).file_name
            != method.pretrain_stage(bench, tokenizer).file_name)
    assert method.stage(noisy_bench, tokenizer).file_name != name
    # without pre-training the corpus plays no part
    plain = LightningDOTMethod(LightningDOTConfig.smoke(pretrain_steps=0))
    assert plain.pretrain_stage(bench, tokenizer) is None
    assert plain.stage(more, tokenizer).file_name == plain.stage(bench, tokenizer).file_name


def test_the_method_stage_is_the_name_fit_uses(data, tmp_path, monkeypatch):
    bench, tokenizer = data
    method = VsePPMethod(VsePPConfig.smoke(), progress=False)
    monkeypatch.setattr(method, "train", lambda *args: (None, None))  # name only, no training
    method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert method.checkpoint_path == tmp_path / method.stage(bench, tokenizer).file_name
    assert method.stage(bench, tokenizer).file_name == checkpoint_name(
        "vsepp", dataclasses.asdict(method.config), bench["train"], tokenizer,
        version=method.format_version)


def test_a_name_hashes_what_the_model_is_trained_from_not_its_code(data, monkeypatch):
    """The name covers the fields read, data, vocabulary, the stages it starts from and the
    declared format version; the source text of the code that trains it plays no part (an edit
    that changes no number keeps it)."""
    bench, tokenizer = data
    method = VsePPMethod(VsePPConfig.smoke())
    name = method.stage(bench, tokenizer).file_name
    assert name == checkpoint_name("vsepp", dataclasses.asdict(method.config), bench["train"],
                                   tokenizer, version=1)
    assert (set(method.stage(bench, tokenizer).fingerprint)
            == {"format", "version", "config", "vocab", "data", "starts_from"})
    monkeypatch.setattr(VsePPMethod, "format_version", 2)  # a deliberate change of layout or recipe
    assert method.stage(bench, tokenizer).file_name != name
    monkeypatch.undo()
    assert method.stage(bench, tokenizer).file_name == name


def test_a_later_stage_field_leaves_an_earlier_stage_name_alone(data):
    """LightningDOT's fine-tuning fields (FINETUNE_FIELDS) do not enter its pre-training
    checkpoint's name; every other field does, so a field added to the config can only retrain,
    never serve a stale stage."""
    bench, tokenizer = data
    base = LightningDOTConfig.smoke()
    first = LightningDOTMethod(base).pretrain_stage(bench, tokenizer).file_name
    finetune_only = {"finetune_steps": 7, "finetune_lr": 0.5}
    assert set(finetune_only) == set(FINETUNE_FIELDS)
    for field, value in finetune_only.items():
        other = LightningDOTMethod(dataclasses.replace(base, **{field: value}))
        assert other.pretrain_stage(bench, tokenizer).file_name == first, field
        assert (other.stage(bench, tokenizer).file_name
                != LightningDOTMethod(base).stage(bench, tokenizer).file_name)
    shared = [f.name for f in dataclasses.fields(base) if f.name not in finetune_only]
    assert set(LightningDOTMethod(base).pretrain_stage(bench, tokenizer).reads) == set(shared)
    for field, value in {"hidden": 64, "mask_prob": 0.3, "pretrain_lr": 5e-4, "seed": 5,
                         "text_encoder": "a-bert"}.items():
        other = LightningDOTMethod(dataclasses.replace(base, **{field: value}))
        assert other.pretrain_stage(bench, tokenizer).file_name != first, field


def test_model_device():
    model = torch.nn.Linear(2, 2)
    assert model_device(model).type == "cpu" and model_device(model, "cpu").type == "cpu"
