"""Checkpoint names change with anything that changes what training produces, and only then."""

import pytest
import torch

from course_lib.checkpoints import checkpoint_name, model_device
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer


@pytest.fixture(scope="module")
def data():
    bench = make_benchmark(SyntheticConfig.smoke(n_train=30, n_val=10, n_test=10, n_pretrain=10,
                                                 n_compositional=2), seed=0)
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


def test_model_device():
    model = torch.nn.Linear(2, 2)
    assert model_device(model).type == "cpu" and model_device(model, "cpu").type == "cpu"
