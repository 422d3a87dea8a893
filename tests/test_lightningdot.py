"""LightningDOT: masking statistics, each objective against a hand computation, fusion only through
the objectives, gradients into both encoders, the task schedule, and pre-train +
fine-tune caching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from course_lib.core.losses import IGNORE, VMLM, batch_scores, contrastive_loss, mask_tokens
from course_lib.core.tokens import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.lightningdot.method import (
    LightningDOTMethod,
    task_schedule,
    train_lightningdot,
)
from course_lib.methods.lightningdot.model import (
    SMRCKL,
    SMRFR,
    LightningDOT,
    LightningDOTConfig,
    mask_regions,
)

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=120, n_val=20, n_test=20, n_pretrain=120, n_compositional=1)


@pytest.fixture(scope="module")
def ld_tokenizer(bench):
    # pre-training captions have words of their own ("stock photo ..."), so both corpora feed it
    return build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)


def small_config(**kw) -> LightningDOTConfig:
    return LightningDOTConfig(**{"hidden": 16, "layers": 1, "heads": 2, "batch_size": 16,
                                 "pretrain_steps": 6, "finetune_steps": 6, **kw})


def pair_batch(split, tokenizer, n=8):
    collate = PairCollate(tokenizer)
    return collate([PairDataset(split)[t] for t in range(n)])


# ------------------------------------------------------------------------------------------ masking

def _random_captions(g, B: int, T: int, V: int):
    """(ids, attention) of B captions [CLS] words [SEP] [PAD].. of 1 to T - 2 random words."""
    ids = torch.randint(len(SPECIAL_TOKENS), V, (B, T), generator=g)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    attention = (torch.arange(T)[None] < lengths[:, None]).long()
    ids[:, 0] = CLS_ID
    ids[torch.arange(B), lengths - 1] = SEP_ID
    ids[attention == 0] = PAD_ID
    return ids, attention


def test_mask_tokens_statistics_and_labels():
    g = torch.Generator().manual_seed(0)
    B, T, V = 4000, 14, 60
    ids, attention = _random_captions(g, B, T, V)
    masked, labels = mask_tokens(ids, attention, V, 0.15, generator=g)
    picked = labels != IGNORE
    real = attention.bool() & (ids != CLS_ID) & (ids != SEP_ID)
    assert not (picked & ~real).any(), "only real words may be masked"
    assert picked.any(1).all(), "every caption gets at least one masked word"
    assert torch.equal(labels[picked], ids[picked])
    assert torch.equal(masked[~picked], ids[~picked]), "unpicked tokens are untouched"
    # a caption of n words expects n * 0.15 picks, plus one forced pick when none came: (0.85)^n
    n = real.sum(1).double()
    drawn, forced = (n * 0.15).sum().item(), (0.85 ** n).sum().item()
    assert abs(picked.sum().item() / (drawn + forced) - 1) < 0.03
    # drawn picks split 80/10/10; a forced pick always becomes [MASK] (UNITER)
    to_mask = (masked[picked] == MASK_ID).float().mean().item()
    kept = (masked[picked] == ids[picked]).float().mean().item()
    share_drawn = drawn / (drawn + forced)
    assert abs(to_mask - (0.8 * share_drawn + 1 - share_drawn)) < 0.02
    assert abs(kept - share_drawn * (0.1 + 0.1 / V)) < 0.02  # a random word may repeat
    swapped = picked & (masked != MASK_ID) & (masked != ids)
    never_special = (masked[swapped] >= len(SPECIAL_TOKENS)).all()
    assert never_special, "random replacements are never special tokens"


def test_mask_tokens_forces_the_first_word_as_uniter():
    # UNITER's random_word: when no word was drawn, the first word is picked and becomes [MASK]
    g = torch.Generator().manual_seed(2)
    B, T, V = 300, 9, 60
    ids, attention = _random_captions(g, B, T, V)
    masked, labels = mask_tokens(ids, attention, V, 0.0, generator=g)  # no word is ever drawn
    picked = labels != IGNORE
    first = torch.zeros_like(picked)
    first[:, 1] = True  # position 0 is [CLS]
    assert torch.equal(picked, first), "exactly the first real word of each caption"
    assert (masked[picked] == MASK_ID).all() and torch.equal(labels[picked], ids[picked])
    assert torch.equal(masked[~picked], ids[~picked])
    # with mask_prob > 0, a caption with draws keeps them and gets no forced pick
    masked, labels = mask_tokens(ids, attention, V, 1.0, generator=g)
    real = attention.bool() & (ids != CLS_ID) & (ids != SEP_ID)
    assert torch.equal(labels != IGNORE, real)


def test_mask_regions_statistics():
    g = torch.Generator().manual_seed(1)
    real = torch.rand(5000, 6, generator=g) < 0.8
    real[:, 0] = True
    picked = mask_regions(real, 0.15, generator=g)
    assert not (picked & ~real).any()
    assert picked.any(1).all()
    n = real.sum(1).double()
    assert abs(picked.sum().item() / (n * 0.15 + 0.85 ** n).sum().item() - 1) < 0.03


# ------------------------------------------------------------------------------- objectives by hand

def test_vmlm_equals_hand_cross_entropy_and_fuses_image_cls():
    torch.manual_seed(0)
    B, T, V = 2, 4, 5
    words, image_cls = torch.randn(B, T, V), torch.randn(B, V)
    labels = torch.full((B, T), IGNORE)
    labels[0, 1], labels[1, 2], labels[1, 3] = 3, 0, 4
    loss = VMLM(V, V, fuse=True)
    loss.head = nn.Identity()  # logits = z_mk + h0, so the loss can be computed by hand
    expected = []
    for b, t in [(0, 1), (1, 2), (1, 3)]:
        logits = (words[b, t] + image_cls[b]).tolist()
        expected.append(-(logits[labels[b, t]] - math.log(sum(math.exp(x) for x in logits))))
    assert abs(loss(words, image_cls, labels).item() - sum(expected) / 3) < TOL
    plain = VMLM(V, V, fuse=False)
    plain.head = nn.Identity()
    assert abs(plain(words, image_cls, labels).item()
               - plain(words, torch.zeros(B, V), labels).item()) < TOL
    assert abs(loss(words, image_cls, labels).item()
               - plain(words, image_cls, labels).item()) > 1e-3


def test_smrfr_equals_hand_squared_distance():
    torch.manual_seed(1)
    B, R, D = 2, 3, 4
    states, text_cls, features = torch.randn(B, R, D), torch.randn(B, D), torch.randn(B, R, D)
    masked = torch.tensor([[True, False, False], [False, True, True]])
    loss = SMRFR(D, D, fuse=True)
    loss.head = nn.Identity()
    expected = [sum((states[b, r, d] + text_cls[b, d] - features[b, r, d]).item() ** 2
                    for d in range(D))
                for b, r in [(0, 0), (1, 1), (1, 2)]]
    assert abs(loss(states, text_cls, features, masked).item() - sum(expected) / 3) < TOL


def test_smrc_kl_equals_hand_kl_divergence():
    torch.manual_seed(2)
    B, R, C = 2, 2, 3
    states, text_cls = torch.randn(B, R, C), torch.randn(B, C)
    soft = torch.tensor([[[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]], [[1.0, 0.0, 0.0], [0.1, 0.8, 0.1]]])
    masked = torch.tensor([[False, True], [True, True]])
    loss = SMRCKL(C, C, fuse=True)
    loss.head = nn.Identity()
    expected = []
    for b, r in [(0, 1), (1, 0), (1, 1)]:
        logits = (states[b, r] + text_cls[b]).tolist()
        log_z = math.log(sum(math.exp(x) for x in logits))
        expected.append(sum(p * (math.log(p) - (x - log_z))
                            for p, x in zip(soft[b, r].tolist(), logits, strict=True) if p > 0))
    assert abs(loss(states, text_cls, soft, masked).item() - sum(expected) / 3) < TOL


# ---------------------------------------------------------------------------------------- the model

def test_scores_are_dot_products_of_independent_encodings(bench, ld_tokenizer):
    torch.manual_seed(0)
    split = bench["train"]
    model = LightningDOT(small_config(), len(ld_tokenizer), split.regions.shape[-1],
                         split.region_classes.shape[-1]).eval()
    batch = pair_batch(split, ld_tokenizer, 6)
    with torch.no_grad():
        scores = batch_scores(*model(batch))  # (6, 6)
        assert scores.shape == (6, 6)
        # each image and caption encoded alone: no cross-attention, so the same numbers
        for i in range(6):
            one = {k: v[i:i + 1] for k, v in batch.items() if torch.is_tensor(v)}
            h0 = model.encode_images(one)
            for j in range(6):
                two = {k: v[j:j + 1] for k, v in batch.items() if torch.is_tensor(v)}
                length = int(two["attention_mask"].sum())
                z0 = model.encode_texts({"input_ids": two["input_ids"][:, :length],
                                         "attention_mask": two["attention_mask"][:, :length]})
                assert abs((h0 @ z0.T).item() - scores[i, j].item()) < 1e-4
        assert abs(model.objective("cmr", batch).item() - contrastive_loss(scores).item()) < TOL


@pytest.mark.parametrize("task", ["cmr", "vmlm", "smrfr", "smrc_kl"])
def test_every_fused_objective_trains_both_encoders(bench, ld_tokenizer, task):
    torch.manual_seed(0)
    split = bench["train"]
    model = LightningDOT(small_config(), len(ld_tokenizer), split.regions.shape[-1],
                         split.region_classes.shape[-1])
    model.objective(task, pair_batch(split, ld_tokenizer)).backward()
    for encoder in (model.image_encoder, model.text_encoder):
        grads = [p.grad for p in encoder.parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum().item() for g in grads) > 0


@pytest.mark.parametrize("task,silent", [("vmlm", "image_encoder"), ("smrfr", "text_encoder")])
def test_without_fusion_mlm_and_mrm_stay_in_one_modality(bench, ld_tokenizer, task, silent):
    torch.manual_seed(0)
    split = bench["train"]
    model = LightningDOT(small_config(fuse=False), len(ld_tokenizer), split.regions.shape[-1],
                         split.region_classes.shape[-1])
    model.objective(task, pair_batch(split, ld_tokenizer)).backward()
    grads = [p.grad for p in getattr(model, silent).parameters() if p.grad is not None]
    assert sum(g.abs().sum().item() for g in grads) == 0


def test_task_schedule_follows_the_ratios_and_the_seed():
    schedule = task_schedule({"cmr": 2, "vmlm": 1, "smrfr": 1, "smrc_kl": 0}, 8000, seed=3)
    counts = {name: schedule.count(name) / 8000 for name in set(schedule)}
    assert set(counts) == {"cmr", "vmlm", "smrfr"}
    assert abs(counts["cmr"] - 0.5) < 0.02 and abs(counts["vmlm"] - 0.25) < 0.02
    assert schedule == task_schedule({"cmr": 2, "vmlm": 1, "smrfr": 1, "smrc_kl": 0}, 8000, seed=3)
    with pytest.raises(ValueError, match="pretrain_tasks"):
        LightningDOTConfig(pretrain_tasks={"itm": 1})


def test_pretrain_then_finetune_logs_each_task_and_reuses_checkpoints(bench, ld_tokenizer,
                                                                      tmp_path):
    config = small_config(pretrain_steps=12, finetune_steps=4)
    paths = dict(pretrain_checkpoint=tmp_path / "pre.pt", checkpoint_path=tmp_path / "ft.pt")
    model, histories = train_lightningdot(bench, ld_tokenizer, config, progress=False, **paths)
    logged = set().union(*(row.keys() for row in histories["pretrain"]))
    assert {"cmr_loss", "vmlm_loss", "smrfr_loss", "smrc_kl_loss"} <= logged
    assert all(math.isfinite(row["loss"]) for row in histories["finetune"])
    again, _ = train_lightningdot(bench, ld_tokenizer, config, progress=False, **paths)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_method_caches_pretraining_apart_from_finetuning(bench, ld_tokenizer, tmp_path):
    first = LightningDOTMethod(small_config(), progress=False).fit(bench, ld_tokenizer, tmp_path)
    other_config = small_config(finetune_lr=1e-4)
    other = LightningDOTMethod(other_config, progress=False).fit(bench, ld_tokenizer, tmp_path)
    assert first.pretrain_checkpoint == other.pretrain_checkpoint  # one pre-training serves both
    assert first.checkpoint_path != other.checkpoint_path
    sims = first.similarity(bench["test"])
    assert sims.shape == (bench["test"].n_images, bench["test"].n_texts)
    top = first.query_fn(bench["test"], top_k=5)()
    assert np.array_equal(top, torch.topk(sims[:, 0], 5).indices.numpy())
    captions = first.image_query_fn(bench["test"], top_k=5, image_index=3)()  # text retrieval
    assert np.array_equal(captions, torch.topk(sims[3], 5).indices.numpy())


def test_the_language_encoder_can_start_from_a_pretrained_bert(bench, minilm_folder):
    from transformers import AutoModel

    from course_lib.core.tokens import SpecialTokens
    from course_lib.data.tokenizer import tokenizer_for

    name, folder = minilm_folder
    wordpieces = tokenizer_for(bench["train"], name=folder)
    config = small_config(text_encoder=name, hidden=384, heads=6)
    model = LightningDOT(config, len(wordpieces), bench["train"].regions.shape[-1], 8,
                         SpecialTokens.of(wordpieces))
    reference = AutoModel.from_pretrained(folder).eval()  # the same weights, loaded on their own
    texts = wordpieces(bench["val"].captions[:4], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        z0 = model.encode_texts(dict(texts))  # (4, 384)
        expected = reference(**texts).last_hidden_state[:, 0]  # BERT's [CLS] state
    assert z0.shape == (4, 384) and torch.allclose(z0, expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"hidden=64.*LightningDOTConfig\(hidden=384\)"):
        LightningDOT(small_config(text_encoder=name, hidden=64), len(wordpieces), 16, 8,
                     SpecialTokens.of(wordpieces))
    # the word tokenizer's ids do not fit BERT's table
    with pytest.raises(ValueError, match="tokenizer_for"):
        LightningDOT(config, 300, 16, 8)
    assert (LightningDOTMethod(config).pretrain_stage(bench, wordpieces).reads["text_encoder"]
            == name)


def test_a_pretrained_text_encoder_can_learn_at_a_fraction_of_the_rate(bench, minilm_folder):
    from transformers import AutoModel

    from course_lib.core.optimizer import param_groups
    from course_lib.core.tokens import SpecialTokens
    from course_lib.data.tokenizer import tokenizer_for

    name, folder = minilm_folder
    wordpieces = tokenizer_for(bench["train"], name=folder)
    config = small_config(text_encoder=name, hidden=384, heads=6, text_encoder_lr_scale=0.1)
    model = LightningDOT(config, len(wordpieces), bench["train"].regions.shape[-1], 8,
                         SpecialTokens.of(wordpieces))
    groups = param_groups(model, 0.01, 1e-3, config.lr_scales())
    slow = [p for g in groups if g.get("lr") == pytest.approx(1e-4) for p in g["params"]]
    # the scaled groups hold exactly MiniLM's weights (counted on their own; its pooler is not used)
    minilm = AutoModel.from_pretrained(folder).named_parameters()
    assert (sum(p.numel() for p in slow)
            == sum(p.numel() for n, p in minilm if not n.startswith("pooler.")))
    assert {id(p) for p in slow} == {id(p) for p in model.text_encoder.parameters()}
    assert small_config(text_encoder=name, hidden=384, heads=6).lr_scales() is None
    with pytest.raises(ValueError,
                       match=r"LightningDOTConfig\(text_encoder_lr_scale=0.1\).*set text_encoder"):
        small_config(text_encoder_lr_scale=0.1)
