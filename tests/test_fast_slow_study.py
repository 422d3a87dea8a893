"""Lesson 06's study helpers: per-direction h against a token-by-token loop and against the
library's cached scores, eq. 9 on dense scores by hand and against FastSlowCascade.rank, the softmax
entropy by hand, the teacher's cached batches against teacher_scores, the cached eq. 8 against
distill_loss, and the timed exercise's checker."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from course_lib.core.losses import batch_scores
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.exercises.errors import ExerciseError
from course_lib.exercises.fast_slow import check_score_one_caption
from course_lib.methods.fast_slow.distill import distill_loss, teacher_scores
from course_lib.methods.fast_slow.method import FastMethod, FastSlowCascade, SlowMethod, nce_loss
from course_lib.methods.fast_slow.model import FastConfig, FastModel, SlowConfig, SlowModel
from course_lib.methods.fast_slow.scoring import compute_states, score_cached_pairs
from course_lib.studies.fast_slow import (
    cached_distill_loss,
    cascade_ranks,
    direction_log_likelihoods,
    distill_from_cache,
    kl_to_teacher,
    slow_direction_scores,
    softmax_entropy,
    teacher_batches,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=80, n_val=10, n_test=16, n_pretrain=10, n_compositional=1)
SMALL = dict(hidden=16, heads=2, layers=2, channels=(4, 8, 8), dropout=0.0)
FAST_SMALL = dict(hidden=8, embed_dim=8, channels=(4, 8, 8), max_steps=4, batch_size=8,
                  image_init="scratch")


@pytest.fixture(scope="module")
def slow(bench, tok):
    torch.manual_seed(0)
    return SlowModel(len(tok), SlowConfig(**SMALL)).eval()


def _loop_direction(model: SlowModel, kvs: dict, words: list[int], direction: str) -> float:
    """One direction's log-likelihood of one caption, one word at a time: feed [CLS] and the words
    so far, read the last position's log-softmax at the next word."""
    decoder = model.forward_decoder if direction == "fwd" else model.backward_decoder
    words = words if direction == "fwd" else words[::-1]
    total = 0.0
    for t, word in enumerate(words):
        prefix = torch.tensor([[model.special.cls] + words[:t]])
        logits = model.output(decoder(model._embed(prefix), kvs[direction]))  # (1, t + 1, V)
        total += torch.log_softmax(logits[0, -1], -1)[word].item()
    return total


def test_directions_against_a_loop_and_their_sum_is_h(slow, bench, tok):
    batch = PairCollate(tok)([PairDataset(bench["test"], modality="pixels")[t] for t in (0, 3, 7)])
    with torch.no_grad():
        kvs = slow.keys_values(slow.visual_tokens(batch))
        fwd, bwd = direction_log_likelihoods(slow, kvs, batch)
        assert torch.allclose(fwd + bwd, slow.log_likelihood(kvs, batch), atol=1e-4)
        for b in range(3):
            # the words
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()[1:-1]
            one = {d: [kv[:, b:b + 1] for kv in layers] for d, layers in kvs.items()}
            assert fwd[b].item() == pytest.approx(_loop_direction(slow, one, ids, "fwd"), abs=1e-4)
            assert bwd[b].item() == pytest.approx(_loop_direction(slow, one, ids, "bwd"), abs=1e-4)
    assert fwd[0].item() != pytest.approx(bwd[0].item(), abs=1e-3)  # two decoders, two numbers


def test_slow_direction_scores_match_cached_pairs(slow, bench, tok):
    split = bench["test"]
    states = compute_states(slow, split, tok)
    queries = np.array([0, 5, 11])
    # chunks cross query boundaries
    fwd, bwd = slow_direction_scores(slow, states, queries, batch_size=7)
    N = split.n_images
    assert fwd.shape == bwd.shape == (3, N)
    images, texts = np.tile(np.arange(N), 3), np.repeat(queries, N)
    assert torch.allclose((fwd + bwd).reshape(-1),
                          score_cached_pairs(slow, states, images, texts), atol=1e-4)


def test_cascade_ranks_by_hand():
    first = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # the first stage ranks 0, 1, 2, 3
    # image 2 is the best by h, but the first stage drops it at K = 2
    second = torch.tensor([[1.0, 1.5, 9.0, 0.0]])
    ranks = {t: cascade_ranks(first, second, [t], top_k=2)[0] for t in range(4)}
    # top 2 re-ordered by h; beyond K the first stage's order
    assert ranks == {1: 0, 0: 1, 2: 2, 3: 3}
    ranks = {t: cascade_ranks(first, second, [t], top_k=2, beta=1.0)[0] for t in range(2)}
    assert ranks == {0: 0, 1: 1}  # h + f.g: 1 + 3 = 4 beats 1.5 + 2 = 3.5
    assert cascade_ranks(first, second, [2], top_k=4)[0] == 0  # K = N: h alone
    assert cascade_ranks(first, second, [1], top_k=1)[0] == 1  # K = 1: the first stage's ranking


@pytest.fixture(scope="module")
def fitted(bench, tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("fast_slow_study")
    # from scratch, as FAST_SMALL: 10 pre-training scenes are fewer than one batch of the stem
    slow = SlowMethod(SlowConfig(**SMALL, max_steps=4, batch_size=8, image_init="scratch"),
                      progress=False).fit(bench, tok, cache)
    fast = FastMethod(FastConfig(**FAST_SMALL), progress=False).fit(bench, tok, cache)
    return slow, fast


@pytest.mark.parametrize("top_k, beta", [(3, 0.0), (5, 0.5)])
def test_cascade_ranks_match_the_library_cascade(fitted, bench, top_k, beta):
    slow, fast = fitted
    split = bench["test"]
    queries = split.text_queries
    cascade = FastSlowCascade(fast, slow, top_k, beta=beta)
    indices, _ = cascade.rank(split, "t2i", split.n_images, queries)  # (Q, N) the whole order
    truth = np.asarray(split.txt2img)[queries]
    expected = (indices.numpy() == truth[:, None]).argmax(1)
    first = fast.similarity(split).T[torch.as_tensor(queries)]  # (Q, N) f.g
    second = slow.similarity(split).T[torch.as_tensor(queries)]  # (Q, N) h
    np.testing.assert_array_equal(cascade_ranks(first, second, truth, top_k, beta), expected)


def test_softmax_entropy_by_hand():
    flat = torch.zeros(5, 3)  # rows images, columns captions
    assert torch.allclose(softmax_entropy(flat, tau=10.0), torch.full((3,), math.log(5)))
    two = torch.tensor([[0.0], [math.log(3.0)]])  # p = (1/4, 3/4) at tau = 1
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert softmax_entropy(two, tau=1.0).item() == pytest.approx(expected, abs=1e-6)
    assert softmax_entropy(two * 10, tau=10.0).item() == pytest.approx(expected, abs=1e-6)
    assert softmax_entropy(torch.tensor([[0.0], [100.0]]), tau=1.0).item() < 1e-6


def test_teacher_batches_and_the_cached_loss(fitted, bench, tok):
    slow, fast = fitted
    batches = teacher_batches(slow.model, bench["train"], tok, n_batches=3, batch_size=4, seed=1)
    assert len(batches) == 3 and all(b["teacher"].shape == (4, 4) for b in batches)
    captions = [c for b in batches for c in b["input_ids"].tolist()]
    # distinct pairs across the pool (12 drawn without replacement)
    assert len({tuple(c) for c in captions}) >= 11
    batch = batches[1]
    assert torch.allclose(batch["teacher"], teacher_scores(slow.model, batch), atol=1e-5)
    with torch.no_grad():  # the (1, 2) pair by hand: image 1, caption 2
        kvs = slow.model.keys_values(slow.model.visual_tokens({"pixels": batch["pixels"][1:2]}))
        text = {k: batch[k][2:3] for k in ("input_ids", "attention_mask")}
        assert (batch["teacher"][1, 2].item()
                == pytest.approx(slow.model.log_likelihood(kvs, text).item(), abs=1e-4))
    config = dataclasses.replace(fast.config, distill=True, tau=10.0, alpha=0.5)
    model = fast.model.eval()
    with torch.no_grad():
        cached = cached_distill_loss(config)(model, batch)
        live = distill_loss(slow.model, config)(model, batch)
        control = cached_distill_loss(config, with_teacher=False)(model, batch)
    for key in ("loss", "distill", "nce"):
        assert cached[key].item() == pytest.approx(live[key].item(), abs=1e-5)
    assert control["loss"].item() == pytest.approx(nce_loss(model, batch).item(), abs=1e-5)


def test_distill_from_cache_trains_a_copy(fitted, bench, tok):
    slow, fast = fitted
    batches = teacher_batches(slow.model, bench["train"], tok, n_batches=2, batch_size=4)
    before = {k: v.clone() for k, v in fast.model.state_dict().items()}
    config = dataclasses.replace(fast.config, distill=True)
    student, history = distill_from_cache(fast.model, batches, config, steps=3, lr=1e-2,
                                          device="cpu")
    assert isinstance(student, FastModel) and student is not fast.model and not student.training
    # init untouched
    assert all(torch.equal(v, fast.model.state_dict()[k]) for k, v in before.items())
    # the copy moved
    assert any(not torch.equal(v, student.state_dict()[k]) for k, v in before.items())
    assert len(history.column("distill", eval=False)) >= 1  # eq. 8 logged its distillation term


def test_kl_to_teacher_against_a_loop_over_captions(fitted, bench, tok):
    slow, fast = fitted
    batches = teacher_batches(slow.model, bench["val"], tok, n_batches=2, batch_size=4, seed=2)
    model = fast.model.eval()
    expected, captions = 0.0, 0
    for batch in batches:
        with torch.no_grad():
            image, text = model(batch)
        # caption t: softmaxes over the batch's images, KL by its definition
        for t in range(text.shape[0]):
            p = torch.softmax(batch["teacher"][:, t].double() / 10.0, dim=0)
            q = torch.softmax((image @ text[t]).double() / 10.0, dim=0)
            expected += float((p * (p.log() - q.log())).sum())
            captions += 1
    assert (kl_to_teacher(model, batches, tau=10.0)
            == pytest.approx(expected / captions, rel=1e-4, abs=1e-6))
    # a teacher equal to the student
    same = [{**b, "teacher": batch_scores(*model(b)).detach()} for b in batches]
    assert kl_to_teacher(model, same, tau=1.0) == pytest.approx(0.0, abs=1e-5)


def _reference(model, kvs, text):
    N = kvs["fwd"][0].shape[1]
    return model.log_likelihood(kvs, {k: v.expand(N, -1) for k, v in text.items()})


def test_check_score_one_caption_accepts_the_answer_and_names_mistakes(capsys):
    check_score_one_caption(_reference)
    assert "correct" in capsys.readouterr().out
    mistakes = [
        (lambda m, kvs, text: _reference(m, kvs, text).sum(), "one number"),
        (lambda m, kvs, text: -_reference(m, kvs, text), "sign"),
        (lambda m, kvs, text: _reference(m, kvs, text)[:3], "shape"),
        (lambda m, kvs, text: _reference(m, {d: [kv.flip(1) for kv in layers]
                                             for d, layers in kvs.items()}, text),
         "differs"),
    ]
    for wrong, words in mistakes:
        with pytest.raises(ExerciseError, match=words):
            check_score_one_caption(wrong)


def test_perfect_teacher_loss_against_a_loop_over_captions(bench, tok):
    """Each caption's target is uniform over the batch images it is true of (its own among them),
    the student's softmax over the batch's images at tau 1, H(p, q) averaged over captions, +
    alpha * eq. 4: checked caption by caption against the generator's ground truth, with two
    captions of one image."""
    from course_lib.core.losses import joint_nce_loss
    from course_lib.data.captions import satisfies
    from course_lib.studies.fast_slow import perfect_teacher_loss

    split = bench["train"]
    config = FastConfig(**FAST_SMALL, alpha=0.5)
    generator = torch.Generator().manual_seed(0)
    embeddings = (3 * torch.randn(6, 4, generator=generator),
                  3 * torch.randn(6, 4, generator=generator))
    model = lambda batch: embeddings  # noqa: E731  (f, g) far apart: scores that tell the targets apart
    pairs = PairDataset(split, modality="pixels")
    truth = satisfies(split.meanings, split.scenes)  # (T, N)
    txt2img = np.asarray(split.txt2img)
    first = int(np.flatnonzero(txt2img == txt2img[0])[1])  # a second caption of image 0
    # a caption true of another image, beside a caption of that image not true of the first one's:
    # the targets are not symmetric, so a transposed target matrix would fail
    t, n = next((t, n) for t, n in zip(*np.nonzero(truth), strict=True)
                if n != txt2img[t] and txt2img[t] != 0 and n != 0
                and not truth[np.flatnonzero(txt2img == n)[0], txt2img[t]])
    batch = PairCollate(tok, 40)([pairs[i] for i in (0, first, int(t),
                                                     int(np.flatnonzero(txt2img == n)[0]), 41, 66)])
    out = perfect_teacher_loss(split, config)(model, batch)
    scores = batch_scores(*embeddings)  # (B images, B captions)
    texts, images = batch["txt_index"].tolist(), batch["img_index"].tolist()
    terms = []
    for j, t in enumerate(texts):
        true = [i for i, n in enumerate(images) if truth[t, n] or i == j]
        # both captions of image 0 count both its rows
        assert j in true and (j > 1 or {0, 1} <= set(true))
        log_q = scores[:, j] - torch.logsumexp(scores[:, j], dim=0)
        terms.append(-sum(float(log_q[i]) for i in true) / len(true))
    expected = float(np.mean(terms)) + 0.5 * float(joint_nce_loss(scores))
    assert math.isclose(float(out["loss"]), expected, rel_tol=1e-5)
    assert math.isclose(float(out["distill"]), float(np.mean(terms)), rel_tol=1e-5)


def test_mined_students_are_the_recipe_and_its_two_controls(slow, bench, tok):
    """Four students from one trained model, each as its own loss would train it with fit_pairs: the
    "eq. 4 alone" control equals a hand-run of nce_loss (same seed, steps, batch, rate), the start
    is left untouched, and the teacher's student differs from the hard-negative control's."""
    import copy

    from course_lib.core.settings import seed_everything
    from course_lib.methods.base import fit_pairs
    from course_lib.studies.fast_slow import MINED_RUNS, mined_students

    config = FastConfig(**FAST_SMALL, distill=True, distill_candidates="mined", distill_top_k=3,
                        distill_batch_size=4)
    torch.manual_seed(0)
    init = FastModel(len(tok), config).eval()
    before = copy.deepcopy(init.state_dict())
    students = mined_students(init, slow, bench["train"], tok, config, steps=3)
    assert tuple(students) == MINED_RUNS
    for key, value in init.state_dict().items():
        assert torch.equal(value, before[key]), key
    seed_everything(config.seed)
    by_hand = copy.deepcopy(init).train()
    fit_pairs(by_hand, nce_loss, bench["train"], tok, config, modality="pixels", progress=False,
              batch_size=config.batch_size, max_steps=3, lr=config.distill_lr)
    for key, value in by_hand.state_dict().items():
        assert torch.equal(students["eq. 4 alone"].state_dict()[key], value), key
    for one, other in (("teacher", "own image"), ("perfect teacher", "eq. 4 alone")):
        differs = [not torch.equal(a, b) for a, b in zip(students[one].state_dict().values(),
                                                         students[other].state_dict().values(),
                                                         strict=True)
                   if a.is_floating_point()]
        assert any(differs), (one, other)
