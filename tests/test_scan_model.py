"""The trainable SCAN model: its scores against an independent per-pair recomputation, unit-norm
encodings with padding and [CLS]/[SEP] left out, the loss, the evaluation matrix against
per-batch scoring, a short training run that must learn, the method's cache and its query."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.core import train as train_module
from course_lib.core.losses import hinge_triplet_loss
from course_lib.core.metrics import retrieval_metrics
from course_lib.core.tokens import CLS_ID, PAD_ID, SEP_ID
from course_lib.data.datasets import (
    ImageDataset,
    PairCollate,
    PairDataset,
    TextCollate,
    collate_images,
)
from course_lib.methods.scan.attention import scan_similarity
from course_lib.methods.scan.method import SCANMethod, train_scan
from course_lib.methods.scan.model import SCANConfig, SCANModel, scan_loss, scan_matrix, words_only

TOL = 1e-5
# the `bench` fixture (tests/conftest.py, with `tok` over its train captions): SyntheticConfig.smoke
# sizes; 3-5 objects, so some scenes have padded region slots
BENCH_SIZES = dict(n_train=400, n_val=60, n_test=20, n_pretrain=2, n_compositional=1, min_objects=3)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread


def make_model(bench, tok, **overrides):
    torch.manual_seed(0)
    config = SCANConfig.smoke(**overrides)
    return SCANModel(bench["train"].regions.shape[-1], len(tok), config).eval()


def pair_batch(split, tok, captions):
    """A PairCollate batch of these captions and their own images (positives on the diagonal)."""
    dataset = PairDataset(split)
    return PairCollate(tok)([dataset[t] for t in captions])


def by_hand(model, split, tok, image, caption):
    """One pair's score from scratch: real regions only, the caption's words alone (no padding,
    no [CLS]/[SEP]), unit-normalised here, then scan_similarity of the 1 x 1 pair without masks."""
    real = torch.as_tensor(split.region_mask[image])
    feats = torch.as_tensor(split.regions[image])[real]  # (r, D)
    boxes = torch.as_tensor(split.boxes[image])[real]  # (r, 7)
    regions = F.normalize(model.region_proj(feats) + model.box_proj(boxes), dim=-1)  # (r, E)
    ids = torch.tensor([tok(split.captions[caption], add_special_tokens=False)["input_ids"]])
    words = model.text_encoder({"input_ids": ids, "attention_mask": torch.ones_like(ids)}).tokens
    words = F.normalize(words, dim=-1)  # (1, n, E)
    c = model.config
    return scan_similarity(regions[None], None, words, None, c.direction, c.lambda_softmax, c.agg,
                           c.lambda_lse)[0, 0]


def test_words_only_drops_specials_and_keeps_order():
    ids = torch.tensor([[CLS_ID, 7, 8, 9, SEP_ID], [CLS_ID, 6, SEP_ID, PAD_ID, PAD_ID]])
    mask = (ids != PAD_ID).long()
    words, word_mask = words_only(ids, mask)
    assert words.tolist() == [[7, 8, 9], [6, PAD_ID, PAD_ID]]
    assert word_mask.tolist() == [[True] * 3, [True, False, False]]


@pytest.mark.parametrize("direction, agg", [("t2i", "lse"), ("t2i", "mean"), ("i2t", "lse")])
@torch.no_grad()
def test_forward_equals_a_per_pair_recomputation(bench, tok, direction, agg):
    split = bench["test"]
    captions = [0, 6, 11, 17, 23, 40]  # six different images
    model = make_model(bench, tok, direction=direction, agg=agg,
                       lambda_softmax=4.0 if direction == "i2t" else 9.0)
    scores = model(pair_batch(split, tok, captions))  # (6, 6)
    images = split.txt2img[captions]
    assert (~split.region_mask[images]).any(), "the test needs a scene with padded region slots"
    expected = torch.stack([torch.stack([by_hand(model, split, tok, i, t) for t in captions])
                            for i in images])
    torch.testing.assert_close(scores, expected, atol=TOL, rtol=TOL)


@torch.no_grad()
def test_encodings_are_unit_norm_and_padding_and_specials_change_nothing(bench, tok):
    split = bench["test"]
    model = make_model(bench, tok)
    batch = pair_batch(split, tok, list(range(0, 40, 5)))
    regions, region_mask = model.encode_images(batch)
    words, word_mask = model.encode_texts(batch)
    for items, mask in ((regions, region_mask), (words, word_mask)):
        norms = items.norm(dim=-1)
        torch.testing.assert_close(norms[mask], torch.ones(int(mask.sum())))
        assert (items[~mask] == 0).all() and (~mask).any()
    assert word_mask.sum(1).tolist() == [len(split.captions[t].split()) for t in range(0, 40, 5)]
    scores = model(batch)

    # Garbage in padded region slots, and other [CLS] / [SEP] embeddings: the same scores.
    batch["regions"][~batch["region_mask"]] = float("nan")
    model.text_encoder.embed.weight[[CLS_ID, SEP_ID]] += 5.0
    torch.testing.assert_close(model(batch), scores, atol=TOL, rtol=TOL)


def test_loss_is_the_hinge_of_the_scores_and_has_finite_gradients(bench, tok):
    model = make_model(bench, tok).train()
    batch = pair_batch(bench["train"], tok, list(range(0, 160, 5)))
    for margin, hardest in ((0.2, True), (0.5, False)):
        loss = scan_loss(margin, hardest)(model, batch)
        assert torch.allclose(loss, hinge_triplet_loss(model(batch), margin, hardest))
    model.zero_grad()
    loss.backward()  # padded words and regions must not poison the gradient with NaN
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@torch.no_grad()
def test_scan_matrix_equals_per_batch_scoring_at_any_batch_size(bench, tok):
    split, model = bench["val"], make_model(bench, tok)
    sims = scan_matrix(model, split, tok, batch_size=64, image_chunk=1000, progress=False)
    assert sims.shape == (split.n_images, split.n_texts)
    torch.testing.assert_close(scan_matrix(model, split, tok, batch_size=7, image_chunk=9,
                                           progress=False), sims,
                               atol=TOL, rtol=TOL)
    images = ImageDataset(split)
    for i0, t0 in ((0, 0), (25, 120), (50, 290)):
        image_batch = collate_images([images[i] for i in range(i0, min(i0 + 10, split.n_images))])
        text_batch = TextCollate(tok)(split.captions[t0:t0 + 10])
        block = model.score(*model.encode_images(image_batch), *model.encode_texts(text_batch))
        torch.testing.assert_close(sims[i0:i0 + 10, t0:t0 + 10], block, atol=TOL, rtol=TOL)


def test_short_training_beats_the_untrained_model(bench, tok):
    config = SCANConfig.smoke(max_steps=60, batch_size=32, lr=2e-3)
    untrained = make_model(bench, tok)  # the weights train_scan starts from (seed 0)
    model, history = train_scan(bench, tok, config, progress=False, device="cpu")
    val = bench["val"]
    before = retrieval_metrics(scan_matrix(untrained, val, tok, progress=False), val.txt2img)
    after = retrieval_metrics(scan_matrix(model, val, tok, progress=False), val.txt2img)
    assert history.column("loss")[-1] < history.column("loss")[0]
    assert after["t2i_r10"] > before["t2i_r10"] + 30, (before, after)  # measured: +70


def test_method_caches_its_checkpoint_and_queries_its_own_matrix(bench, tok, tmp_path, monkeypatch):
    config = SCANConfig.smoke(max_steps=3, batch_size=32)
    first = SCANMethod(config, progress=False).fit(bench, tok, cache_dir=tmp_path)
    assert first.checkpoint_path.exists() and first.checkpoint_path.name.startswith("scan-")

    def no_training(self, batches):
        raise AssertionError("the second fit trained instead of loading the checkpoint")

    monkeypatch.setattr(train_module.Trainer, "_train_step", no_training)
    second = SCANMethod(config, progress=False).fit(bench, tok, cache_dir=tmp_path)
    assert second.checkpoint_path == first.checkpoint_path
    split = bench["test"]
    sims = second.similarity(split)  # (N, T)
    torch.testing.assert_close(sims, first.similarity(split), atol=TOL, rtol=TOL)
    for caption in (0, 37):
        top = second.query_fn(split, caption_index=caption)()
        assert top.tolist() == torch.topk(sims[:, caption], 10).indices.tolist()
    assert "SCAN" in second.notes
    other = SCANMethod(SCANConfig.smoke(max_steps=3, batch_size=32, use_boxes=False),
                       progress=False)
    with pytest.raises(AssertionError, match="second fit trained"):  # another config, another file
        other.fit(bench, tok, cache_dir=tmp_path)


def test_the_method_scores_blocks_and_pairs_as_the_matrix_encoding_only_the_captions_it_meets(
        bench, tok, monkeypatch):
    from course_lib.methods.scan import method as scan_method

    torch.manual_seed(0)
    method = SCANMethod(SCANConfig.smoke(), progress=False)
    method.model, method.tokenizer = make_model(bench, tok), tok
    split = bench["test"]
    want = scan_matrix(method.model, split, tok, progress=False)  # (N, T): every caption at once
    encoded = []
    real_encode = scan_method.encode_words

    def recording_encode(*a, texts, **k):
        encoded.extend(texts)
        return real_encode(*a, texts=texts, **k)

    monkeypatch.setattr(scan_method, "encode_words", recording_encode)
    images, captions = [3, 0, 7], [12, 5, 40, 5]
    block = method.score_block(split, images, captions)  # (3, 4)
    torch.testing.assert_close(block, want[images][:, captions], atol=TOL, rtol=TOL)
    assert sorted(encoded) == [5, 12, 40]  # each caption once, none that was not asked for
    pairs_i, pairs_t = [1, 9, 2, 4], [40, 77, 77, 3]
    torch.testing.assert_close(method.score_pairs(split, pairs_i, pairs_t), want[pairs_i, pairs_t],
                               atol=TOL, rtol=TOL)
    assert sorted(encoded) == [3, 5, 12, 40, 77]  # the new ones in one batch, the known ones reused


@pytest.fixture(scope="module")
def wordpieces(bench, minilm_folder):
    from course_lib.data.tokenizer import tokenizer_for

    return tokenizer_for(bench["train"], name=minilm_folder[1])


def bert_scan(bench, wordpieces, folder, **overrides):
    from course_lib.core.tokens import SpecialTokens

    torch.manual_seed(0)
    config = SCANConfig.smoke(text_encoder=folder, **overrides)
    return SCANModel(bench["train"].regions.shape[-1], len(wordpieces), config,
                     SpecialTokens.of(wordpieces))


@torch.no_grad()
def test_a_pretrained_text_side_gives_its_states_at_the_words_under_one_linear_map(
        bench, wordpieces, minilm_folder):
    from transformers import AutoModel

    model = bert_scan(bench, wordpieces, minilm_folder[1]).eval()
    captions = [0, 1, 7]
    # (3, L, E), (3, L)
    words, mask = model.encode_texts(pair_batch(bench["train"], wordpieces, captions))
    minilm = AutoModel.from_pretrained(minilm_folder[1]).eval()
    for row, caption in enumerate(captions):
        # [CLS] w.. [SEP]
        ids = torch.tensor([wordpieces(bench["train"].captions[caption])["input_ids"]])
        # (n, H): read in context, words kept
        states = minilm(input_ids=ids).last_hidden_state[0, 1:-1]
        want = F.normalize(model.word_proj(states), dim=-1)  # (n, E)
        n = len(want)
        assert int(mask[row].sum()) == n and not words[row, n:].any()  # padding exactly zero
        torch.testing.assert_close(words[row, :n], want, atol=1e-5, rtol=1e-4)


def test_the_pretrained_text_side_learns_only_its_last_layers(
        bench, wordpieces, minilm_folder):
    frozen = bert_scan(bench, wordpieces, minilm_folder[1])
    assert not any(p.requires_grad for p in frozen.text_encoder.parameters())
    assert frozen.word_proj.weight.requires_grad
    top = bert_scan(bench, wordpieces, minilm_folder[1], text_trainable_layers=1)
    learning = {n.split(".")[3] for n, p in top.text_encoder.named_parameters()
                if p.requires_grad and n.startswith("bert.encoder.layer.")}
    assert learning == {"5"}  # MiniLM's last of 6
    with pytest.raises(ValueError, match="text_encoder='all-MiniLM-L6-v2'"):
        SCANConfig(text_trainable_layers=2)
