"""Tests for course_lib.methods.vsepp: the dual encoder's scores, the VSE++ loss against a loop
written from the paper, a short training run that must beat the untrained model, checkpoint caching,
split encoding against batch-by-batch encoding, and FAISS retrieval against the score matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.core.losses import batch_scores, hinge_triplet_loss
from course_lib.core.metrics import retrieval_metrics
from course_lib.core.retrieval import build_index, search
from course_lib.core.stages import Stage, config_fields
from course_lib.core.train import Trainer
from course_lib.data.datasets import (
    CaptionDataset,
    ImageDataset,
    PairCollate,
    PairDataset,
    make_loader,
)
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.encoding import (
    encode_captions,
    encode_split,
    learning_curve_splits,
    retrieval_evaluator,
    similarity,
)
from course_lib.methods.vsepp import (
    DualEncoder,
    VsePPConfig,
    VsePPMethod,
    build_dual_encoder,
    train_dual_encoder,
    vsepp_loss,
)

# small enough for a few seconds of CPU training, large enough to learn something
TINY = dict(hidden=32, embed_dim=32, layers=1, batch_size=32, lr=1e-3, max_violation=False)


# the `bench` fixture (tests/conftest.py): SyntheticConfig.smoke sizes
BENCH_SIZES = dict(n_train=300, n_val=40, n_test=50, n_pretrain=0, n_compositional=5)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread


@pytest.fixture(scope="module")
def tokenizer(bench):
    # train and test captions (conftest's `tok` has the train captions only)
    return build_word_tokenizer(bench["train"].captions + bench["test"].captions)


@pytest.fixture(scope="module")
def trained(bench, tokenizer):
    """(model, history, untrained test metrics) of a short run with a validation hook."""
    config = VsePPConfig(**TINY, max_steps=150, seed=0)
    torch.manual_seed(0)
    untrained = build_dual_encoder(config, bench["train"], tokenizer).eval()
    test = bench["test"]
    before = retrieval_metrics(similarity(untrained, test, tokenizer), test.txt2img)
    model, history = train_dual_encoder(bench, tokenizer, config, evaluate_on=bench["val"],
                                        eval_every=75, progress=False, device="cpu")
    return model, history, before


def pair_batch(split, tokenizer, indices):
    dataset = PairDataset(split)
    return PairCollate(tokenizer)([dataset[t] for t in indices])


def reference_hinge(scores, margin, max_violation):
    """VSE++'s loss as loops over queries: image i vs wrong texts j, text i vs wrong images j."""
    S, total = scores.tolist(), 0.0
    B = len(S)
    for i in range(B):
        text_costs = [max(0.0, margin + S[i][j] - S[i][i]) for j in range(B) if j != i]
        image_costs = [max(0.0, margin + S[j][i] - S[i][i]) for j in range(B) if j != i]
        if max_violation:
            total += max(text_costs) + max(image_costs)
        else:
            total += sum(text_costs) + sum(image_costs)
    return total


# ---------------------------------------------------------------------------------------- the model
def test_scores_are_cosines_with_positives_on_the_diagonal(bench, tokenizer):
    torch.manual_seed(0)
    model = build_dual_encoder(VsePPConfig(**TINY), bench["train"], tokenizer).eval()
    indices = [0, 7, 12, 31, 5]  # captions of images 0, 1, 2, 6, 1
    batch = pair_batch(bench["train"], tokenizer, indices)
    with torch.no_grad():
        scores = batch_scores(*model(batch))  # (5, 5)
        image_emb, text_emb = model.encode_images(batch), model.encode_texts(batch)
        raw_images = model.image_proj(model.image_encoder(batch).pooled)  # before normalising
        raw_texts = model.text_proj(model.text_encoder(batch).pooled)
    assert scores.shape == (5, 5)
    torch.testing.assert_close(image_emb.norm(dim=1), torch.ones(5))
    torch.testing.assert_close(text_emb.norm(dim=1), torch.ones(5))
    cosine = torch.nn.functional.cosine_similarity(raw_images[:, None], raw_texts[None, :], dim=-1)
    torch.testing.assert_close(scores, cosine, atol=1e-5, rtol=1e-5)
    # by hand: entry (i, j) = image of pair i against caption of pair j, each encoded alone
    for i in range(5):
        for j in range(5):
            with torch.no_grad():
                image = model.encode_images(pair_batch(bench["train"], tokenizer, [indices[i]]))
                text = model.encode_texts(pair_batch(bench["train"], tokenizer, [indices[j]]))
            assert abs(float(image @ text.T) - float(scores[i, j])) < 1e-5
    # two captions of image 1 (positions 1 and 4): identical image rows,
    # VSE++ leaves them as negatives
    torch.testing.assert_close(scores[1], scores[4])


@pytest.mark.parametrize("image_kind, text_kind", [("regions", "bow"), ("regions", "bert"),
                                                   ("pixels", "gru")])
def test_other_encoders_build_and_score(bench, tokenizer, image_kind, text_kind):
    config = VsePPConfig(**{**TINY, "image_encoder": image_kind, "text_encoder": text_kind})
    model = build_dual_encoder(config, bench["train"], tokenizer).eval()
    dataset = PairDataset(bench["train"], modality=model.modality)
    batch = PairCollate(tokenizer)([dataset[t] for t in range(4)])
    with torch.no_grad():
        scores = batch_scores(*model(batch))
    assert (scores.shape == (4, 4) and torch.isfinite(scores).all()
            and scores.abs().max() <= 1 + 1e-5)


def test_unknown_encoder_kinds_list_the_valid_ones(bench, tokenizer):
    with pytest.raises(ValueError, match="valid kinds"):
        build_dual_encoder(VsePPConfig(text_encoder="lstm"), bench["train"], tokenizer)
    with pytest.raises(ValueError, match="valid kinds"):
        build_dual_encoder(VsePPConfig(image_encoder="grid"), bench["train"], tokenizer)
    with pytest.raises(ValueError, match="region_dim"):
        DualEncoder(VsePPConfig(), vocab_size=10)


# ----------------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("max_violation", [True, False])
def test_loss_fn_is_the_vsepp_hinge_on_the_batch_scores(bench, tokenizer, max_violation):
    torch.manual_seed(1)
    model = build_dual_encoder(VsePPConfig(**TINY), bench["train"], tokenizer).eval()
    batch = pair_batch(bench["train"], tokenizer, list(range(0, 160, 5)))  # 32 different images
    loss = vsepp_loss(margin=0.2, max_violation=max_violation)(model, batch)
    with torch.no_grad():
        scores = batch_scores(*model(batch))
    assert loss.dim() == 0 and loss.requires_grad
    torch.testing.assert_close(loss.detach(), hinge_triplet_loss(scores, 0.2, max_violation))
    assert abs(float(loss.detach()) - reference_hinge(scores, 0.2, max_violation)) < 1e-3


def test_sum_warmup_switches_to_max_violation_at_the_step(bench, tokenizer):
    torch.manual_seed(2)
    model = build_dual_encoder(VsePPConfig(**TINY), bench["train"], tokenizer).eval()
    batch = pair_batch(bench["train"], tokenizer, list(range(0, 80, 5)))
    loss_fn = vsepp_loss(0.2, True, sum_warmup_steps=3)
    with torch.no_grad():
        scores = batch_scores(*model(batch))
    torch.testing.assert_close(loss_fn(model, batch, 2).detach(),
                               hinge_triplet_loss(scores, 0.2, False))
    torch.testing.assert_close(loss_fn(model, batch, 3).detach(),
                               hinge_triplet_loss(scores, 0.2, True))


# ----------------------------------------------------------------------------------------- training
def test_training_lowers_the_loss_and_beats_the_untrained_model(trained, bench, tokenizer):
    model, history, before = trained
    losses = history.column("loss", eval=False)
    assert losses[-1] < 0.8 * losses[0]
    test = bench["test"]
    after = retrieval_metrics(similarity(model, test, tokenizer), test.txt2img)
    # 50 test images: chance R@10 is 20%; the untrained model sits near it
    assert after["t2i_r10"] > before["t2i_r10"] + 15, (before, after)
    assert after["i2t_r10"] > before["i2t_r10"] + 15, (before, after)
    evals = history.rows(eval=True)
    assert [r["step"] for r in evals] == [75, 150]
    assert {"t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "ar"} <= set(evals[-1])
    assert not model.training


def test_method_caches_its_checkpoint(bench, tokenizer, tmp_path, monkeypatch):
    config = VsePPConfig(**TINY, max_steps=4)
    first = VsePPMethod(config, progress=False).fit(bench, tokenizer, cache_dir=tmp_path)
    assert first.checkpoint_path.exists()
    assert first.checkpoint_path.name == Stage("vsepp", config_fields(config), bench["train"],
                                               tokenizer, version=first.format_version).file_name
    other = VsePPMethod(VsePPConfig(**{**TINY, "margin": 0.3}, max_steps=4), progress=False)
    other.fit(bench, tokenizer, cache_dir=tmp_path)
    assert other.checkpoint_path != first.checkpoint_path
    assert sorted(p.name for p in tmp_path.glob("vsepp-*.pt")) == sorted(
        [first.checkpoint_path.name, other.checkpoint_path.name])

    def no_training(*args, **kwargs):
        raise AssertionError("a cached finished run must not train again")

    monkeypatch.setattr(Trainer, "_train_step", no_training)
    again = VsePPMethod(config, progress=False).fit(bench, tokenizer, cache_dir=tmp_path)
    assert again.checkpoint_path == first.checkpoint_path
    for key, value in first.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[key].cpu(), value.cpu())
    assert again.history == first.history


def test_encode_split_matches_batch_by_batch_encoding(trained, bench, tokenizer):
    model, _, _ = trained
    split = bench["test"]
    model.train()  # encode_split must switch to eval mode and back
    image_emb, text_emb = encode_split(model, split, tokenizer, batch_size=64)
    assert model.training
    model.eval()
    with torch.no_grad():
        images = torch.cat([model.encode_images(b)
                            for b in make_loader(ImageDataset(split), batch_size=7)])
        texts = torch.cat([model.encode_texts(b)
                           for b in make_loader(CaptionDataset(split), 9, tokenizer=tokenizer)])
    assert image_emb.shape == (split.n_images, 32) and text_emb.shape == (split.n_texts, 32)
    assert image_emb.device.type == "cpu" and not image_emb.requires_grad
    torch.testing.assert_close(image_emb, images, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(text_emb, texts, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(similarity(model, split, tokenizer), image_emb @ text_emb.T)
    some = [17, 3, 3, 40, 0]  # any captions, in any order, repeats allowed
    torch.testing.assert_close(encode_captions(model, split, tokenizer, indices=some), texts[some],
                               atol=1e-5, rtol=1e-4)


def test_faiss_top1_is_the_argmax_of_each_similarity_column(trained, bench, tokenizer):
    model, _, _ = trained
    image_emb, text_emb = encode_split(model, bench["test"], tokenizer)
    sims = image_emb @ text_emb.T  # (N, T)
    _, indices = search(build_index(image_emb), text_emb, k=1)  # (T, 1)
    top2 = sims.topk(2, dim=0).values  # (2, T)
    clear = (top2[0] - top2[1] > 1e-5).numpy()  # skip exact near-ties
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(indices[clear, 0], sims.argmax(dim=0).numpy()[clear])


@pytest.fixture
def fitted_method(trained, tokenizer):
    """A VsePPMethod holding the trained model, as after fit()."""
    model, history, _ = trained
    method = VsePPMethod(VsePPConfig(**TINY))
    method.model, method.tokenizer, method.history = model, tokenizer, history
    return method


def test_query_fn_returns_the_top10_of_the_similarity_column(fitted_method, bench):
    method = fitted_method
    split = bench["test"]
    sims = method.similarity(split)  # (N, T)
    for caption in (0, 3, 101):
        result = method.query_fn(split, caption_index=caption)()
        expected = sims[:, caption].topk(10)
        assert result.shape == (10,)
        gaps = np.abs(np.diff(expected.values.numpy()))
        if (gaps > 1e-5).all():  # ranks are well defined
            np.testing.assert_array_equal(result, expected.indices.numpy())
        else:
            assert set(result.tolist()) == set(expected.indices.tolist())
    assert "FAISS IndexFlatIP" in method.notes and "bi-GRU" in method.notes


def test_rank_is_the_top_k_of_the_similarity_for_any_queries(fitted_method, bench):
    # FAISS ranking of a sample of queries, encoding only those, equals the dense matrix's top-k
    method = fitted_method
    split = bench["test"]
    sims = method.similarity(split)  # (N, T)
    for direction, queries, by_query in (("t2i", [101, 0, 7], sims.T), ("i2t", [5, 2], sims)):
        indices, scores = method.rank(split, direction, 5, queries)
        expected = by_query[queries].topk(5, dim=1)
        torch.testing.assert_close(torch.as_tensor(scores), expected.values, atol=1e-5, rtol=1e-5)
        assert indices.shape == (len(queries), 5)
    empty_indices, _ = method.rank(split.texts_subset([0, 1]), "i2t", 5)  # no image queries there
    assert empty_indices.shape[0] == 0


def test_learning_curve_splits_score_each_split_under_its_name(trained, bench, tokenizer):
    """The named-splits evaluator gives, under "val_" and "train_", exactly what the one-split
    evaluator gives on each split; the train split is the first images of bench["train"]."""
    model = trained[0]
    splits = learning_curve_splits(bench, n_train=20)
    assert (splits["train"].n_images == 20
            and splits["train"].image_ids == bench["train"].image_ids[:20])
    assert splits["val"].n_images == min(20, bench["val"].n_images)
    score = lambda m, split: similarity(m, split, tokenizer)  # noqa: E731
    both = retrieval_evaluator(splits, score)(model)
    for name, split in splits.items():
        alone = retrieval_evaluator(split, score)(model)
        assert {k: both[f"{name}_{k}"] for k in alone} == alone
    assert set(both) == {f"{n}_{k}" for n in splits for k in alone}
    assert retrieval_evaluator(None, score) is None


def test_method_needs_fit_first(bench):
    with pytest.raises(RuntimeError, match="fit"):
        VsePPMethod().similarity(bench["test"])
