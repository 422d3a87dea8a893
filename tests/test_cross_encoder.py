"""The single-stream cross-encoder: shapes, padding invariance, use of both modalities, scoring
helpers against independent loops, hard-negative mining on a hand-made matrix, the ITM batch
construction (binary ITM, the listwise grid and its ITC-picked variant, each loss against
pair-by-pair scores), short training runs that must learn, and the benchmark method's cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.core import train as train_module
from course_lib.core.blocks import RegionEmbedding, Transformer
from course_lib.core.losses import listwise_loss
from course_lib.core.metrics import retrieval_metrics
from course_lib.data.datasets import IMAGE_KEYS, image_fields, text_fields
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.cross_encoder import mining
from course_lib.methods.cross_encoder.itm import (
    GridCollate,
    grid_pairs,
    itc_hard_grid,
    itc_itm_loss,
    listwise_itm_loss,
)
from course_lib.methods.cross_encoder.method import (
    CrossEncoderMethod,
    ITMCollate,
    keep_hardest,
    train_cross_encoder,
)
from course_lib.methods.cross_encoder.mining import (
    DualEmbeddings,
    dual_encoder_miner,
    mine_negatives,
    mine_negatives_from_embeddings,
)
from course_lib.methods.cross_encoder.model import (
    CrossEncoder,
    CrossEncoderConfig,
    rerank_scores,
    score_matrix,
    score_pairs,
)
from course_lib.methods.scan.method import SCANMethod
from course_lib.methods.scan.model import SCANConfig, build_scan
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod
from course_lib.shipping import own_models

TOL = 1e-5
# the `bench` fixture (tests/conftest.py, with `tok` over its train captions):
# SyntheticConfig.smoke sizes
BENCH_SIZES = dict(n_train=300, n_val=20, n_test=20, n_pretrain=2, n_compositional=1)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread


def untrained_towers(split, tok, seed: int = 0):
    """A SCAN model with random weights: what `towers="scan"` reads, for tests of the plumbing."""
    torch.manual_seed(seed)
    return build_scan(SCANConfig.smoke(), split, tok)


def smoke_method(config, **kwargs) -> CrossEncoderMethod:
    """A CrossEncoderMethod whose SCAN towers train for 3 steps (not SCAN's default size)."""
    return CrossEncoderMethod(config, towers=SCANMethod(SCANConfig.smoke(max_steps=3),
                                                        progress=False), **kwargs)


@pytest.fixture(scope="module")
def model(bench, tok):
    torch.manual_seed(0)
    towers = untrained_towers(bench["train"], tok, seed=1)
    return CrossEncoder(bench["train"].regions.shape[-1], len(tok), CrossEncoderConfig.smoke(),
                        pad_token_id=tok.pad_token_id, towers=towers).eval()


def pairs(split, tok, image_rows, text_rows):
    """Aligned image and text fields of the given (image, caption) pairs."""
    images = {k: v[torch.as_tensor(image_rows)] for k, v in image_fields(split).items()}
    texts = text_fields([split.captions[t] for t in text_rows], tok, 40)
    return images, texts


def test_shapes_and_config(bench, tok, model):
    images, texts = pairs(bench["test"], tok, [0, 1, 2, 3], [0, 5, 10, 11])
    logits = model(images, texts)
    assert logits.shape == (4,) and torch.isfinite(logits).all()
    assert CrossEncoderConfig.smoke().max_steps < CrossEncoderConfig().max_steps
    with pytest.raises(ValueError, match="max_text_length"):
        model(images, {k: v.repeat(1, 20) for k, v in texts.items()})
    assert isinstance(model.transformer, Transformer) and isinstance(model.region, RegionEmbedding)
    # the tokenizer's id
    other = CrossEncoder(8, 20, CrossEncoderConfig.smoke(towers="none"), pad_token_id=3)
    assert other.word.padding_idx == 3 and not other.word.weight[3].any()


def test_padding_changes_nothing(bench, tok, model):
    images, texts = pairs(bench["test"], tok, [0, 1, 2], [0, 5, 14])
    reference = model(images, texts)
    extra = lambda x, fill: torch.cat([x, fill], 1)  # noqa: E731
    padded_texts = {"input_ids": extra(texts["input_ids"], torch.full((3, 4), tok.pad_token_id)),
                    "attention_mask": extra(texts["attention_mask"],
                                            torch.zeros(3, 4, dtype=torch.long))}
    D = images["regions"].shape[-1]
    # garbage, masked
    padded_images = {"regions": extra(images["regions"], 5 * torch.randn(3, 2, D)),
                     "boxes": extra(images["boxes"], torch.rand(3, 2, 7)),
                     "region_mask": extra(images["region_mask"],
                                          torch.zeros(3, 2, dtype=torch.bool))}
    assert torch.allclose(model(images, padded_texts), reference, atol=TOL)
    assert torch.allclose(model(padded_images, padded_texts), reference, atol=TOL)


def test_the_logit_reads_both_modalities(bench, tok, model):
    images, texts = pairs(bench["test"], tok, [0, 0], [0, 0])
    other_images, _ = pairs(bench["test"], tok, [3, 3], [0, 0])
    reference = model(images, texts)
    assert (model(other_images, texts) - reference).abs().min() > 1e-4
    changed = {k: v.clone() for k, v in texts.items()}
    changed["input_ids"][:, 2] = changed["input_ids"][:, 2] % (len(tok) - 6) + 5  # another word
    assert (model(images, changed) - reference).abs().min() > 1e-4


def test_score_pairs_equals_one_pair_at_a_time(bench, tok, model):
    image_rows, text_rows = [4, 0, 7, 7, 2, 9, 1], [3, 8, 35, 36, 0, 49, 12]
    images, texts = pairs(bench["test"], tok, image_rows, text_rows)
    scores = score_pairs(model, images, texts, batch_size=3)
    with torch.no_grad():
        one_by_one = [model(*pairs(bench["test"], tok, [i], [t]))[0]
                      for i, t in zip(image_rows, text_rows, strict=True)]
    assert scores.shape == (7,)
    assert torch.allclose(scores, torch.stack(one_by_one), atol=TOL)


def test_score_matrix_equals_a_double_loop_and_ignores_batch_size(bench, tok, model):
    split = bench["test"]
    image_rows, text_rows = [5, 0, 3], [7, 1, 22, 40]
    matrix = score_matrix(model, split, tok, image_rows, text_rows, batch_size=5, progress=False)
    loop = torch.tensor([[float(score_pairs(model, *pairs(split, tok, [i], [t]))[0])
                          for t in text_rows]
                         for i in image_rows])
    assert matrix.shape == (3, 4)
    assert torch.allclose(matrix, loop, atol=TOL)
    full = score_matrix(model, split, tok, progress=False)
    assert full.shape == (split.n_images, split.n_texts)
    assert torch.allclose(full,
                          score_matrix(model, split, tok, batch_size=7, progress=False), atol=TOL)
    assert torch.allclose(full[image_rows][:, text_rows], matrix, atol=TOL)


def test_rerank_scores_are_entries_of_the_matrix(bench, tok, model):
    split = bench["test"]
    full = score_matrix(model, split, tok, progress=False)
    gen = torch.Generator().manual_seed(0)
    queries = torch.tensor([3, 0, 57, 99])
    candidates = torch.randint(split.n_images, (4, 6), generator=gen)
    scores = rerank_scores(model, split, tok, candidates, text_indices=queries, batch_size=5)
    assert torch.allclose(scores, full[candidates, queries[:, None]], atol=TOL)
    every_text = torch.randint(split.n_images, (split.n_texts, 2), generator=gen)
    assert torch.allclose(rerank_scores(model, split, tok, every_text),
                          full[every_text, torch.arange(split.n_texts)[:, None]], atol=TOL)


def test_mine_negatives_on_a_hand_made_matrix():
    # 4 images, 2 captions each (texts 2i, 2i + 1 belong to image i)
    txt2img = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    sims = np.array([[9.0, 8.0, 7.0, 1.0, 6.0, 0.5, 0.2, 0.1],
                     [5.0, 0.3, 9.0, 8.0, 0.4, 4.0, 3.0, 0.6],
                     [0.7, 6.0, 2.0, 3.0, 9.0, 8.0, 0.8, 5.0],
                     [4.0, 0.9, 1.5, 2.5, 1.2, 7.0, 9.0, 8.0]])
    mined = mine_negatives(sims, txt2img, k=2)
    # per text the two most similar images other than its own (column, sorted by score)
    assert mined.images_for_text.tolist() == [[1, 3], [2, 3], [0, 2], [2, 3], [0, 3], [3, 1],
                                              [1, 2], [2, 1]]
    # per image the two most similar captions of other images (row, own captions masked)
    assert mined.texts_for_image.tolist() == [[2, 4], [0, 5], [1, 7], [5, 0]]
    gen = np.random.default_rng(0)
    sims, txt2img = gen.normal(size=(30, 90)), np.repeat(np.arange(30), 3)
    mined = mine_negatives(sims, txt2img, k=5)
    for t in range(90):
        candidates = [i for i in np.argsort(-sims[:, t]) if i != txt2img[t]][:5]
        assert mined.images_for_text[t].tolist() == candidates
    for i in range(30):
        candidates = [t for t in np.argsort(-sims[i]) if txt2img[t] != i][:5]
        assert mined.texts_for_image[i].tolist() == candidates
    with pytest.raises(ValueError, match="k="):
        mine_negatives(sims, txt2img, k=30)


def collate_fractions(split, tok, fraction, mined, n=2, batches=30):
    """Run ITMCollate; return the share of negative images / texts found in the mined lists."""
    collate = ITMCollate(split, tok, 40, negatives_per_positive=n, hard_fraction=fraction,
                         mined=mined)
    in_lists = {"images": [], "texts": []}
    for b in range(batches):
        items = [{"index": t} for t in range(b * 16, b * 16 + 16)]
        batch = collate(items)
        B, P = 16, 16 * (1 + 2 * n)
        img, txt, labels = batch["img_index"], batch["txt_index"], batch["labels"]
        assert img.shape == txt.shape == labels.shape == (P,)
        assert (batch["texts"]["input_ids"].shape[0] == P
                and batch["images"]["regions"].shape[0] == P)
        assert labels[:B].eq(1).all() and labels[B:].eq(0).all()
        true_image = torch.from_numpy(split.txt2img)[txt]
        assert (true_image[:B] == img[:B]).all() and (true_image[B:] != img[B:]).all()
        anchor_img, neg_txt = img[B:B + n * B], txt[B:B + n * B]  # the positives' images, new texts
        anchor_txt, neg_img = txt[B + n * B:], img[B + n * B:]  # the positives' texts, new images
        assert (anchor_img == img[:B].repeat(n)).all() and (anchor_txt == txt[:B].repeat(n)).all()
        in_lists["texts"] += [int(t) in mined.texts_for_image[i].tolist()
                              for i, t in zip(anchor_img, neg_txt, strict=True)]
        in_lists["images"] += [int(i) in mined.images_for_text[t].tolist()
                               for t, i in zip(anchor_txt, neg_img, strict=True)]
    return {k: float(np.mean(v)) for k, v in in_lists.items()}


def test_itm_batches_labels_counts_and_hard_fraction(bench, tok):
    split = bench["train"]
    gen = torch.Generator().manual_seed(0)
    mined = mine_negatives(torch.rand(split.n_images, split.n_texts, generator=gen),
                           split.txt2img, k=3)
    torch.manual_seed(0)
    assert collate_fractions(split, tok, 1.0, mined) == {"images": 1.0, "texts": 1.0}
    assert max(collate_fractions(split, tok, 0.0, mined).values()) < 0.05  # chance 3/300
    half = collate_fractions(split, tok, 0.5, mined)
    assert all(0.4 < v < 0.6 for v in half.values())


def preference(model, split, tok):
    """Share of captions whose own image scores above one random other image (0.5 = chance)."""
    gen = torch.Generator().manual_seed(1)
    texts = torch.arange(split.n_texts).tolist()
    own = torch.from_numpy(split.txt2img)
    other = (own + torch.randint(1, split.n_images, own.shape, generator=gen)) % split.n_images
    own_scores = score_pairs(model, *pairs(split, tok, own, texts))
    other_scores = score_pairs(model, *pairs(split, tok, other, texts))
    return float((own_scores > other_scores).float().mean())


@pytest.mark.parametrize("loss", ["listwise", "binary"])
def test_short_training_beats_the_untrained_model(loss):
    # scenes of 1-2 objects: the model leaves its "always no" start within seconds (4-5 objects
    # take minutes, see the config's notes), and the check stays a check: it fails if ITM breaks
    cfg = SyntheticConfig.smoke(n_train=300, n_val=20, n_test=2, n_pretrain=2, n_compositional=1,
                                min_objects=1, max_objects=2)
    bench = make_benchmark(cfg, seed=0)
    tok = build_word_tokenizer(bench["train"].captions)
    # listwise: 8 captions x their images = 64 pairs a step; binary: 16 x 3 = 48
    config = CrossEncoderConfig.smoke(max_steps=300, batch_size=8 if loss == "listwise" else 16,
                                      loss=loss)
    # random, frozen: the fusion layers must learn by themselves
    towers = untrained_towers(bench["train"], tok)
    torch.manual_seed(config.seed)
    untrained = CrossEncoder(bench["train"].regions.shape[-1], len(tok), config,
                             pad_token_id=tok.pad_token_id, towers=towers)
    model, history = train_cross_encoder(bench, tok, config, towers=towers, progress=False,
                                         device="cpu")
    val = bench["val"]
    before = retrieval_metrics(score_matrix(untrained, val, tok, progress=False), val.txt2img)
    after = retrieval_metrics(score_matrix(model, val, tok, progress=False), val.txt2img)
    losses = history.column("loss")
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert preference(model, val, tok) > max(0.7, preference(untrained, val, tok) + 0.15)
    assert after["t2i_r5"] > before["t2i_r5"] + 10


def test_method_caches_its_checkpoint_and_calls_the_miner_only_to_train(bench, tok, tmp_path,
                                                                        monkeypatch):
    calls = []

    def miner(bench, tokenizer, cache_dir):
        calls.append(cache_dir)
        return torch.rand(bench["train"].n_images, bench["train"].n_texts)

    config = CrossEncoderConfig.smoke(max_steps=3, hard_negative_fraction=0.5, loss="binary")
    first = smoke_method(config, miner=miner).fit(bench, tok, cache_dir=tmp_path)
    assert (first.checkpoint_path.exists()
            and first.checkpoint_path.name.startswith("cross_encoder-"))
    assert len(calls) == 1
    # with no hard negatives to draw, the miner is not called (the listwise loss draws none)
    smoke_method(CrossEncoderConfig.smoke(max_steps=3, hard_negative_fraction=0.0, loss="binary"),
                 miner=miner).fit(bench, tok, cache_dir=tmp_path)
    smoke_method(CrossEncoderConfig.smoke(max_steps=3, hard_negative_fraction=0.5),
                 miner=miner).fit(bench, tok, cache_dir=tmp_path)
    assert len(calls) == 1

    def no_training(self, batches):
        raise AssertionError("the second fit trained instead of loading the checkpoint")

    monkeypatch.setattr(train_module.Trainer, "_train_step", no_training)
    second = smoke_method(config, miner=miner).fit(bench, tok, cache_dir=tmp_path)
    assert len(calls) == 1 and second.checkpoint_path == first.checkpoint_path
    split = bench["test"]
    sims = second.similarity(split)
    assert torch.allclose(sims, first.similarity(split), atol=TOL)
    top = second.query_fn(split, top_k=5)()
    assert top.tolist() == torch.topk(sims[:, 0], 5).indices.tolist()
    # another config is another checkpoint
    other = smoke_method(CrossEncoderConfig.smoke(max_steps=3, seed=1))
    with pytest.raises(AssertionError, match="second fit trained"):
        other.fit(bench, tok, cache_dir=tmp_path)


def test_the_checkpoint_name_follows_the_miner_only_when_it_mines(bench, tok):
    """A cross-encoder trained without mined negatives (the listwise default) does not depend on the
    dual encoder that would mine them, so another miner config must not rename (and retrain) it; one
    trained on mined negatives must follow its miner."""
    def named(config, steps):
        miner = dual_encoder_miner(VsePPMethod(VsePPConfig.smoke(max_steps=steps), progress=False))
        return smoke_method(config, miner=miner).stage(bench, tok).file_name

    listwise = CrossEncoderConfig.smoke(max_steps=3)
    assert listwise.loss == "listwise"
    assert (named(listwise, 2) == named(listwise, 5)
            == smoke_method(listwise).stage(bench, tok).file_name)
    mining = CrossEncoderConfig.smoke(max_steps=3, hard_negative_fraction=0.5, loss="binary")
    assert named(mining, 2) != named(mining, 5)


def test_a_miner_is_kept_only_where_it_mines(bench, tok):
    """The benchmark hands the cross-encoder a VSE++ miner whatever its loss. Trained listwise it
    draws no mined negatives, so VSE++ is not among the models it is built from: the benchmark's
    --retrain and the refresh of the shipped models (course_lib.refresh_shipped) do not train VSE++
    before it (or at all, for --methods cross_encoder). Binary ITM with hard negatives keeps it."""
    vsepp = VsePPMethod(VsePPConfig.smoke(max_steps=2), progress=False)
    listwise = smoke_method(CrossEncoderConfig.smoke(max_steps=3), miner=dual_encoder_miner(vsepp))
    assert listwise.miner is None and vsepp not in own_models([listwise])
    mining = smoke_method(CrossEncoderConfig.smoke(max_steps=3, hard_negative_fraction=0.5,
                                                   loss="binary"),
                          miner=dual_encoder_miner(vsepp))
    assert mining.miner is not None and vsepp in own_models([mining])


def test_mining_from_embeddings_equals_mining_from_their_matrix(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    image_emb, text_emb = torch.randn(40, 8, generator=gen), torch.randn(130, 8, generator=gen)
    txt2img = torch.randint(40, (130,), generator=gen).numpy()  # uneven caption counts, some 0
    monkeypatch.setattr(mining, "_ROWS_PER_CHUNK", 7)  # several uneven chunks
    reference = mine_negatives(image_emb @ text_emb.T, txt2img, k=6)
    for mined in (mine_negatives_from_embeddings(image_emb, text_emb, txt2img, k=6),
                  mine_negatives(DualEmbeddings(image_emb, text_emb), txt2img, k=6)):
        assert torch.equal(mined.images_for_text, reference.images_for_text)
        assert torch.equal(mined.texts_for_image, reference.texts_for_image)
        # mined negatives are never true matches
        assert (mined.images_for_text != torch.from_numpy(txt2img)[:, None]).all()
        assert (torch.from_numpy(txt2img)[mined.texts_for_image] != torch.arange(40)[:, None]).all()
    assert DualEmbeddings(image_emb, text_emb).shape == (40, 130)
    with pytest.raises(ValueError, match="txt2img"):
        mine_negatives_from_embeddings(image_emb, text_emb, txt2img[:-1], k=6)


def test_dual_encoder_miner_fits_the_method_and_returns_its_train_similarity(bench, tok):
    class FakeDual:
        config = {"fake": 1}

        def __init__(self):
            self.calls = []

        def fit(self, bench, tokenizer, cache_dir=None):
            self.calls.append(("fit", cache_dir))
            return self

        def similarity(self, split):
            self.calls.append(("similarity", split.name))
            return torch.rand(split.n_images, split.n_texts)

    fake = FakeDual()
    miner = dual_encoder_miner(fake)
    sims = miner(bench, tok, "somewhere")
    split = bench["train"]
    assert fake.calls == [("fit", "somewhere"), ("similarity", split.name)]
    assert tuple(sims.shape) == (split.n_images, split.n_texts)
    assert "FakeDual" in miner.__qualname__  # the cross-encoder's checkpoint name depends on it
    # a VSE++ model gives its two embedding matrices: the same negatives as its full matrix
    vsepp = VsePPMethod(VsePPConfig.smoke(max_steps=2), progress=False)
    factored = dual_encoder_miner(vsepp)(bench, tok, None)
    assert (isinstance(factored, DualEmbeddings)
            and factored.shape == (split.n_images, split.n_texts))
    sims = vsepp.similarity(split)  # (N, T)
    full = mine_negatives(sims, split.txt2img, k=4)
    mined = mine_negatives(factored, split.txt2img, k=4)
    # compared by score: repeated captions tie, and ties may come out in either order
    columns = torch.arange(split.n_texts)[:, None]
    assert torch.allclose(sims[mined.images_for_text, columns], sims[full.images_for_text, columns],
                          atol=TOL)
    rows = torch.arange(split.n_images)[:, None]
    assert torch.allclose(sims[rows, mined.texts_for_image], sims[rows, full.texts_for_image],
                          atol=TOL)


def test_online_candidates_keep_the_negative_the_model_scores_highest(bench, tok):
    split, B, n, c = bench["train"], 8, 2, 3

    def fake_model(images, texts):  # any fixed function of both inputs
        return images["regions"].sum(dim=(1, 2)) + 0.01 * texts["input_ids"].float().sum(1)

    collate = ITMCollate(split, tok, 40, negatives_per_positive=n, hard_fraction=0.0, candidates=c)
    torch.manual_seed(0)
    batch = collate([{"index": t} for t in range(B)])
    assert batch["labels"].shape == (B * (1 + 2 * n * c),) and batch["candidates"] == c
    kept = keep_hardest(fake_model, batch)
    assert kept["labels"].shape == (B * (1 + 2 * n),) and kept["labels"][:B].eq(1).all()
    assert kept["labels"][B:].eq(0).all()
    assert torch.equal(kept["txt_index"][:B], batch["txt_index"][:B])
    scores, kept_scores = fake_model(batch["images"], batch["texts"]), fake_model(kept["images"],
                                                                                  kept["texts"])
    for side in range(2):  # negative captions, then negative images
        block = scores[B + side * n * c * B:B + (side + 1) * n * c * B].view(c, n * B)
        kept_block = kept_scores[B + side * n * B:B + (side + 1) * n * B]
        assert torch.allclose(kept_block, block.max(0).values)
    # each kept negative belongs to its slot's anchor (the same image, resp. caption, as before)
    true_image = torch.from_numpy(split.txt2img)
    anchor_img, anchor_txt = kept["img_index"][B:B + n * B], kept["txt_index"][B + n * B:]
    assert torch.equal(anchor_img, true_image[batch["txt_index"][:B]].repeat(n))
    assert torch.equal(anchor_txt, batch["txt_index"][:B].repeat(n))
    assert (true_image[kept["txt_index"][B:]] != kept["img_index"][B:]).all()
    plain = ITMCollate(split, tok, 40, negatives_per_positive=n, hard_fraction=0.0)
    torch.manual_seed(0)
    one = plain([{"index": t} for t in range(B)])
    assert keep_hardest(fake_model, one) is one  # candidates = 1: nothing to choose


def test_hard_negatives_start_after_the_random_phase(bench, tok):
    split = bench["train"]
    mined = mine_negatives(torch.rand(split.n_images, split.n_texts), split.txt2img, k=3)
    step = [0]
    collate = ITMCollate(split, tok, 40, hard_fraction=1.0, mined=mined, hard_after_steps=5,
                         step=lambda: step[0])
    texts = torch.arange(200)
    in_mined = lambda images: np.mean([int(i) in mined.images_for_text[t].tolist()  # noqa: E731
                                       for t, i in zip(texts, images, strict=True)])
    step[0] = 4
    assert (collate.current_hard_fraction() == 0.0
            and in_mined(collate.negative_images(texts)) < 0.05)
    step[0] = 5
    assert (collate.current_hard_fraction() == 1.0
            and in_mined(collate.negative_images(texts)) == 1.0)


def test_grid_collate_pairs_every_caption_with_every_distinct_image(bench, tok):
    split = bench["train"]
    texts = [0, 7, 1, 42, 100, 5]  # captions 0, 1 (and maybe more) share an image
    batch = GridCollate(split, tok, 40)([{"index": t} for t in texts])
    txt2img = torch.from_numpy(split.txt2img)
    images = batch["img_index"]
    U, B = len(images), len(texts)
    assert U == len(set(txt2img[texts].tolist())) < B and batch["txt_index"].tolist() == texts
    assert torch.equal(images[batch["text_image"]], txt2img[texts])  # each caption's own row
    grid_images, grid_texts = grid_pairs(batch["images"], batch["texts"])
    reference_images, reference_texts = pairs(split, tok, images.repeat_interleave(B),
                                              texts * U)  # pair u * B + b = (image u, caption b)
    for k in IMAGE_KEYS:
        assert torch.equal(grid_images[k], reference_images[k])
    assert torch.equal(grid_texts["input_ids"], reference_texts["input_ids"])


def grid_by_loop(model, split, tok, images, texts):
    """(U, B) logits of every image against every caption, one pair at a time."""
    with torch.no_grad():
        return torch.tensor([[float(model(*pairs(split, tok, [i], [t]))[0]) for t in texts]
                             for i in images])


def test_listwise_itm_loss_is_the_listwise_loss_of_pair_by_pair_scores(bench, tok, model):
    split = bench["train"]
    texts = [3, 4, 250, 17, 90]  # captions 3 and 4 share an image
    batch = GridCollate(split, tok, 40)([{"index": t} for t in texts])
    out = listwise_itm_loss(model, batch)
    grid = grid_by_loop(model, split, tok, batch["img_index"].tolist(), texts)  # (U, B)
    assert torch.allclose(out["loss"], listwise_loss(grid, batch["text_image"]), atol=TOL)
    assert out["accuracy"] == (grid.argmax(0) == batch["text_image"]).float().mean()


def test_itc_hard_grid_draws_clusters_of_look_alike_images():
    # 12 images, one caption each, except image 0 (captions 0 and 12); images 1-3 look like the
    # anchor caption 0's image (ITC logit 50), the rest do not (0): the anchor's group takes them
    U, B = 12, 13
    text_image = torch.cat([torch.arange(U), torch.tensor([0])])
    similarity = torch.zeros(U, B)
    similarity[1:4, 0] = 50.0
    torch.manual_seed(0)
    rows = itc_hard_grid(similarity, text_image, size=8, clusters=2)
    assert len(rows) == 8 and rows[0] == 0
    assert sorted(text_image[rows[1:4]].tolist()) == [1, 2, 3]  # the anchor's look-alikes
    assert len(set(text_image[rows].tolist())) == 8  # every image once: never the anchor's own
    anchor_two = int(rows[4])  # the next caption of the batch whose image was not taken
    assert anchor_two == min(set(range(B)) - {0, 12} - set(text_image[rows[:4]].tolist()))


def test_itc_itm_loss_scores_the_chosen_grid_and_the_unimodal_features(bench, tok):
    split = bench["train"]
    torch.manual_seed(0)
    model = CrossEncoder(split.regions.shape[-1], len(tok),
                         CrossEncoderConfig.smoke(itc_weight=0.5, towers="none"),
                         pad_token_id=tok.pad_token_id).eval()
    # ITC off: no heads
    assert not hasattr(CrossEncoder(4, 9, CrossEncoderConfig.smoke(towers="none")), "itc_image")
    texts = list(range(0, 60, 3)) + [1]  # caption 1 shares caption 0's image
    batch = GridCollate(split, tok, 40)([{"index": t} for t in texts])
    torch.manual_seed(5)
    out = itc_itm_loss(model, batch, grid_size=6, clusters=2, itc_weight=0.5)
    image_emb, text_emb = model.unimodal(batch["images"], batch["texts"])
    logits = model.itc_log_scale.exp() * image_emb @ text_emb.T
    assert torch.allclose(out["itc"], listwise_loss(logits, batch["text_image"]), atol=TOL)
    torch.manual_seed(5)
    rows = itc_hard_grid(logits.detach(), batch["text_image"], 6, 2)
    chosen = [texts[r] for r in rows.tolist()]
    images, text_image = torch.unique(batch["text_image"][rows], return_inverse=True)
    grid = grid_by_loop(model, split, tok, batch["img_index"][images].tolist(), chosen)
    assert torch.allclose(out["itm"], listwise_loss(grid, text_image), atol=TOL)
    assert torch.allclose(out["loss"], out["itm"] + 0.5 * out["itc"], atol=TOL)


# ------------------------------------------------------------------------------------ SCAN's towers

def test_towers_add_scans_encoding_of_each_word_and_region(bench, tok, model):
    """towers="scan": each word token gets word_from_towers(SCAN's encoding of that word), each
    region token region_from_towers(SCAN's encoding of it), on top of UNITER's embeddings; [CLS],
    [SEP] and padding get nothing. Checked caption by caption against SCAN run on that
    caption alone."""
    from course_lib.core.blocks import JointEmbedding

    images, texts = pairs(bench["test"], tok, [0, 1, 2], [0, 5, 14])
    texts = {k: torch.cat([v, torch.full((3, 3), tok.pad_token_id if k == "input_ids" else 0)], 1)
             for k, v in texts.items()}  # three padded columns more
    with torch.no_grad():
        got = model.embed_text(texts)  # (3, T, H)
        base = JointEmbedding.embed_text(model, texts)
        for b in range(3):
            n = int(texts["attention_mask"][b].sum())  # [CLS] w1 .. w(n-2) [SEP]
            one = {k: v[b:b + 1, :n] for k, v in texts.items()}
            words, _ = model.towers.encode_texts(one)  # (1, n - 2, E)
            expected = base[b].clone()
            expected[1:n - 1] += model.word_from_towers(words[0])
            assert torch.allclose(got[b], expected, atol=TOL)
        got_images = model.embed_image(images)  # (3, R, H)
        regions, real = model.towers.encode_images(images)
        expected = (JointEmbedding.embed_image(model, images)
                    + model.region_from_towers(regions) * real[..., None])
        assert torch.allclose(got_images, expected, atol=TOL)


def test_towers_are_frozen_copied_and_stay_in_eval_mode(bench, tok):
    split = bench["train"]
    scan = untrained_towers(split, tok)
    model, _ = train_cross_encoder(bench, tok, CrossEncoderConfig.smoke(max_steps=2), towers=scan,
                                   progress=False, device="cpu")
    assert model.towers is not scan and all(p.requires_grad for p in scan.parameters())  # a copy
    assert all(torch.equal(a, b) for a, b in zip(model.towers.state_dict().values(),
                                                 scan.state_dict().values(), strict=True))
    assert not any(p.requires_grad for p in model.towers.parameters())
    assert model.train().towers.training is False and model.word_from_towers.training
    images, texts = pairs(split, tok, [0, 1], [0, 5])
    model(images, texts).sum().backward()
    assert all(p.grad is None for p in model.towers.parameters())
    assert model.word_from_towers[0].weight.grad is not None


def test_towers_config_is_checked(bench, tok):
    split = bench["train"]
    D, V = split.regions.shape[-1], len(tok)
    with pytest.raises(ValueError, match="needs the trained SCAN model"):
        CrossEncoder(D, V, CrossEncoderConfig.smoke())
    with pytest.raises(ValueError, match="needs the trained SCAN model"):
        CrossEncoder(D, V, CrossEncoderConfig.smoke(towers="none"),
                     towers=untrained_towers(split, tok))
    with pytest.raises(ValueError, match="towers='bert'"):
        CrossEncoder(D, V, CrossEncoderConfig.smoke(towers="bert"))
    assert CrossEncoder(D, V, CrossEncoderConfig.smoke(towers="none")).towers is None


def test_the_method_follows_its_scan_checkpoint_and_ships_with_it(bench, tok, tmp_path):
    """The cross-encoder is trained on SCAN's towers, so another SCAN is another cross-encoder file;
    the training planner sees SCAN as a model it needs; a shipped-style load rebuilds the towers
    untrained and takes their weights from the cross-encoder's own state."""
    config = CrossEncoderConfig.smoke(max_steps=3)
    a, b = smoke_method(config), smoke_method(config)
    assert a.stage(bench, tok).file_name == b.stage(bench, tok).file_name
    other_scan = CrossEncoderMethod(config,
                                    towers=SCANMethod(SCANConfig.smoke(max_steps=4),
                                                      progress=False))
    assert other_scan.stage(bench, tok).file_name != a.stage(bench, tok).file_name
    assert a.stage(bench, tok).fingerprint["starts_from"] == [a.towers.stage(bench, tok).file_name]
    assert a.towers in own_models([a])
    scratch = CrossEncoderMethod(CrossEncoderConfig.smoke(max_steps=3, towers="none"))
    assert (scratch.towers is None and scratch.stage(bench, tok).fingerprint["starts_from"] == []
            and own_models([scratch]) == [scratch])
    a.fit(bench, tok, cache_dir=tmp_path)
    assert (tmp_path / a.towers.stage(bench, tok).file_name).exists()  # SCAN trained first, cached
    rebuilt = a.build_model(bench, tok)
    rebuilt.load_state_dict(a.model.state_dict())
    split = bench["test"]
    assert torch.allclose(score_matrix(rebuilt.eval(), split, tok, progress=False),
                          a.similarity(split), atol=TOL)


def test_towers_read_a_repeated_caption_once_with_the_same_result(bench, tok, model, monkeypatch):
    images, texts = pairs(bench["test"], tok, [0, 1, 2, 3, 4, 5], [0, 5, 0, 14, 5, 0])
    expected = torch.stack([model(*pairs(bench["test"], tok, [i], [t]))[0] for i, t in
                            zip([0, 1, 2, 3, 4, 5], [0, 5, 0, 14, 5, 0], strict=True)])
    seen = []
    encode = model.towers.encode_texts
    monkeypatch.setattr(model.towers, "encode_texts",
                        lambda t: seen.append(len(t["input_ids"])) or encode(t))
    with torch.no_grad():
        assert torch.allclose(model(images, texts), expected, atol=TOL)
    assert seen == [3]  # three distinct captions among the six pairs


def test_the_method_records_a_learning_curve_on_small_galleries(bench, tok, tmp_path):
    """CURVE_POINTS evaluations of val[:n] and train[:n] (n = CURVE_IMAGES, or the split's size),
    the last one equal to scoring every pair of those galleries with the trained model."""
    from course_lib.methods.base import CURVE_POINTS
    from course_lib.methods.cross_encoder.method import CURVE_IMAGES

    method = smoke_method(CrossEncoderConfig.smoke(max_steps=8)).fit(bench, tok, cache_dir=tmp_path)
    rows = method.history.rows(eval=True)
    every = max(1, 8 // CURVE_POINTS)
    # the last at the end of training
    assert [r["step"] for r in rows] == list(range(every, 9, every))
    n = min(CURVE_IMAGES, bench["val"].n_images)
    for name, split in (("val", bench["val"]), ("train", bench["train"])):
        sub = split.subset(range(n))
        expected = retrieval_metrics(score_matrix(method.model, sub, tok, progress=False),
                                     sub.txt2img)
        assert rows[-1][f"{name}_t2i_r1"] == pytest.approx(expected["t2i_r1"])
        assert rows[-1][f"{name}_i2t_r5"] == pytest.approx(expected["i2t_r5"])
    # training CPU time so far: may round to 0.0 on a fast machine
    cpu = [r["cpu_seconds"] for r in rows]
    assert cpu == sorted(cpu) and all(isinstance(c, float) and c >= 0 for c in cpu)


def test_float16_regions_are_converted_per_batch_not_a_whole_gallery_per_call(bench, tok, model):
    # real features load as float16; re-ranking a query converted every region of the
    # gallery to float32, so one re-ranked query on Flickr8k's full setting cost 2 s and
    # 1.8 GB however few its pairs
    import dataclasses

    from course_lib.data.datasets import image_batch
    from course_lib.methods.cross_encoder.model import score_index_pairs

    split = bench["test"]
    half = dataclasses.replace(split, regions=split.regions.astype(np.float16))
    fields = image_fields(half)
    assert fields["regions"].dtype == torch.float16
    # a view, no copy
    assert fields["regions"].data_ptr() == half.regions.__array_interface__["data"][0]
    rows = torch.tensor([2, 0, 2])
    batch = image_batch(fields, rows)
    assert batch["regions"].dtype == torch.float32 and batch["region_mask"].dtype == torch.bool
    assert torch.equal(batch["regions"],
                       torch.from_numpy(half.regions[[2, 0, 2]].astype(np.float32)))
    # the same values in float32
    widened = dataclasses.replace(split, regions=half.regions.astype(np.float32))
    images, texts = [0, 3, 7], [1, 5, 5]
    assert torch.allclose(score_index_pairs(model, half, tok, images, texts),
                          score_index_pairs(model, widened, tok, images, texts), atol=TOL)


def test_the_method_embeds_each_image_and_caption_once_and_scores_as_the_model(bench, tok, model):
    """The method keeps a split's one-sided embeddings (`Embedded`): over blocks, pairs, the matrix
    and a query, each image is embedded once and each caption when first met, and every score equals
    the model's forward on that one pair."""
    split = bench["test"]
    method = CrossEncoderMethod(CrossEncoderConfig.smoke(), progress=False)
    method.model, method.tokenizer = model, tok
    embedded_rows = {"image": 0, "text": 0}
    embed_image, embed_text = model.embed_image, model.embed_text

    def count(side, embed):
        def counted(fields):
            embedded_rows[side] += len(next(iter(fields.values())))
            return embed(fields)
        return counted

    def one_pair(i, t):
        with torch.no_grad():
            return float(model(*pairs(split, tok, [i], [t]))[0])

    model.embed_image, model.embed_text = count("image", embed_image), count("text", embed_text)
    try:
        block = method.score_block(split, [5, 0, 3], [7, 1])  # (3, 2)
        pair_scores = method.score_pairs(split, torch.tensor([2, 5, 9]), torch.tensor([1, 4, 7]))
        matrix = method.similarity(split)
        top = method.query_fn(split, caption_index=4, top_k=3)()
    finally:
        del model.embed_image, model.embed_text  # the class's methods again
    assert embedded_rows["image"] == split.n_images
    assert embedded_rows["text"] == split.n_texts + 1  # every caption once, and the query's online
    want = torch.tensor([[one_pair(i, t) for t in (7, 1)] for i in (5, 0, 3)])
    assert torch.allclose(block, want, atol=TOL)
    expected_pairs = torch.tensor([one_pair(2, 1), one_pair(5, 4), one_pair(9, 7)])
    assert torch.allclose(pair_scores, expected_pairs, atol=TOL)
    assert torch.allclose(matrix[[5, 0, 3]][:, [7, 1]], want, atol=TOL)
    assert list(top) == torch.topk(matrix[:, 4], 3).indices.tolist()
