"""The text-tower ceiling study: the hand-built image vector as the split's one region, f(x) as a
Linear of it checked by hand, and a short training that learns (its loss falls, its curve
is logged)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.encoders import BagOfWordsEncoder, BiGRUEncoder, TransformerTextEncoder
from course_lib.core.settings import seed_everything
from course_lib.core.tokens import SpecialTokens
from course_lib.data.bag_of_objects import image_vectors
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.methods.encoding import similarity
from course_lib.methods.fast_slow.method import nce_loss
from course_lib.methods.fast_slow.model import FastConfig
from course_lib.studies.text_ceiling import (
    BagOfObjectsDualEncoder,
    train_text_ceiling,
    with_bag_of_objects,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=80, n_val=10, n_test=16, n_pretrain=20, n_compositional=1)
SMALL = dict(hidden=16, embed_dim=16, batch_size=16, fresh_scenes=0, text_layers=1)


def test_with_bag_of_objects_is_the_hand_built_vector(bench):
    split = with_bag_of_objects(bench["val"])
    vectors = image_vectors(bench["val"].scenes)  # (N, D)
    assert split.regions.shape == (len(vectors), 1, vectors.shape[1])
    assert np.array_equal(split.regions[:, 0], vectors) and split.region_mask.all()
    assert (split.captions == bench["val"].captions
            and np.array_equal(split.txt2img, bench["val"].txt2img))
    with pytest.raises(ValueError, match="synthetic benchmark only"):
        with_bag_of_objects(dataclasses.replace(bench["val"], scenes=None))


@pytest.mark.parametrize("tower, kind", [("bow", BagOfWordsEncoder), ("gru", BiGRUEncoder),
                                         ("transformer", TransformerTextEncoder)])
def test_similarity_is_linear_image_times_text(bench, tok, tower, kind):
    """sims = (vectors W^T + b) g(y)^T, with g(y) Fast's own text tower of that kind."""
    torch.manual_seed(0)
    split = with_bag_of_objects(bench["val"])
    model = BagOfObjectsDualEncoder(len(tok), split.regions.shape[-1],
                                    FastConfig(**SMALL, text_tower=tower),
                                    SpecialTokens.of(tok)).eval()
    assert isinstance(model.text, kind)
    sims = similarity(model, split, tok)  # (N, T)
    with torch.no_grad():
        f = (torch.from_numpy(split.regions[:, 0]) @ model.image_proj.weight.T
             + model.image_proj.bias)  # (N, E)
        texts = []
        for c in split.captions[:3]:
            values = (torch.tensor(a) for a in tok([c], padding=True).values())
            fields = dict(zip(("input_ids", "attention_mask"), values, strict=True))
            texts.append(model.encode_texts(fields)[0])
    assert torch.allclose(sims[:, :3], f @ torch.stack(texts).T, atol=1e-4)


def test_train_text_ceiling_learns(bench, tok):
    """After 150 steps, eq. 4 on a fixed batch of training pairs is below its seeded start."""
    config = FastConfig(**SMALL, text_tower="bow", max_steps=150, lr=1e-2)
    train = with_bag_of_objects(bench["train"])
    # 16 images
    batch = PairCollate(tok)([PairDataset(train, modality="regions")[t] for t in range(0, 80, 5)])
    seed_everything(config.seed)  # the start train_text_ceiling builds
    start = BagOfObjectsDualEncoder(len(tok), train.regions.shape[-1], config,
                                    SpecialTokens.of(tok)).eval()
    model, history = train_text_ceiling(bench, tok, config, eval_every=75, progress=False)
    with torch.no_grad():
        assert nce_loss(model, batch) < nce_loss(start, batch) - 0.5
    last = history.rows(eval=True)[-1]
    assert last["step"] == 150 and {"val_t2i_r1", "train_t2i_r1"} <= set(last)
    assert not model.training
