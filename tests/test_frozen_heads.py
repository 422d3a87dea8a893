"""Light heads on frozen features (course_lib.methods.frozen_heads) and the real-data benchmark's pieces
(course_lib.real_benchmark), on a tiny random feature bench with the offline MiniLM as the text side.

Checked against independent computations: chance recall against counting every ranking of a tiny
gallery, the re-ranker against scoring its candidates one pair at a time, the online query paths
against the offline rankings, pooled grid boxes against hand-worked values.
"""

import itertools

import numpy as np
import pytest
import torch
from test_data_scripts import load_script

from course_lib.data.split import RetrievalSplit, concatenate
from course_lib.methods.frozen_heads.cross import CrossConfig, CrossHeadsMethod
from course_lib.methods.frozen_heads.dual import DualHeadsMethod, HeadsConfig, _keep
from course_lib.methods.frozen_heads.features import TextStates, image_tokens
from course_lib.methods.frozen_heads.rerank import RerankMethod
from course_lib.methods.frozen_heads.scan import SCANHeadsConfig, SCANHeadsMethod, SCANScorer
from course_lib.methods.frozen_heads.training import recalls
from course_lib.real_benchmark import chance_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
extract = load_script("extract_features")
WORDS = ["dog", "cat", "red", "ball", "grass", "runs", "jumps", "child", "water", "street"]


def tiny_split(name, n, seed, dim=24):
    rng = np.random.default_rng(seed)
    txt2img = np.repeat(np.arange(n), 5)
    split = RetrievalSplit(name=name, captions=[" ".join(rng.choice(WORDS, 4)) for _ in txt2img], txt2img=txt2img,
                           image_ids=[f"{name}{i}" for i in range(n)])
    split.regions = rng.standard_normal((n, 16, dim)).astype(np.float16)  # a 4 x 4 grid
    split.boxes = np.broadcast_to(extract.grid_boxes(4, 4), (n, 16, 7)).astype(np.float32)
    split.region_mask = np.ones((n, 16), dtype=bool)
    return split


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    bench = {"train": tiny_split("train", 12, 0), "val": tiny_split("val", 6, 1), "test": tiny_split("test", 6, 2)}
    bench["full"] = concatenate(list(bench.values()), "full", queries_from=bench["test"])
    text = TextStates()  # the offline MiniLM
    cache = tmp_path_factory.mktemp("checkpoints")
    dual = DualHeadsMethod("dual", HeadsConfig(steps=6, batch_size=6, hidden=32, embed_dim=16), progress=False)
    dual.fit(bench, text, cache)
    cross = CrossHeadsMethod("cross", CrossConfig(steps=4, batch_size=4, hidden=32, grid=2, mine_from=6, negatives=2),
                             dual, progress=False).fit(bench, text, cache)
    return bench, text, dual, cross, cache


def test_chance_matches_counting_every_ranking():
    split = RetrievalSplit(name="t", captions=["a"] * 6, txt2img=np.array([0, 0, 1, 1, 1, 2]), image_ids=list("abc"))
    got = chance_metrics(split, ks=(1, 2))
    for k in (1, 2):  # i2t: over every order of the 6 captions, is one of the image's own in the first k?
        hits = [np.mean([any(split.txt2img[t] == i for t in order[:k]) for order in itertools.permutations(range(6))])
                for i in range(3)]
        assert got[f"i2t_r{k}"] == pytest.approx(100 * np.mean(hits))
        assert got[f"t2i_r{k}"] == pytest.approx(100 * k / 3)


def test_keep_drops_only_real_positions_and_keeps_one_per_row():
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, False], [True, False, False]]).repeat(200, 1)
    kept = _keep(mask, 0.3)
    assert not (kept & ~mask).any() and kept.any(1).all()
    # the first real position: kept with p, or as the fallback when both of the row's were dropped
    assert float(kept[::2, 0].float().mean()) == pytest.approx(0.3 + 0.7 ** 2, abs=0.08)
    assert float(kept[::2, 1].float().mean()) == pytest.approx(0.3, abs=0.08)
    assert _keep(mask, 1.0) is mask


def test_pooled_grid_boxes_by_hand():
    split = tiny_split("s", 2, 0)
    regions, boxes = image_tokens(split, grid=2)
    assert regions.shape == (2, 4, 24) and boxes.shape == (4, 7)
    torch.testing.assert_close(regions[0, 0].float(), torch.from_numpy(split.regions[0]).float()
                               .view(4, 4, 24)[:2, :2].mean((0, 1)), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(boxes[3, :4].numpy(), [0.5, 0.5, 1.0, 1.0], atol=1e-6)  # the bottom-right cell


def test_fit_loads_its_checkpoint_and_keeps_the_best_val_point(fitted):
    bench, text, dual, _, cache = fitted
    again = DualHeadsMethod("dual", dual.config, progress=False).fit(bench, text, cache)
    torch.testing.assert_close(again.similarity(bench["test"]), dual.similarity(bench["test"]))
    assert dual.curve.best_step in dual.curve.step
    kept = dual.curve.val_r1[dual.curve.step.index(dual.curve.best_step)]
    assert kept == max(dual.curve.val_r1)
    assert recalls(dual, bench["val"])["t2i_r1"] == pytest.approx(kept)  # the weights kept are that point's


def test_reranker_equals_scoring_its_candidates_one_by_one(fitted):
    bench, _, dual, cross, _ = fitted
    test = bench["test"]
    rerank = RerankMethod("r", dual, cross, survivors=3, beta=0.5)
    indices, scores = rerank.rank(test, "t2i", 3, [0, 7])
    logits = (dual.similarity(test) * dual.model.log_scale.exp()).detach()  # (N, T)
    for row, q in enumerate([0, 7]):
        candidates = torch.topk(logits[:, q], 3).indices
        fused = {int(i): float(cross.score_pairs(test, [int(i)], [q])[0] + 0.5 * logits[i, q]) for i in candidates}
        want = sorted(fused, key=fused.get, reverse=True)
        assert indices[row].tolist() == want
        np.testing.assert_allclose(scores[row].numpy(), [fused[i] for i in want], rtol=1e-4, atol=1e-4)
    # beyond the survivors: the first stage's own order, below every survivor
    longer, longer_scores = rerank.rank(test, "t2i", 5, [0])
    assert longer[0, :3].tolist() == indices[0].tolist()
    assert longer[0, 3:].tolist() == torch.topk(logits[:, 0], 5).indices[3:].tolist()
    assert (longer_scores[0, 3:] < longer_scores[0, :3].min()).all()
    # every photo a survivor and beta 0: the cross-encoder's own ranking
    everything = RerankMethod("all", dual, cross, survivors=test.n_images)
    assert torch.equal(everything.rank(test, "t2i", 4, [3])[0], cross.rank(test, "t2i", 4, [3])[0])


def test_online_queries_answer_as_the_offline_rankings(fitted):
    bench, _, dual, cross, _ = fitted
    test = bench["test"]
    for method in (dual, cross, RerankMethod("r", dual, cross, survivors=4, beta=1.0)):
        offline = method.rank(test, "t2i", 3, [2])[0][0]
        assert method.query_fn(test, caption_index=2, top_k=3)().tolist() == offline.tolist(), method.name


def test_scratch_text_tower_learns_its_own_words(fitted):
    bench, _, _, _, _ = fitted
    scratch = TextStates(scratch=True, train_captions=bench["train"].captions)
    method = DualHeadsMethod("s", HeadsConfig(steps=3, batch_size=6, text_tower="scratch", hidden=16, embed_dim=8),
                             progress=False).fit(bench, scratch)
    ids, _ = scratch.of(bench["test"])
    assert ids.dtype == torch.long and method.model.words.num_embeddings == len(scratch.tokenizer)
    assert method.query_fn(bench["test"], 0, 2)().tolist() == method.rank(bench["test"], "t2i", 2, [0])[0][0].tolist()


@pytest.fixture(scope="module")
def scan_heads(fitted):
    bench, text, _, _, cache = fitted
    config = SCANHeadsConfig(steps=4, batch_size=6, embed_dim=16)
    return SCANHeadsMethod("scan", config, progress=False).fit(bench, text, cache)


def test_scan_pair_scores_equal_the_all_pairs_matrix(fitted, scan_heads):
    # two computations of SCAN's score: pair by pair through the attended vectors (func_attention), and every
    # image against every caption through the Gram-matrix shortcut of scan_similarity
    bench, text, _, _, _ = fitted
    test, model = bench["test"], scan_heads.model
    regions, boxes = image_tokens(test)
    states, mask = text.of(test)
    with torch.no_grad():
        cells, words = model.project_images(regions, boxes), model.project_texts(states, mask)
        matrix = model.similarity(words, mask, cells)  # (N, T)
        n, t = torch.meshgrid(torch.arange(test.n_images), torch.arange(test.n_texts), indexing="ij")
        pairs = model.score(words[t.flatten()], mask[t.flatten()], cells[n.flatten()]).view(matrix.shape)
    torch.testing.assert_close(pairs, matrix, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scan_heads.score_pairs(test, n.flatten(), t.flatten()).view(matrix.shape), matrix,
                               rtol=1e-4, atol=1e-4)


def test_scan_heads_rank_rerank_and_answer_online_as_offline(fitted, scan_heads):
    bench, text, dual, _, cache = fitted
    test = bench["test"]
    again = SCANHeadsMethod("scan", scan_heads.config, progress=False).fit(bench, text, cache)  # from its checkpoint
    assert again.curve.step == scan_heads.curve.step and again.curve.best_step == scan_heads.curve.best_step
    assert scan_heads.curve.val_r1[scan_heads.curve.step.index(scan_heads.curve.best_step)] == max(scan_heads.curve.val_r1)
    with torch.no_grad():
        regions, boxes = image_tokens(test)
        states, mask = text.of(test)
        model = scan_heads.model
        matrix = model.similarity(model.project_texts(states, mask), mask, model.project_images(regions, boxes))
    indices, _ = scan_heads.rank(test, "t2i", 3)
    assert torch.equal(indices, torch.topk(matrix.T, 3, dim=1).indices)
    for method in (scan_heads, RerankMethod("r", dual, scan_heads, survivors=4, beta=1.0)):
        offline = method.rank(test, "t2i", 3, [2])[0][0]
        assert method.query_fn(test, caption_index=2, top_k=3)().tolist() == offline.tolist(), method.name


def test_course_methods_on_real_features_get_the_switches_in_every_mode_and_sizes_by_default():
    from course_lib.core.offline_weights import MINILM_NAME
    from course_lib.methods.lightningdot.model import LightningDOTConfig
    from course_lib.real_benchmark import COURSE_METHODS, SMOKE_STEPS, course_methods, course_sizes

    smoke, default = course_sizes(MINILM_NAME, smoke=True), course_sizes(MINILM_NAME)
    for name, steps in SMOKE_STEPS.items():  # fewer steps in smoke mode, never a switch
        assert smoke[name].items() >= steps.items() and all(k.endswith(("steps", "batch_size")) for k in steps)
        smoke[name] = {k: v for k, v in smoke[name].items() if k not in steps}
    assert smoke["LightningDOTConfig"] == dict(text_encoder=MINILM_NAME, hidden=384, heads=6, layers=1, pretrain_steps=0)
    assert smoke["UBERTConfig"] == dict(text_encoder=MINILM_NAME, hidden=384, heads=6, tower_layers=1)
    assert smoke["HiVLPConfig"] == {"fresh_scenes": 0}  # no generator behind photos
    for name, fields in smoke.items():  # smoke shrinks only the sizes: every switch holds in both modes
        assert default[name].items() >= fields.items()
    assert default["LightningDOTConfig"]["finetune_steps"] < LightningDOTConfig().finetune_steps
    methods = course_methods(MINILM_NAME, smoke=True)
    assert [m.name for m in methods] == list(COURSE_METHODS)
    dual = next(m for m in methods if m.name == "lightningdot")
    assert dual.config == LightningDOTConfig.smoke(**smoke["LightningDOTConfig"])
    assert next(m for m in methods if m.name == "lightningdot+rerank@20").first is dual
    ubert = next(m for m in methods if m.name == "ubert-embed")
    assert ubert.config.text_encoder == MINILM_NAME and ubert.config.hidden == 384


def test_training_curves_read_heads_and_every_training_stage_of_a_course_method():
    from types import SimpleNamespace

    from course_lib.core.history import History
    from course_lib.methods.frozen_heads.training import Curve
    from course_lib.real_benchmark import training_curves

    def evaluated(*points):  # (step, val, train) -> a History with a training row between evaluations
        rows = []
        for step, val, train in points:
            rows += [{"step": step, "loss": 1.0},
                     {"step": step, "eval": True, "cpu_seconds": 1.0, "val_t2i_r1": val, "train_t2i_r1": train}]
        return History(rows)

    head = SimpleNamespace(name="probe", curve=Curve(step=[10, 20], val_r1=[5.0, 6.0], train_r1=[7.0, 9.0]))
    single = SimpleNamespace(name="vsepp", curve=None, history=evaluated((50, 1.0, 2.0), (100, 3.0, 4.0)))
    staged = SimpleNamespace(name="ubert", history={"towers": evaluated((5, 1.5, 2.5)), "cross": None})
    cascade = SimpleNamespace(name="ubert@20")  # trains nothing of its own
    untrained = SimpleNamespace(name="shipped", curve=Curve(), history=History([{"step": 1, "loss": 2.0}]))
    assert training_curves([head, single, staged, cascade, untrained]) == {
        "probe": {"step": [10, 20], "val_r1": [5.0, 6.0], "train_r1": [7.0, 9.0]},
        "vsepp": {"step": [50, 100], "val_r1": [1.0, 3.0], "train_r1": [2.0, 4.0]},
        "ubert (towers)": {"step": [5], "val_r1": [1.5], "train_r1": [2.5]},
    }


def test_token_mlp_head_pools_each_tokens_mlp_by_a_loop():
    from course_lib.methods.frozen_heads.dual import TokenHead

    torch.manual_seed(0)
    head = TokenHead("token-mlp", 6, 8, 4, dropout=0.0).eval()
    tokens, mask = torch.randn(3, 5, 6), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 0, 1, 0]]).bool()
    expected = []
    for row, real in zip(tokens, mask):
        kept = row[real]  # (n, D): the real tokens only
        expected.append(head.linear(kept.mean(0)) + torch.stack([head.mlp(t) for t in kept]).mean(0))
    assert torch.allclose(head(tokens, mask), torch.stack(expected), atol=1e-6)
    with pytest.raises(ValueError, match="'token-mlp'"):
        TokenHead("tokens", 6, 8, 4)
