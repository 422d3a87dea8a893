"""Fast & Slow distillation over mined candidates (course_lib.methods.fast_slow.distill): the mined
lists against a naive ranking, the loss against a caption-by-caption computation with the teacher
scored pair by pair, the no-teacher control's one-hot target, and the checkpoint names (a plain Fast
model's name ignores the distillation fields)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.losses import joint_nce_loss
from course_lib.data.datasets import ImageDataset, PairCollate, PairDataset
from course_lib.methods.encoding import encode_split
from course_lib.methods.fast_slow.distill import (
    mine_candidates,
    mined_distill_loss,
    teacher_pair_scores,
)
from course_lib.methods.fast_slow.method import (
    DISTILL_FIELDS,
    FastMethod,
    SlowMethod,
    train_fast,
)
from course_lib.methods.fast_slow.model import FastConfig, FastModel, SlowConfig, SlowModel

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=40, n_val=10, n_test=16, n_pretrain=130, n_compositional=1)
TINY_FAST = dict(hidden=8, embed_dim=8, channels=(4, 8, 8))


@pytest.fixture(scope="module")
def models(tok):
    torch.manual_seed(0)
    slow = SlowModel(len(tok), SlowConfig(hidden=16, heads=2, layers=2, channels=(4, 8, 8),
                                          dropout=0.0)).eval()
    fast = FastModel(len(tok), FastConfig(**TINY_FAST)).eval()
    return slow, fast


def pair_batch(split, tokenizer, rows):
    return PairCollate(tokenizer)([PairDataset(split, modality="pixels")[t] for t in rows])


def test_mined_candidates_are_the_own_image_then_the_naive_top_k(models, bench, tok):
    _, fast = models
    split, k = bench["train"], 5
    candidates = mine_candidates(fast, split, tok, k)  # (T, k)
    assert candidates.shape == (split.n_texts, k)
    image_emb, text_emb = encode_split(fast, split, tok)
    for t in (0, 3, 17, split.n_texts - 1):
        own = int(split.txt2img[t])
        ranked = torch.argsort(image_emb @ text_emb[t], descending=True).tolist()
        order = [i for i in ranked if i != own]
        assert candidates[t, 0].item() == own
        assert candidates[t, 1:].tolist() == order[:k - 1]
    with pytest.raises(ValueError, match="distill_top_k"):
        mine_candidates(fast, split, tok, 1)


def test_mined_distillation_loss_against_a_caption_by_caption_loop(models, bench, tok):
    """For each of the batch's first S captions: softmax over its K candidates of h / tau (each pair
    scored alone by Slow) against log_softmax of f.g / tau, cross-entropy, mean over the S; +
    alpha * eq. 4 over the whole batch; the control's target is the caption's own image."""
    slow, fast = models
    split, config = bench["train"], FastConfig(**TINY_FAST, distill=True, tau=2.0, alpha=0.3,
                                               distill_batch_size=3,
                                               distill_candidates="mined", distill_top_k=4)
    candidates = mine_candidates(fast, split, tok, config.distill_top_k)
    rows = [0, 6, 13, 21, 30]  # the teacher scores the first 3
    batch = pair_batch(split, tok, rows)
    images = ImageDataset(split, modality="pixels")
    with torch.no_grad():
        out = mined_distill_loss(slow, config, candidates, split)(fast, batch)
        out_control = mined_distill_loss(None, config, candidates, split)(fast, batch)
        text_emb = fast.encode_texts(batch)  # (B, E)
        own = fast.encode_images({"pixels": batch["pixels"]})  # (B, E)
        expected, expected_control = 0.0, 0.0
        for b, t in enumerate(rows[:3]):
            pixels = torch.stack([images[int(i)]["pixels"] for i in candidates[t]])  # (K, 3, H, W)
            texts = {k: batch[k][b:b + 1].expand(len(pixels), -1)
                     for k in ("input_ids", "attention_mask")}
            h = slow.score({"pixels": pixels}, texts)  # (K,) pair by pair
            student = fast.encode_images({"pixels": pixels}) @ text_emb[b]  # (K,)
            log_q = torch.log_softmax(student / config.tau, 0)
            expected += -(torch.softmax(h / config.tau, 0) * log_q).sum().item() / 3
            expected_control += -log_q[0].item() / 3  # the own image is candidate 0
        nce = joint_nce_loss(own @ text_emb.T).item()  # (5, 5): eq. 4 over the whole batch
    assert out["distill"].item() == pytest.approx(expected, rel=1e-4)
    assert out["nce"].item() == pytest.approx(nce, rel=1e-4)
    assert out["loss"].item() == pytest.approx(expected + 0.3 * nce, rel=1e-4)
    assert out_control["distill"].item() == pytest.approx(expected_control, rel=1e-4)


def test_teacher_pair_scores_gather_each_image_once(models, bench, tok):
    slow, _ = models
    batch = pair_batch(bench["train"], tok, [1, 2, 3])
    image_rows, text_rows = torch.tensor([2, 0, 2, 1]), torch.tensor([0, 0, 2, 1])
    got = teacher_pair_scores(slow, {"pixels": batch["pixels"]}, image_rows, batch, text_rows)
    with torch.no_grad():
        texts = {k: batch[k][text_rows] for k in ("input_ids", "attention_mask")}
        want = slow.score({"pixels": batch["pixels"][image_rows]}, texts)
    assert torch.allclose(got, want, atol=1e-4)


def test_mined_distillation_trains_the_student_and_names_its_checkpoint(models, bench, tok,
                                                                        tmp_path):
    slow, _ = models
    config = FastConfig(**TINY_FAST, max_steps=3, batch_size=8, stem_steps=3, fresh_scenes=0,
                        image_init="scratch", distill=True, distill_steps=3, distill_batch_size=4,
                        distill_candidates="mined", distill_top_k=3)
    plain, _ = train_fast(bench, tok, dataclasses.replace(config, distill=False), progress=False)
    student, history = train_fast(bench, tok, config, teacher=slow, init=plain, progress=False)
    assert len(history) > 0 and all(np.isfinite(r["loss"]) for r in history if "loss" in r)
    moved = [not torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                   student.state_dict().values(), strict=True)
             if a.is_floating_point()]
    assert any(moved)
    with pytest.raises(ValueError, match="distill_candidates"):
        FastConfig(distill_candidates="hardest")


def test_a_plain_fast_models_name_ignores_the_distillation_fields(bench, tok):
    """The plain model's checkpoint (and shipped file) is named without the fields only eq. 8 reads,
    so a new distillation setting never retrains it; the distilled model's name follows them."""
    plain = FastMethod(FastConfig.smoke())
    other = dataclasses.replace(plain.config, distill_candidates="mined", tau=3.0, distill_steps=7)
    assert FastMethod(other).stage(bench, tok).file_name == plain.stage(bench, tok).file_name
    assert FastMethod(dataclasses.replace(plain.config, lr=0.5)).stage(bench, tok).file_name != \
        plain.stage(bench, tok).file_name
    teacher = SlowMethod(SlowConfig.smoke())
    distilled = [FastMethod(dataclasses.replace(c, distill=True), name="fast-distilled",
                            teacher=teacher, init=plain)
                 for c in (plain.config, other)]
    assert distilled[0].stage(bench, tok).file_name != distilled[1].stage(bench, tok).file_name
    distill_only = set(distilled[0].stage(bench, tok).reads) - set(plain.stage(bench, tok).reads)
    assert distill_only == set(DISTILL_FIELDS) == {
        "distill_batch_size", "distill_steps", "distill_lr", "distill_start",
        "distill_candidates", "distill_top_k", "tau", "alpha"}
