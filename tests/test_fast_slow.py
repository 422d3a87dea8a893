"""Fast & Slow: h(x, y) against a token-by-token loop, the reversed caption of the backward decoder,
the weighted fusion by hand, cached against uncached scores, the teacher's B x B matrix,
distillation gradients, eq. 9's beta combine by hand, and the methods (checkpoints, cascade,
query_fn)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.tokens import WORD_SPECIAL_TOKENS
from course_lib.data.datasets import ImageDataset, PairCollate, PairDataset
from course_lib.methods.fast_slow.decoder import reverse_words
from course_lib.methods.fast_slow.distill import distill_loss, teacher_scores
from course_lib.methods.fast_slow.method import (
    FastMethod,
    FastSlowCascade,
    SlowMethod,
    initial_fast_model,
    undistilled,
)
from course_lib.methods.fast_slow.model import (
    FastConfig,
    FastModel,
    SlowConfig,
    SlowModel,
    WeightedFusion,
)
from course_lib.methods.fast_slow.scoring import compute_states, score_cached_pairs
from course_lib.methods.pixel_stem import (
    load_stem_backbone,
    pixel_stem_stage,
    stem_config,
    train_pixel_stem,
)

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")
# the pixel stem: a batch of 128
BENCH_SIZES = dict(n_train=80, n_val=10, n_test=16, n_pretrain=130, n_compositional=1)
SMALL = dict(hidden=16, heads=2, layers=2, channels=(4, 8, 8), dropout=0.0)


def pair_batch(split, tokenizer, rows):
    return PairCollate(tokenizer)([PairDataset(split, modality="pixels")[t] for t in rows])


@pytest.fixture(scope="module")
def slow(bench, tok):
    torch.manual_seed(0)
    return SlowModel(len(tok), SlowConfig(**SMALL)).eval()


# ----------------------------------------------------------------------------------- the Slow model

def test_reverse_words_by_hand():
    ids = torch.tensor([[2, 7, 8, 9, 3, 0], [2, 5, 3, 0, 0, 0], [2, 6, 7, 8, 9, 3]])
    expected = torch.tensor([[2, 9, 8, 7, 3, 0], [2, 5, 3, 0, 0, 0], [2, 9, 8, 7, 6, 3]])
    assert torch.equal(reverse_words(ids, ids != 0), expected)


def _loop_log_likelihood(model: SlowModel, kvs: dict, words: list[int]) -> float:
    """h of one caption, one token at a time: for each direction, feed [CLS] and the words so far
    (no padding, no [SEP]), read the last position's log-softmax at the next word."""
    total = 0.0
    for decoder, sequence, key in ((model.forward_decoder, words, "fwd"),
                                   (model.backward_decoder, words[::-1], "bwd")):
        for step, target in enumerate(sequence):
            prefix = torch.tensor([[WORD_SPECIAL_TOKENS.cls] + sequence[:step]])  # (1, step + 1)
            hidden = decoder(model._embed(prefix), kvs[key])  # (1, step + 1, H)
            total += torch.log_softmax(model.output(hidden[0, -1]), dim=-1)[target].item()
    return total


def test_h_against_a_token_by_token_loop(slow, bench, tok):
    batch = pair_batch(bench["test"], tok, [0, 7, 13, 22])
    with torch.no_grad():
        h = slow(batch)  # (4,) one padded batch, teacher-forced
        for b in range(4):
            kvs = slow.keys_values(slow.visual_tokens({"pixels": batch["pixels"][b:b + 1]}))
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
            assert ids[0] == WORD_SPECIAL_TOKENS.cls and ids[-1] == WORD_SPECIAL_TOKENS.sep
            assert h[b].item() == pytest.approx(_loop_log_likelihood(slow, kvs, ids[1:-1]), abs=TOL)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1  # the batch was padded


def test_backward_decoder_reads_the_reversed_caption(slow, bench, tok):
    batch = pair_batch(bench["test"], tok, [1, 2])
    with torch.no_grad():
        kvs = slow.keys_values(slow.visual_tokens(batch))
        _, backward, reversed_ids = slow.logits(kvs, batch)
        # the first caption's words
        words = batch["input_ids"][0][batch["input_ids"][0] > 4].tolist()
        by_hand = torch.tensor([[2] + words[::-1] + [3]])  # (1, n) [CLS] reversed words [SEP]
        n = by_hand.shape[1]
        assert torch.equal(reversed_ids[0, :n], by_hand[0])
        alone = slow.output(slow.backward_decoder(slow._embed(by_hand),
                                                  [kv[:, :1] for kv in kvs["bwd"]]))
        assert torch.allclose(backward[0, :n], alone[0], atol=TOL)


def test_weighted_fusion_by_hand():
    torch.manual_seed(0)
    fusion = WeightedFusion(lateral_channels=3, hidden=2).eval()
    coarse, lateral = torch.randn(1, 2, 2, 2), torch.randn(1, 3, 4, 4)
    with torch.no_grad():
        fusion.weights.copy_(torch.tensor([2.0, -1.0]))  # ReLU'd: the lateral gets weight 0
        up = coarse.repeat_interleave(2, 2).repeat_interleave(2, 3)  # nearest, by hand
        assert torch.allclose(fusion(coarse, lateral), fusion.conv(2 * up / (2 + 1e-4)), atol=1e-6)
        fusion.weights.copy_(torch.tensor([1.0, 3.0]))
        expected = fusion.conv((up + 3 * fusion.lateral(lateral)) / (4 + 1e-4))
        assert torch.allclose(fusion(coarse, lateral), expected, atol=1e-6)


def test_padding_changes_nothing(slow, bench, tok):
    rows = [3, 9]
    batch = pair_batch(bench["test"], tok, rows)
    with torch.no_grad():
        together = slow(batch)
        alone = torch.cat([slow(pair_batch(bench["test"], tok, [t])) for t in rows])
    assert torch.allclose(together, alone, atol=TOL)


def test_cached_and_uncached_scores_agree(slow, bench, tok):
    split = bench["test"]
    states = compute_states(slow, split, tok, batch_size=5)  # several blocks
    g = np.random.default_rng(0)
    images, texts = g.integers(0, split.n_images, 30), g.integers(0, split.n_texts, 30)
    cached = score_cached_pairs(slow, states, images, texts, batch_size=7)
    pixels = torch.stack([ImageDataset(split, modality="pixels")[int(i)]["pixels"] for i in images])
    captions = pair_batch(split, tok, texts.tolist())
    with torch.no_grad():
        uncached = slow.score({"pixels": pixels}, captions)
    assert torch.allclose(cached, uncached, atol=TOL)
    with pytest.raises(ValueError, match="two"):
        score_cached_pairs(slow, states, images, texts[:3])


def test_teacher_scores_against_a_loop_of_pairs(slow, bench, tok):
    batch = pair_batch(bench["train"], tok, [0, 5, 11])
    grid = teacher_scores(slow, batch)  # (3, 3) rows images, columns captions
    with torch.no_grad():
        for i in range(3):
            for j in range(3):
                texts = {k: batch[k][j:j + 1] for k in ("input_ids", "attention_mask")}
                pixels = {"pixels": batch["pixels"][i:i + 1]}
                assert grid[i, j].item() == pytest.approx(slow.score(pixels, texts).item(), abs=TOL)


def test_distillation_gradients_reach_only_the_student(slow, bench, tok):
    torch.manual_seed(0)
    student = FastModel(len(tok), FastConfig(hidden=8, embed_dim=8, channels=(4, 8, 8)))
    for p in slow.parameters():
        p.requires_grad_(True)
        p.grad = None
    loss_fn = distill_loss(slow, FastConfig(distill=True))
    out = loss_fn(student, pair_batch(bench["train"], tok, range(6)))
    out["loss"].backward()
    assert all(p.grad is None for p in slow.parameters())
    grads = [p.grad for p in student.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert (out["loss"].item()
            == pytest.approx(out["distill"].item() + 1.0 * out["nce"].item(), rel=1e-5))  # alpha 1


# -------------------------------------------------------------------------- the Fast model's towers

def test_fast_image_pools_by_hand(bench, tok):
    """f(x) = b + W . (the 4x4 map's mean) or b + sum over channels and cells of W[:, c, cell] *
    map, cell by cell; only the flattened pool sees where things are (swapping two cells of
    the map)."""
    torch.manual_seed(0)
    pixels = pair_batch(bench["test"], tok, [0, 1])["pixels"]
    for pool in ("mean", "flatten"):
        model = FastModel(len(tok), FastConfig(hidden=8, embed_dim=5, channels=(4, 8, 6),
                                               image_pool=pool)).eval()
        with torch.no_grad():
            grid = model.backbone(pixels)[2]  # (2, 6, 4, 4)
            W, b = model.image_proj.weight, model.image_proj.bias  # (5, 6) or (5, 96)
            expected = torch.zeros(2, 5)
            for n in range(2):
                for c in range(6):
                    for i in range(4):
                        for j in range(4):
                            w = W[:, c] / 16 if pool == "mean" else W[:, c * 16 + i * 4 + j]
                            expected[n] += w * grid[n, c, i, j]
            assert torch.allclose(model.encode_images({"pixels": pixels}), expected + b, atol=1e-5)
            swapped = grid.clone()
            swapped[:, :, :, [0, 3]] = grid[:, :, :, [3, 0]]  # left and right columns exchanged
            pooled = swapped.mean((2, 3)) if pool == "mean" else swapped.flatten(1)
            moved = model.image_proj(pooled)
            assert torch.allclose(moved, expected + b, atol=1e-5) == (pool == "mean")


def test_fast_text_towers_and_word_order(bench, tok):
    """The BoW cannot tell "red circle left of blue square" from "blue circle left of red square";
    the bi-GRU and transformer towers can, and their g(y) does not depend on the padding of
    the batch."""
    torch.manual_seed(0)
    captions = ["a red circle left of a blue square", "a blue circle left of a red square",
                "a red circle"]
    texts = PairCollate(tok).encode(captions)
    # the words are in the vocabulary
    assert not torch.equal(texts["input_ids"][0], texts["input_ids"][1])
    alone = [PairCollate(tok).encode([c]) for c in captions]
    for tower, same in (("bow", True), ("transformer", False), ("gru", False)):
        model = FastModel(len(tok), FastConfig(hidden=8, embed_dim=8, channels=(4, 8, 8),
                                               text_tower=tower, text_layers=1)).eval()
        with torch.no_grad():
            g = model.encode_texts(texts)  # (3, E), padded to the longest caption
            assert torch.allclose(g[0], g[1], atol=1e-6) == same
            for row, one in enumerate(alone):
                assert torch.allclose(g[row], model.encode_texts(one)[0], atol=1e-5)
    with pytest.raises(ValueError, match="text_tower"):
        FastConfig(text_tower="lstm")


# ---------------------------------------------------------------------------- eq. 9 and the methods

class _Stub:
    """A slow stage whose score_pairs returns fixed h per (image, caption)."""

    def __init__(self, h: dict, name="stub"):
        self.h, self.name, self.eval_pairs = h, name, (None, None)

    def score_pairs(self, split, images, texts):
        return torch.tensor([self.h[(int(i), int(t))] for i, t in zip(images, texts, strict=True)])


def test_beta_combine_by_hand():
    # one caption (0), fast top 3 = images 4, 1, 7 with f.g = 9, 5, 1; h = -10, -8, -7.5
    h = {(4, 0): -10.0, (1, 0): -8.0, (7, 0): -7.5}
    candidates, first = torch.tensor([[4, 1, 7]]), torch.tensor([[9.0, 5.0, 1.0]])
    for beta, order, scores in ((0.0, [7, 1, 4], [-7.5, -8.0, -10.0]),  # h alone
                                # -10 + 4.5, -8 + 2.5, -7.5 + 0.5 (stable tie)
                                (0.5, [4, 1, 7], [-5.5, -5.5, -7.0]),
                                (0.25, [1, 7, 4], [-6.75, -7.25, -7.75])):
        # combine = weighted_sum([beta, 1])
        cascade = FastSlowCascade(_Stub({}, "fast"), _Stub(h), 3, beta=beta)
        indices, got = cascade.rescore(None, "t2i", [0], candidates, first)
        assert indices[0].tolist() == order
        assert got[0].tolist() == pytest.approx(scores)


@pytest.fixture(scope="module")
def fitted(bench, tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("fast_slow")
    slow = SlowMethod(SlowConfig(**SMALL, max_steps=4, batch_size=8, stem_steps=3),
                      progress=False).fit(bench, tok, cache)
    fast_config = FastConfig(hidden=8, embed_dim=8, channels=(4, 8, 8), max_steps=4, batch_size=8,
                             distill_steps=3, distill_batch_size=4, stem_steps=3)
    fast = FastMethod(fast_config, progress=False).fit(bench, tok, cache)
    distilled = FastMethod(dataclasses.replace(fast_config, distill=True),
                           name="fast-distilled", teacher=slow,
                           init=fast, progress=False).fit(bench, tok, cache)
    return slow, fast, distilled, cache


def test_checkpoints_are_named_by_config_and_teacher(fitted, bench, tok):
    slow, fast, distilled, cache = fitted
    names = {m.checkpoint_path.name for m in (slow, fast, distilled)}
    assert len(names) == 3 and all((cache / n).exists() for n in names)
    assert undistilled(distilled.config) == fast.config
    other_teacher = SlowMethod(dataclasses.replace(slow.config, seed=1))
    again = FastMethod(distilled.config, name="fast-distilled", teacher=other_teacher, init=fast)
    assert again.stage(bench, tok).file_name != distilled.checkpoint_path.name
    with pytest.raises(ValueError, match="teacher"):
        FastMethod(distilled.config)


def test_fast_starts_from_the_cached_pixel_stem(fitted, bench, tok):
    """image_init="pixel_stem": FastMethod.fit trained the stem into the cache beside it (named in
    the Fast checkpoint's name) and the model started from the stem's backbone; "scratch"
    does not."""
    _, fast, distilled, cache = fitted
    stem_file = pixel_stem_stage(bench, stem_config(fast.config)).file_name
    assert (cache / stem_file).exists() and fast.stem_stage(bench).file_name == stem_file
    assert distilled.stem_stage(bench) is None  # it starts from the plain model's weights
    stem, _ = train_pixel_stem(bench, stem_config(fast.config), checkpoint_path=cache / stem_file,
                               progress=False)
    start = initial_fast_model(bench, tok, fast.config, stem_checkpoint=cache / stem_file,
                               progress=False)
    stem_state = stem.backbone.state_dict()
    assert start.backbone.state_dict().keys() == stem_state.keys()
    for name, value in start.backbone.state_dict().items():
        assert torch.equal(value, stem_state[name]), name
    # fine-tuned (the default), eq. 4 moved the CNN; frozen, its steps leave it (BatchNorm
    # statistics included) as the stem made it, and the stem's file is shared: not trained again
    assert not all(torch.equal(v.cpu(), stem_state[k])
                   for k, v in fast.model.backbone.state_dict().items())
    frozen = FastMethod(dataclasses.replace(fast.config, freeze_stem=True),
                        progress=False).fit(bench, tok, cache)
    assert frozen.checkpoint_path.name != fast.checkpoint_path.name
    assert frozen.stem_stage(bench).file_name == stem_file
    # BatchNorm stays the stem's
    assert not frozen.model.train().backbone.training and frozen.model.text.training
    frozen.model.eval()
    assert not any(p.requires_grad for p in frozen.model.backbone.parameters())
    for name, value in frozen.model.backbone.state_dict().items():
        assert torch.equal(value.cpu(), stem_state[name]), name
    scratch_config = dataclasses.replace(fast.config, image_init="scratch")
    scratch = initial_fast_model(bench, tok, scratch_config)
    assert not torch.equal(scratch.backbone.stages[0][0][0].weight,
                           stem.backbone.stages[0][0][0].weight)
    # the rest starts from the same seeded weights
    for key in ("image_proj.weight", "text.embed.weight"):
        assert torch.equal(scratch.state_dict()[key], start.state_dict()[key])
    scratch_method = FastMethod(scratch_config)
    assert scratch_method.stem_stage(bench) is None
    assert scratch_method.stage(bench, tok).file_name != fast.checkpoint_path.name
    other_stem = FastMethod(dataclasses.replace(fast.config, stem_steps=4))
    assert other_stem.stage(bench, tok).file_name != fast.checkpoint_path.name
    with pytest.raises(ValueError, match="image_init"):
        FastConfig(image_init="imagenet")


def test_slow_starts_from_the_stem_fast_trained(fitted, bench, tok):
    """Slow and Fast of the same channels share one stem file; Slow's CNN starts from it (the
    decoders train it on), and image_init="scratch" names another checkpoint and needs no stem."""
    slow, fast, _, cache = fitted
    stem_file = fast.stem_stage(bench).file_name
    assert (slow.stem_stage(bench).file_name == stem_file
            and slow.stage(bench, tok).fingerprint["starts_from"] == [stem_file])
    stem, _ = train_pixel_stem(bench, stem_config(slow.config), checkpoint_path=cache / stem_file,
                               progress=False)
    torch.manual_seed(0)
    untrained = SlowModel(len(tok), dataclasses.replace(slow.config, max_steps=0))
    load_stem_backbone(untrained.visual.backbone, bench, slow.config,
                       checkpoint_path=cache / stem_file)
    for name, value in stem.backbone.state_dict().items():
        assert torch.equal(untrained.visual.backbone.state_dict()[name], value), name
    trained = slow.model.visual.backbone.state_dict()
    # fine-tuned
    assert not all(torch.equal(v.cpu(), stem.backbone.state_dict()[k]) for k, v in trained.items())
    scratch = SlowMethod(dataclasses.replace(slow.config, image_init="scratch"))
    assert (scratch.stem_stage(bench) is None
            and scratch.stage(bench, tok).fingerprint["starts_from"] == [])
    assert scratch.stage(bench, tok).file_name != slow.checkpoint_path.name
    with pytest.raises(ValueError, match="stem_head_pool"):
        SlowConfig(stem_head_pool="max")


def test_a_stem_trained_for_any_model_records_its_accuracy(bench, tok, tmp_path):
    """Regression: HiVLP trained the shared stem without evaluating it, so a later reader of the
    cached stem's history (notebook 06) found no accuracy row."""
    from course_lib.methods.hivlp.method import HiVLPMethod
    from course_lib.methods.hivlp.model import HiVLPConfig

    hivlp = HiVLPMethod(HiVLPConfig(hidden=16, heads=2, eol_widths=(4, 8), max_steps=2,
                                    batch_size=8, stem_steps=3),
                        progress=False).fit(bench, tok, tmp_path)
    path = tmp_path / hivlp.stem_stage(bench).file_name
    _, history = train_pixel_stem(bench, stem_config(hivlp.config), checkpoint_path=path,
                                  progress=False)
    assert history.rows(eval=True) and "object" in history.rows(eval=True)[-1]


def test_distillation_from_scratch_needs_no_init(fitted, bench, tok, tmp_path):
    """distill_start="scratch": eq. 8 from the initial weights (the paper's student; its CNN from
    the pixel stem by default); no plain model is trained or named, and the start changes
    the name."""
    slow, fast, distilled, _ = fitted
    config = dataclasses.replace(distilled.config, distill_start="scratch")
    scratch = FastMethod(config, name="fast-distilled", teacher=slow, progress=False)
    assert (scratch.init is None
            and scratch.stage(bench, tok).file_name != distilled.checkpoint_path.name)
    scratch.fit(bench, tok, tmp_path)
    # the student and the pixel stem it starts from; no plain Fast model
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([scratch.checkpoint_path.name,
                                                                 scratch.stem_stage(bench).file_name])
    torch.manual_seed(config.seed)
    fresh = FastModel(len(tok), config)  # train_fast's seed, so its starting weights
    moved = [not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                   scratch.model.state_dict().values(), strict=True)
             if a.is_floating_point()]
    assert any(moved)
    with pytest.raises(ValueError, match="teacher"):
        FastMethod(config)


def test_slow_method_ranks_by_h_and_its_query_fn_agrees(fitted, bench):
    slow = fitted[0]
    split = bench["test"]
    scores = slow.similarity(split)  # (N, T) by score_block
    queries = np.array([0, 4, 9])
    indices, _ = slow.rank(split, "t2i", 5, queries=queries)
    assert torch.equal(indices, torch.topk(scores.T[queries], 5).indices)
    assert torch.equal(torch.as_tensor(slow.query_fn(split, 4, top_k=5)()), indices[1])


def test_fast_slow_cascade_reorders_only_the_top_k(fitted, bench):
    slow, _, distilled, _ = fitted
    split, K = bench["test"], 4
    cascade = FastSlowCascade(distilled, slow, K, beta=0.5)
    first, _ = distilled.rank(split, "t2i", split.n_images)
    indices, _ = cascade.rank(split, "t2i", split.n_images)
    assert torch.equal(indices[:, K:], first[:, K:])  # beyond K the fast order stands
    assert torch.equal(indices[:, :K].sort(1).values, first[:, :K].sort(1).values)
    assert torch.equal(torch.as_tensor(cascade.query_fn(split, 2, top_k=K)()), indices[2, :K])


def test_fast_trains_on_the_training_split_then_fresh_scenes(bench, tok, monkeypatch):
    """FastConfig.fresh_scenes: eq. 4 (and eq. 8) read the training split followed by that many
    fresh scenes of the same generator settings; 0 reads the training split alone."""
    import course_lib.methods.fast_slow.method as fast_method

    seen = []
    monkeypatch.setattr(fast_method, "fit_pairs",
                        lambda model, loss, split, *a, **k: seen.append(split))
    train = bench["train"]
    for n in (0, 24):
        config = FastConfig.smoke(image_init="scratch", fresh_scenes=n)
        fast_method.train_fast(bench, tok, config, progress=False)
        split = seen[-1]
        assert split.n_images == train.n_images + n and split.n_texts == train.n_texts + 5 * n
        assert split.captions[:train.n_texts] == train.captions
        np.testing.assert_array_equal(split.images[:train.n_images], train.images)
    assert seen[0] is train
    with pytest.raises(ValueError, match="fresh_scenes"):
        FastConfig(fresh_scenes=-1)


# ------------------------------------------------------------------------- grid cells (real photos)

def region_batch(split, tokenizer, rows):
    return PairCollate(tokenizer)([PairDataset(split, modality="regions")[t] for t in rows])


def test_slow_over_grid_cells_cached_and_uncached_agree(bench, tok):
    torch.manual_seed(0)
    split = bench["test"]
    config = SlowConfig(**SMALL, image_input="regions", image_init="scratch")
    model = SlowModel(len(tok), config, region_dim=split.regions.shape[-1]).eval()
    states = compute_states(model, split, tok, batch_size=5)
    regions = split.regions.shape[1]
    assert (states.kvs["fwd"][0].shape[:2] == (2, split.n_images)
            and states.kvs["fwd"][0].shape[3] == regions)
    g = np.random.default_rng(1)
    images, texts = g.integers(0, split.n_images, 12), g.integers(0, split.n_texts, 12)
    cached = score_cached_pairs(model, states, images, texts, batch_size=5)
    picked = [ImageDataset(split, modality="regions")[int(i)] for i in images]
    fields = {k: torch.stack([p[k] for p in picked]) for k in ("regions", "boxes", "region_mask")}
    with torch.no_grad():
        uncached = model.score(fields, region_batch(split, tok, texts.tolist()))
    assert torch.allclose(cached, uncached, atol=TOL)


def test_fast_over_grid_cells_is_a_linear_map_of_their_mean(bench, tok):
    torch.manual_seed(0)
    split = bench["test"]
    config = FastConfig(hidden=8, embed_dim=6, image_input="regions", image_init="scratch",
                        image_pool="mean")
    model = FastModel(len(tok), config, region_dim=split.regions.shape[-1]).eval()
    assert not hasattr(model, "backbone")  # the pretrained CNN ran once, at extraction
    batch = region_batch(split, tok, [0, 5, 9])
    cells = batch["region_mask"][..., None].float()
    mean = (batch["regions"] * cells).sum(1) / cells.sum(1)  # (B, D)
    with torch.no_grad():
        expected = mean @ model.image_proj.weight.T + model.image_proj.bias
        torch.testing.assert_close(model.encode_images(batch), expected)


def test_grid_cells_config_errors_say_what_to_set(bench, tok):
    with pytest.raises(ValueError, match="image_init='scratch'"):
        SlowConfig(image_input="regions")
    with pytest.raises(ValueError, match="image_pool='mean'"):
        FastConfig(image_input="regions", image_init="scratch")
    with pytest.raises(ValueError, match="image_input must be one of"):
        FastConfig(image_input="photos")
    with pytest.raises(ValueError, match="needs region_dim"):
        SlowModel(10, SlowConfig(image_input="regions", image_init="scratch"))
    # another input is another model
    regions = SlowConfig(image_input="regions", image_init="scratch")
    assert (SlowMethod(regions).stage(bench, tok).file_name
            != SlowMethod(SlowConfig(image_init="scratch")).stage(bench, tok).file_name)
