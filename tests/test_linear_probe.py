"""The linear probe (course_lib.methods.linear_probe): its encoders against transformers' MiniLM and
a hand-written mean, its loss against the two cross-entropies written out, a frozen text side that a
training step leaves untouched, BertTextEncoder.freeze, and the Method end to end with its best val
point kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.core.encoders import BertTextEncoder
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.data.tokenizer import tokenizer_for
from course_lib.methods.linear_probe import (
    LinearProbeConfig,
    LinearProbeMethod,
    build_linear_probe,
    probe_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=40, n_val=12, n_test=12, n_pretrain=10, n_compositional=1)


@pytest.fixture(scope="module")
def wordpieces(bench, minilm_folder):
    return tokenizer_for(bench["train"], name=minilm_folder[1])


@pytest.fixture(scope="module")
def probe(bench, wordpieces, minilm_folder):
    torch.manual_seed(0)
    return build_linear_probe(LinearProbeConfig.smoke(text_encoder=minilm_folder[1]),
                              bench["train"], wordpieces)


def batch_of(bench, wordpieces, rows):
    return PairCollate(wordpieces)([PairDataset(bench["train"])[t] for t in rows])


def test_encoders_are_linear_maps_of_the_frozen_means(probe, bench, wordpieces, minilm_folder):
    from transformers import AutoModel

    batch = batch_of(bench, wordpieces, range(6))
    minilm = AutoModel.from_pretrained(minilm_folder[1]).eval()
    with torch.no_grad():
        states = minilm(input_ids=batch["input_ids"],
                        attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        text_mean = (states * mask).sum(1) / mask.sum(1)  # (B, 384): MiniLM's sentence vector
        # (B, R, 1): the synthetic scenes pad their regions
        cells = batch["region_mask"][..., None].float()
        image_mean = (batch["regions"] * cells).sum(1) / cells.sum(1)  # (B, D)
        expected_text = F.normalize(text_mean @ probe.text_proj.weight.T
                                    + probe.text_proj.bias, dim=-1)
        expected_image = F.normalize(image_mean @ probe.image_proj.weight.T
                                     + probe.image_proj.bias, dim=-1)
        probe.eval()
        torch.testing.assert_close(probe.encode_texts(batch), expected_text, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(probe.encode_images(batch), expected_image, rtol=1e-4, atol=1e-4)


def test_loss_is_the_mean_of_both_cross_entropies(probe, bench, wordpieces):
    batch = batch_of(bench, wordpieces, range(5))
    with torch.no_grad():
        images, texts = probe(batch)
        logits = probe.logit_scale.exp() * images @ texts.T  # (B, B)
        by_hand = sum(-torch.log_softmax(logits[i], 0)[i] - torch.log_softmax(logits[:, i], 0)[i]
                      for i in range(5)) / 10
        assert torch.allclose(probe_loss(probe, batch)["loss"], by_hand, atol=1e-5)


def test_a_training_step_leaves_the_text_encoder_as_loaded(bench, wordpieces, minilm_folder):
    torch.manual_seed(0)
    model = build_linear_probe(LinearProbeConfig.smoke(text_encoder=minilm_folder[1]),
                               bench["train"], wordpieces)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    dropouts = [m for m in model.text_encoder.modules() if isinstance(m, torch.nn.Dropout)]
    # frozen parts stay in eval mode: no dropout
    assert dropouts and not any(m.training for m in dropouts)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    probe_loss(model, batch_of(bench, wordpieces, range(8)))["loss"].backward()
    optimizer.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"image_proj.weight", "image_proj.bias", "text_proj.weight", "text_proj.bias",
                       "logit_scale"}


def test_freeze_keeps_all_but_the_last_layers(minilm_folder):
    encoder = BertTextEncoder(None, pretrained_name=minilm_folder[1]).freeze(trainable_layers=2)
    trainable = {name.split(".")[3] for name, p in encoder.named_parameters()
                 if p.requires_grad and name.startswith("bert.encoder.layer.")}
    assert trainable == {"4", "5"}  # MiniLM's 6 layers: the last two train
    assert not any(p.requires_grad for p in encoder.bert.embeddings.parameters())
    encoder.freeze(trainable_layers=6)
    assert all(p.requires_grad for n, p in encoder.named_parameters() if "embeddings" not in n)
    with pytest.raises(ValueError, match=r"trainable_layers must be in \[0, 6\]"):
        encoder.freeze(7)


def test_the_method_keeps_its_best_val_point_and_ranks(bench, wordpieces, minilm_folder, tmp_path):
    config = LinearProbeConfig.smoke(text_encoder=minilm_folder[1], max_steps=8, batch_size=8)
    method = LinearProbeMethod(config, progress=False).fit(bench, wordpieces, cache_dir=tmp_path)
    evaluations = method.history.rows(eval=True)
    best = max(evaluations, key=lambda r: r["val_t2i_r1"])  # the first of equal values
    assert method.history[-1]["kept_step"] == best["step"]
    assert method.history[-1]["kept_val_t2i_r1"] == best["val_t2i_r1"]
    split = bench["test"]
    indices, scores = method.rank(split, "t2i", 3)
    sims = method.similarity(split)  # (N, T)
    assert torch.equal(indices[:, 0], sims.T.argmax(1))  # FAISS agrees with the dense product
    assert indices.shape == (split.n_text_queries, 3)
