"""U-BERT: pooling and masks, eq. 15 by hand, the L1/L2 matrices against loops, SCAN's reading of
each token in BERT_cross's inputs, the freeze of step 2, the cached-state path against the uncached
one, the K invariant of the cascade, and caching."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.blocks import masked_mean
from course_lib.core.losses import hinge_triplet_loss
from course_lib.core.metrics import ranks_from_top_k, recall_at_k
from course_lib.data.datasets import PairCollate, PairDataset, text_fields
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.queries import ground_truth, length_blocks
from course_lib.methods.scan.method import SCANMethod
from course_lib.methods.scan.model import SCANConfig, build_scan
from course_lib.methods.ubert.method import (
    TOP_K,
    UBERTCascade,
    UBERTMethod,
    cross_loss,
    tower_config,
    tower_loss,
    train_ubert,
)
from course_lib.methods.ubert.model import (
    STEP_TWO_PARTS,
    UBERTConfig,
    build_ubert,
    compute_states,
    enhanced_similarity,
    rescore_candidates,
    score_cached_pairs,
)
from course_lib.shipping import own_models

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=120, n_val=20, n_test=24, n_pretrain=10, n_compositional=1)


def small_config(**kw) -> UBERTConfig:
    return UBERTConfig(**{"hidden": 16, "tower_layers": 1, "cross_layers": 1, "heads": 2,
                          "batch_size": 16, "cross_batch_size": 8, "max_steps": 6, "cross_steps": 6,
                          "sum_warmup_steps": 2, "dropout": 0.0, **kw})


def untrained_scan(split, tok):
    """A SCAN model with random weights: what cross_towers="scan" reads, to test the plumbing."""
    torch.manual_seed(0)
    return build_scan(SCANConfig.smoke(), split, tok)


def smoke_method(config: UBERTConfig, **kwargs) -> UBERTMethod:
    """A UBERTMethod whose SCAN trains for 3 steps (the default would train SCAN's own size)."""
    return UBERTMethod(config, progress=False,
                       scan=SCANMethod(SCANConfig.smoke(max_steps=3), progress=False), **kwargs)


def is_tower_key(name: str) -> bool:
    """A state_dict key of step 1's model: not BERT_cross, its SCAN inputs or the SCAN copy."""
    return not name.startswith((*STEP_TWO_PARTS, "scan."))


def pair_batch(split, tokenizer, rows):
    return PairCollate(tokenizer)([PairDataset(split)[t] for t in rows])


@pytest.fixture(scope="module")
def scan(bench, tok):
    return untrained_scan(bench["train"], tok)


@pytest.fixture(scope="module")
def model(bench, tok, scan):
    torch.manual_seed(0)
    return build_ubert(small_config(cross_layers=2), bench["train"], tok, scan).eval()


@pytest.fixture(scope="module")
def fitted(bench, tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("ubert")
    return smoke_method(small_config()).fit(bench, tok, cache_dir=cache), cache


# ---------------------------------------------------------------------------------------- the model

def test_masked_mean_against_a_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0] * 5]).bool()
    expected = torch.stack([x[b][mask[b]].mean(0) if mask[b].any() else torch.zeros(4)
                            for b in range(3)])
    assert torch.allclose(masked_mean(x, mask), expected, atol=TOL)


def test_eq15_by_hand():
    # I_intra = (1, 0), I_inter = (0, 1), T_intra = (0, 1), T_inter = (1, 0), alpha = 0.5:
    # (0.5, 1) . (1, 0.5) = 1, |(0.5, 1)| = |(1, 0.5)| = sqrt(1.25), so s2 = 1 / 1.25 = 0.8
    e1, e2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert enhanced_similarity(e1, e2, e2, e1, alpha=0.5).item() == pytest.approx(0.8, abs=TOL)
    # s1 of the same pair is cos(e1, e2) = 0; with no inter part eq. 15 is s1 (an embedding model)
    assert enhanced_similarity(e1, e2, 0 * e1, 0 * e2).item() == pytest.approx(0.0, abs=TOL)
    g = torch.Generator().manual_seed(1)
    i, t = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    s1 = torch.nn.functional.cosine_similarity(i, t, dim=-1)
    assert torch.allclose(enhanced_similarity(i, t, torch.zeros_like(i), torch.zeros_like(t), 0.3),
                          s1, atol=TOL)
    # and a very large alpha drowns the inter part: s2 -> s1
    assert torch.allclose(enhanced_similarity(i, t, torch.randn(6, 8), torch.randn(6, 8), 1e6),
                          s1, atol=1e-4)


def test_states_are_unit_means_of_the_towers_and_ignore_padding(model, bench, tok):
    batch = pair_batch(bench["train"], tok, range(6))
    tokens, mask, intra = model.image_states(batch)
    attended = model.image_tower(model.embed_image(batch), mask)
    expected = torch.stack([attended[b][mask[b]].mean(0) for b in range(6)])
    assert torch.allclose(intra, expected / expected.norm(dim=-1, keepdim=True), atol=TOL)
    assert torch.allclose(intra.norm(dim=-1), torch.ones(6), atol=TOL)
    # eq. 10 reads the inputs
    assert torch.allclose(model._image_tower(batch)[0], model.embed_image(batch), atol=TOL)
    # padded regions and padded tokens change nothing anywhere
    noisy = dict(batch)
    noisy["regions"] = batch["regions"].masked_fill(~batch["region_mask"].bool()[..., None], 7.0)
    longer = {k: (torch.cat([v, torch.zeros_like(v[:, :3])], 1)
                  if k in ("input_ids", "attention_mask") else v)
              for k, v in noisy.items()}
    for a, b in ((model.image_states(batch), model.image_states(noisy)),
                 (model.text_states(batch), model.text_states(longer))):
        assert torch.allclose(a[2], b[2], atol=TOL)
    s_before = model.s2(model.image_states(batch), model.text_states(batch))
    s_after = model.s2(model.image_states(noisy), model.text_states(longer))
    assert torch.allclose(s_before, s_after, atol=TOL)


def test_inter_is_mean_over_each_side_of_the_joint_sequence(model, bench, tok):
    batch = pair_batch(bench["train"], tok, range(4))
    image, text = model.image_states(batch), model.text_states(batch)
    i_inter, t_inter = model.inter(image[0], image[1], text[0], text[1])
    for b in range(4):  # one pair at a time, without padding, by eq. 10-13
        r, t = image[0][b][image[1][b]], text[0][b][text[1][b]]
        h = model.cross(torch.cat([r, t])[None])[0]
        mean_r, mean_t = h[:len(r)].mean(0), h[len(r):].mean(0)
        assert torch.allclose(i_inter[b], mean_r / mean_r.norm(), atol=1e-4)
        assert torch.allclose(t_inter[b], mean_t / mean_t.norm(), atol=1e-4)


def test_bert_cross_reads_the_input_embeddings(bench, tok):
    """Eq. 10: without SCAN's inputs, BERT_cross's tokens are the input embeddings r_i, t_i (the
    ones eq. 6 and 8 read), not the towers' outputs."""
    torch.manual_seed(0)
    m = build_ubert(small_config(cross_towers="none"), bench["train"], tok).eval()
    batch = pair_batch(bench["train"], tok, range(3))
    tokens, mask, _ = m.text_states(batch)
    assert torch.allclose(tokens, m.embed_text(batch), atol=TOL)
    assert not torch.allclose(tokens, m.text_tower(m.embed_text(batch), mask), atol=TOL)
    regions, _, _ = m.image_states(batch)
    assert torch.allclose(regions, m.embed_image(batch), atol=TOL)


def test_pair_scores_and_l2_against_loops(model, bench, tok):
    batch = pair_batch(bench["train"], tok, range(5))
    image, text = model.image_states(batch), model.text_states(batch)
    scores = model.pair_scores(image, text)  # (5, 5)
    for i in range(5):
        for j in range(5):
            one = model.s2([s[i:i + 1] for s in image], [s[j:j + 1] for s in text])
            assert scores[i, j].item() == pytest.approx(one.item(), abs=1e-5)
    # L2 = eq. (L2) of §4.3 summed over i and j != i, with the hardest negatives after the warm-up
    cfg = small_config(sum_warmup_steps=2, max_violation=True)
    diag = scores.diag()
    summed = sum(max(0.0, cfg.margin + scores[i, j] - diag[i])
                 + max(0.0, cfg.margin + scores[j, i] - diag[i])
                 for i in range(5) for j in range(5) if j != i)
    with torch.no_grad():
        assert (cross_loss(cfg)(model, batch, step=0).item()
                == pytest.approx(float(summed), abs=1e-4))
        assert cross_loss(cfg)(model, batch, step=2).item() == pytest.approx(
        hinge_triplet_loss(scores, cfg.margin, max_violation=True).item(), abs=1e-5)


def test_config_checks(bench, tok, scan):
    with pytest.raises(ValueError, match="training"):
        UBERTConfig(training="both")
    with pytest.raises(ValueError, match="cross_towers"):
        UBERTConfig(cross_towers="bert")
    with pytest.raises(ValueError, match="needs the trained SCAN model"):
        build_ubert(small_config(), bench["train"], tok)
    with pytest.raises(ValueError, match="needs the trained SCAN model"):
        build_ubert(small_config(cross_towers="none"), bench["train"], tok, scan)
    assert build_ubert(small_config(cross_towers="none"), bench["train"], tok).scan is None


# --------------------------------------------------------------------- SCAN's reading in BERT_cross

def test_cross_tokens_carry_scans_reading_of_each_word_and_region(model, bench, tok):
    """cross_towers="scan": each word token BERT_cross reads gets cross_inputs["word"](SCAN's
    encoding of that word), each region token cross_inputs["region"](SCAN's encoding of it); [CLS],
    [SEP] and padding get nothing; the intra vectors (stage 1) do not change. Checked caption by
    caption against SCAN run on that caption alone."""
    batch = pair_batch(bench["test"], tok, [0, 5, 14])
    batch = {k: torch.cat([v, torch.full((3, 3), tok.pad_token_id if k == "input_ids" else 0)], 1)
             if k in ("input_ids", "attention_mask") else v
             for k, v in batch.items()}  # three padded columns more
    with torch.no_grad():
        tokens, mask, intra = model.text_states(batch)  # (3, T, H)
        base, _, base_intra = model._text_tower(batch)
        assert (torch.allclose(intra, base_intra, atol=TOL)
                and torch.allclose(model.encode_texts(batch), intra, atol=TOL))
        for b in range(3):
            n = int(batch["attention_mask"][b].sum())  # [CLS] w1 .. w(n-2) [SEP]
            words, _ = model.scan.encode_texts({k: batch[k][b:b + 1, :n]
                                                for k in ("input_ids", "attention_mask")})
            expected = base[b].clone()
            expected[1:n - 1] += model.cross_inputs["word"](words[0])
            assert torch.allclose(tokens[b], expected, atol=TOL)
        regions, real = model.scan.encode_images(batch)  # (3, M, E), (3, M)
        expected = (model._image_tower(batch)[0]
                    + model.cross_inputs["region"](regions) * real[..., None])
        assert torch.allclose(model.image_states(batch)[0], expected, atol=TOL)


def test_scan_copy_is_frozen_and_step_two_trains_only_bert_cross_and_its_inputs(bench, tok, scan):
    m = build_ubert(small_config(), bench["train"], tok, scan)
    assert m.scan is not scan
    assert all(torch.equal(a, b) for a, b in zip(m.scan.state_dict().values(),
                                                 scan.state_dict().values(), strict=True))
    # frozen from the start, joint training too
    assert not any(p.requires_grad for p in m.scan.parameters())
    m.freeze_towers().train()
    assert not m.scan.training and m.cross_inputs.training
    trained = {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}
    assert trained == {"cross", "cross_inputs"}
    batch = pair_batch(bench["train"], tok, range(4))
    m.pair_scores(m.image_states(batch), m.text_states(batch)).sum().backward()
    assert (m.cross_inputs["word"][0].weight.grad is not None
            and m.cross_inputs["region"][0].weight.grad is not None)


def test_scan_inputs_leave_the_towers_and_bert_cross_initial_weights_as_they_were(bench, tok, scan):
    """They are built last: with the same seed, a model with SCAN inputs starts from the same towers
    and BERT_cross as one without, so step 1 (built without them) and earlier runs are unchanged."""
    torch.manual_seed(3)
    with_scan = build_ubert(small_config(), bench["train"], tok, scan).state_dict()
    torch.manual_seed(3)
    without = build_ubert(small_config(cross_towers="none"), bench["train"], tok).state_dict()
    assert set(without) < set(with_scan)
    assert all(torch.equal(without[k], with_scan[k]) for k in without)
    assert tower_config(small_config()).cross_towers == "none"


# ----------------------------------------------------------------------------------------- training

def test_step_two_freezes_the_towers_bit_for_bit(bench, tok, tmp_path):
    cfg = small_config()
    towers_ckpt, ckpt = tmp_path / "towers.pt", tmp_path / "cross.pt"
    scan = untrained_scan(bench["train"], tok)
    model, histories = train_ubert(bench, tok, cfg, towers_checkpoint=towers_ckpt,
                                   checkpoint_path=ckpt, scan=scan, progress=False)
    assert set(histories) == {"towers", "cross"}
    towers = torch.load(towers_ckpt, map_location="cpu", weights_only=True)["model"]
    # step 1 has no SCAN inputs
    assert not any(k.startswith(("cross_inputs.", "scan.")) for k in towers)
    final = model.state_dict()
    fresh_cross = build_ubert(cfg, bench["train"], tok, scan).state_dict()
    assert all(torch.equal(final[k], v) for k, v in scan.state_dict().items()
               for k in [f"scan.{k}"])
    assert any(not torch.equal(final[k], fresh_cross[k]) for k in final
               if k.startswith("cross_inputs."))
    tower_keys = [k for k in final if is_tower_key(k)]
    assert tower_keys and all(torch.equal(final[k], towers[k]) for k in tower_keys)
    assert any(not torch.equal(final[k], fresh_cross[k]) for k in final if k.startswith("cross."))
    # the towers of step 1 do not depend on the cross fields
    assert (tower_config(dataclasses.replace(cfg, cross_layers=3, cross_lr=0.1, alpha=2.0))
            == tower_config(cfg))


def test_bert_txt_can_start_from_a_pretrained_bert(bench, minilm_folder):
    """text_encoder=MiniLM: t_i are BERT's embedding output, T_intra the unit mean of its last
    layer; step 1 trains it, step 2 freezes it with the other tower."""
    from transformers import AutoModel

    from course_lib.data.tokenizer import tokenizer_for

    name, folder = minilm_folder
    wordpieces = tokenizer_for(bench["train"], name=folder)
    config = small_config(text_encoder=name, hidden=384, heads=6, cross_towers="none")
    torch.manual_seed(0)
    model = build_ubert(config, bench["train"], wordpieces).eval()
    reference = AutoModel.from_pretrained(folder).eval()  # the same weights, loaded on their own
    texts = dict(wordpieces(bench["val"].captions[:4], padding=True, return_tensors="pt"))
    with torch.no_grad():
        tokens, mask, intra = model.text_states(texts)
        out = reference(**texts, output_hidden_states=True)
    expected = torch.nn.functional.normalize(masked_mean(out.last_hidden_state, mask), dim=-1)
    assert (torch.allclose(tokens, out.hidden_states[0], atol=1e-5)
            and torch.allclose(intra, expected, atol=1e-5))

    model.train()
    loss = tower_loss(config)(model, pair_batch(bench["train"], wordpieces, range(8)))
    loss.backward()
    assert model.text_tower.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    model.freeze_towers().train()
    assert (not model.text_tower.training
            and not any(p.requires_grad for p in model.text_tower.parameters()))

    with pytest.raises(ValueError, match=r"hidden=16.*UBERTConfig\(hidden=384\)"):
        build_ubert(small_config(text_encoder=name, cross_towers="none"),
                    bench["train"], wordpieces)
    # the word tokenizer's ids do not fit BERT's table
    with pytest.raises(ValueError, match="tokenizer_for"):
        build_ubert(config, bench["train"], build_word_tokenizer(bench["train"].captions))
    assert (UBERTMethod(config).stage(bench, wordpieces).reads["text_encoder"] == name
            and UBERTMethod(config).towers_stage(bench, wordpieces).reads["text_encoder"] == name)


def test_bert_txt_can_learn_at_a_fraction_of_the_rate(bench, minilm_folder):
    from course_lib.core.optimizer import param_groups
    from course_lib.data.tokenizer import tokenizer_for

    name, folder = minilm_folder
    wordpieces = tokenizer_for(bench["train"], name=folder)
    config = small_config(text_encoder=name, hidden=384, heads=6, cross_towers="none",
                          text_encoder_lr_scale=0.1)
    model = build_ubert(config, bench["train"], wordpieces)
    groups = param_groups(model, 0.01, 1e-3, config.lr_scales())
    slow = {id(p) for g in groups if g.get("lr") == pytest.approx(1e-4) for p in g["params"]}
    # BERT_txt alone, every weight of it
    assert slow == {id(p) for p in model.text_tower.parameters()}
    with pytest.raises(ValueError,
                       match=r"UBERTConfig\(text_encoder_lr_scale=0.1\).*set text_encoder"):
        small_config(text_encoder_lr_scale=0.1)


def test_joint_training_moves_every_part(bench, tok):
    from course_lib.core.settings import seed_everything

    cfg = small_config(training="joint")
    scan = untrained_scan(bench["train"], tok)
    seed_everything(cfg.seed)  # as train_ubert does before building the joint model
    before = build_ubert(cfg, bench["train"], tok, scan).state_dict()
    model, histories = train_ubert(bench, tok, cfg, scan=scan, progress=False)
    assert set(histories) == {"joint"} and {"l1", "l2"} <= set(histories["joint"][-1])
    after = model.state_dict()
    for part in ("image_tower.", "text_tower.", "cross.", "word.", "cross_inputs."):
        assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith(part)), part
    # SCAN stays frozen
    assert all(torch.equal(after[k], before[k]) for k in after if k.startswith("scan."))


def test_method_caches_towers_and_cross_separately(fitted, bench, tok):
    method, cache = fitted
    # SCAN trained first, cached beside the two steps
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 3 and names[0].startswith("scan-") and names[1].startswith("ubert-")
    assert names[2].startswith("ubert-towers-")
    # another L_c re-uses the towers: only a new cross checkpoint appears,
    # with the same tower weights
    towers_file = cache / names[2]
    stamp = towers_file.stat().st_mtime_ns
    deeper = smoke_method(small_config(cross_layers=2)).fit(bench, tok, cache_dir=cache)
    assert towers_file.stat().st_mtime_ns == stamp  # loaded, not trained and saved again
    assert len(list(cache.iterdir())) == 4
    assert torch.equal(deeper.model.image_tower.blocks[0].attn.qkv.weight,
                       method.model.image_tower.blocks[0].attn.qkv.weight)
    again = smoke_method(small_config()).fit(bench, tok, cache_dir=cache)  # loads all three
    assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(),
                                                 method.model.state_dict().values(), strict=True))


def test_towers_from_another_model_skip_step_one(fitted, bench, tok, tmp_path):
    method, _ = fitted
    # an empty cache: without towers_from this would train step 1 and save its checkpoint
    deeper = smoke_method(small_config(cross_layers=2), towers_from=method)
    deeper.fit(bench, tok, cache_dir=tmp_path)
    # and its SCAN's
    ubert_files = [p.name for p in tmp_path.iterdir() if p.name.startswith("ubert")]
    assert ubert_files == [deeper.checkpoint_path.name]  # no ubert-towers-* file
    mine, theirs = deeper.model.state_dict(), method.model.state_dict()
    tower_keys = [k for k in theirs if is_tower_key(k)]
    assert tower_keys and all(torch.equal(mine[k], theirs[k]) for k in tower_keys)
    assert deeper.history["towers"] is method.history["towers"] and len(deeper.history["cross"])
    assert all(not p.requires_grad for n, p in deeper.model.named_parameters()
               if not n.startswith(STEP_TWO_PARTS))


def test_towers_from_refuses_other_towers_and_an_unfitted_model(fitted, bench, tok, tmp_path):
    method, _ = fitted
    with pytest.raises(ValueError, match=r"lr \(0\.01 vs 0\.001\)"):
        smoke_method(small_config(lr=0.01), towers_from=method).fit(bench, tok, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="two-step"):
        smoke_method(small_config(training="joint"), towers_from=method).fit(bench, tok)
    with pytest.raises(RuntimeError, match="not fitted"):
        smoke_method(small_config(), towers_from=smoke_method(small_config())).fit(bench, tok)


def test_the_method_follows_its_scan_checkpoint_and_ships_with_it(fitted, bench, tok):
    """BERT_cross is trained on SCAN's reading, so another SCAN is another U-BERT file; the training
    planner sees SCAN as a model it needs; a shipped-style load rebuilds the SCAN copy untrained and
    takes its weights from U-BERT's own state."""
    method, _ = fitted
    assert method.stage(bench, tok).fingerprint["starts_from"] == [
        method.towers_stage(bench, tok).file_name, method.scan.stage(bench, tok).file_name]
    assert method.scan in own_models([method]) and method.scan in own_models([UBERTCascade(method)])
    other = UBERTMethod(small_config(),
                        scan=SCANMethod(SCANConfig.smoke(max_steps=4), progress=False))
    assert other.stage(bench, tok).file_name != method.stage(bench, tok).file_name
    none = UBERTMethod(small_config(cross_towers="none"))
    assert (none.scan is None
            and none.stage(bench, tok).fingerprint["starts_from"]
            == [none.towers_stage(bench, tok).file_name])
    rebuilt = method.build_model(bench, tok)
    rebuilt.load_state_dict(method.model.state_dict())
    split = bench["test"]
    images, texts = torch.arange(12) % split.n_images, torch.arange(12) * 7 % split.n_texts
    rebuilt.eval()
    states = compute_states(rebuilt, split, tok)
    assert torch.allclose(score_cached_pairs(rebuilt, states, images, texts),
                          method.score_pairs(split, images, texts), atol=1e-5)


# ---------------------------------------------------------------------------------------- retrieval

def test_cached_states_equal_the_uncached_path(fitted, bench, tok):
    method, _ = fitted
    model, split = method.model, bench["test"]
    states = compute_states(model, split, tok, batch_size=7)  # several blocks
    g = torch.Generator().manual_seed(0)
    texts = torch.randint(0, split.n_texts, (30,), generator=g)
    images = torch.randint(0, split.n_images, (30,), generator=g)
    cached = score_cached_pairs(model, states, images, texts, batch_size=8)
    batch = PairCollate(tok)([{**PairDataset(split)[int(t)],
                               **PairDataset(split).images.image_fields(int(i))}
                              for i, t in zip(images, texts, strict=True)])
    with torch.no_grad():
        direct = model.s2(model.image_states(batch), model.text_states(batch))
    assert torch.allclose(cached, direct, atol=1e-5)
    assert torch.allclose(method.score_pairs(split, images, texts), direct, atol=1e-5)
    # one query against K candidates, the query's states expanded rather than recomputed
    query = states.text([int(texts[0])])
    with torch.no_grad():
        k_scores = rescore_candidates(model, query, states.image(images[:10]))
    assert torch.allclose(k_scores, score_cached_pairs(model, states, images[:10],
                                                       texts[:1].repeat(10)), atol=1e-5)



def test_pairs_are_scored_in_blocks_of_like_caption_lengths():
    # lengths 3 1 2 1 3, blocks of 2: the two 1s, then 2 and the first 3, then the last 3
    blocks = length_blocks(torch.tensor([3, 1, 2, 1, 3]), 2)
    assert [b.tolist() for b in blocks] == [[1, 3], [2, 0], [4]]
    assert length_blocks(torch.zeros(0, dtype=torch.long), 4) == []


@torch.no_grad()
def test_cached_caption_states_equal_each_caption_encoded_alone(fitted, bench, tok):
    model, split = fitted[0].model, bench["test"]
    states = compute_states(model, split, tok, batch_size=7)  # batches of like lengths, re-ordered
    fields = text_fields(split.captions, tok, model.config.max_text_length)
    lengths = fields["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # captions of several lengths, so the order is tested
    for t in {int(lengths.argmin()), int(lengths.argmax()), 0, 5, split.n_texts - 1}:
        # (1, n): no padding
        alone = text_fields([split.captions[t]], tok, model.config.max_text_length)
        tokens, mask, intra = model.eval().text_states(alone)  # (1, n, H), (1, n), (1, H)
        n = tokens.shape[1]
        assert (states.text_mask[t].tolist()
                == [True] * n + [False] * (states.text_mask.shape[1] - n))
        torch.testing.assert_close(states.text_tokens[t, :n], tokens[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(states.text_intra[t], intra[0], atol=1e-5, rtol=1e-4)

def _recalls(method, split, direction, ks):
    queries = split.text_queries if direction == "t2i" else split.image_queries
    indices, scores = method.rank(split, direction, max(ks), queries)
    truth = ground_truth(split, direction, queries, indices)
    return recall_at_k(ranks_from_top_k(scores, truth), ks)


def test_cascade_reorders_only_the_top_k(fitted, bench):
    method, _ = fitted
    split = bench["test"]
    cascade = UBERTCascade(method, top_k=5, top_k_i2t=10)
    assert (cascade.pairs_per_query(split, "t2i") == 5
            and cascade.pairs_per_query(split, "i2t") == 10)
    for direction, K in (("t2i", 5), ("i2t", 10)):
        first, _ = method.rank(split, direction, 20)
        both, scores = cascade.rank(split, direction, 20)
        assert torch.equal(both[:, K:], first[:, K:])  # below K: stage 1's order
        assert torch.equal(both[:, :K].sort(1).values, first[:, :K].sort(1).values)  # same K items
        # the invariant R@k = stage-1 R@k for k >= K
        ks = tuple(k for k in (1, 5, 10, 20) if k >= K)
        assert _recalls(cascade, split, direction, ks) == _recalls(method, split, direction, ks)
        # inside the top K the order is s2's
        queries = split.text_queries if direction == "t2i" else split.image_queries
        q = torch.as_tensor(queries).repeat_interleave(K)
        pairs = (both[:, :K].reshape(-1), q) if direction == "t2i" else (q, both[:, :K].reshape(-1))
        s2 = method.score_pairs(split, *pairs).view(-1, K)
        assert torch.allclose(scores[:, :K], s2, atol=1e-5)
        assert bool((s2[:, :-1] >= s2[:, 1:] - 1e-6).all())


def test_query_fn_matches_rank(fitted, bench):
    method, _ = fitted
    split = bench["test"]
    cascade = UBERTCascade(method, top_k=TOP_K["t2i"])
    indices, _ = cascade.rank(split, "t2i", 10, queries=[3, 11])
    for row, caption in enumerate((3, 11)):
        assert np.array_equal(cascade.query_fn(split, caption, top_k=10)(), indices[row].numpy())


def test_image_query_fn_matches_rank(fitted, bench):
    method, _ = fitted
    split = bench["test"]
    cascade = UBERTCascade(method, top_k=5, top_k_i2t=12)
    indices, _ = cascade.rank(split, "i2t", 10, queries=[2, 7])
    for row, image in enumerate((2, 7)):
        assert np.array_equal(cascade.image_query_fn(split, image, top_k=10)(),
                              indices[row].numpy())


def test_sum_of_hinges_by_default(model, bench, tok):
    # max_violation=False (the default, module docstring of UBERTConfig):
    # every step sums every hinge
    batch = pair_batch(bench["train"], tok, range(5))
    cfg = small_config(max_violation=False)
    with torch.no_grad():
        scores = model.pair_scores(model.image_states(batch), model.text_states(batch))
        assert cross_loss(cfg)(model, batch, step=10_000).item() == pytest.approx(
            hinge_triplet_loss(scores, cfg.margin, max_violation=False).item(), abs=1e-5)


def test_stage_one_rank_from_cached_states_equals_the_towers(fitted, bench):
    from course_lib.methods.base import DualEncoderMethod

    method, _ = fitted
    split = bench["test"]
    for direction in ("t2i", "i2t"):
        cached, cached_scores = method.rank(split, direction, 10)
        # a fresh tower pass
        encoded, encoded_scores = DualEncoderMethod.rank(method, split, direction, 10)
        assert (torch.equal(cached, encoded)
                and torch.allclose(cached_scores, encoded_scores, atol=1e-5))
