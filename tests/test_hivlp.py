"""HiVLP: EOL widths and levels, gradient flow to every level, HRL against a loop over levels, the
coarse-to-fine search against a naive per-query loop (and equal to flat search when nothing is
pruned), the cascade method against its online path, and the cost model against
hand-worked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from course_lib.core.losses import VMLM
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.methods.hivlp.cost import (
    CostModel,
    cascade_cost,
    encoder_multiply_adds,
    query_multiply_adds,
)
from course_lib.methods.hivlp.method import (
    HiVLPCascade,
    HiVLPMethod,
    compute_states,
    hivlp_loss,
    last_level_loss,
)
from course_lib.methods.hivlp.model import (
    HiVLPConfig,
    build_hivlp,
    grid_boxes,
    hrl_loss,
    level_layers,
)
from course_lib.methods.hivlp.search import (
    coarse_to_fine,
    coarse_to_fine_one,
    rescore,
    select_top_k,
)

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")
# a pixel stem batch
BENCH_SIZES = dict(n_train=120, n_val=20, n_test=24, n_pretrain=128, n_compositional=1)


def small_config(**kw) -> HiVLPConfig:
    return HiVLPConfig(**{"hidden": 16, "image_layers": 3, "text_layers": 3, "heads": 2,
                          "eol_widths": (4, 8, 16), "batch_size": 16, "max_steps": 4,
                          "stem_steps": 2, "dropout": 0.0, "fresh_scenes": 8, **kw})


def pair_batch(split, tokenizer, rows, modality="pixels"):
    return PairCollate(tokenizer)([PairDataset(split, modality=modality)[t] for t in rows])


@pytest.fixture(scope="module")
def fitted(bench, tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hivlp")
    return HiVLPMethod(small_config(), progress=False).fit(bench, tok, cache_dir=cache)


# ---------------------------------------------------------------------------------------- the model

def test_level_layers_are_evenly_spaced_and_end_at_the_top():
    assert level_layers(12, 3) == [4, 8, 12]  # the paper's ViT
    assert level_layers(6, 3) == [2, 4, 6]  # the paper's text tower
    assert level_layers(3, 3) == [1, 2, 3]
    assert level_layers(4, 1) == [4]
    assert level_layers(1, 3) == [1, 1, 1]  # our text tower: one block feeds every level
    assert level_layers(2, 3) == [1, 1, 2]
    with pytest.raises(ValueError):
        level_layers(0, 3)


def test_config_checks():
    with pytest.raises(ValueError, match="non-decreasing"):
        HiVLPConfig(eol_widths=(64, 32, 16))
    with pytest.raises(ValueError, match="pool"):
        HiVLPConfig(pool="max")
    with pytest.raises(ValueError, match="image_input"):
        HiVLPConfig(image_input="grid")
    with pytest.raises(ValueError, match="fresh_scenes"):
        HiVLPConfig(fresh_scenes=-1)
    with pytest.raises(ValueError, match="at least one block"):
        HiVLPConfig(text_layers=0)
    with pytest.raises(ValueError, match="stem='patch'"):
        # a timm backbone brings its own patch embedding
        HiVLPConfig(backbone="vit_base_patch16_224")
    HiVLPConfig(backbone="vit_base_patch16_224", stem="patch")


def naive_pool(states: torch.Tensor, real: torch.Tensor, pool: str) -> torch.Tensor:
    """A row-by-row loop: the global token (position 0), or the plain mean of the real positions."""
    if pool == "cls":
        return states[:, 0]
    return torch.stack([states[b][real[b].bool()].mean(0) for b in range(states.shape[0])])


@pytest.mark.parametrize("pool", ["mean", "cls"])
@pytest.mark.parametrize("image_input", ["pixels", "regions"])
def test_eol_widths_grow_and_read_the_right_blocks(bench, tok, image_input, pool):
    torch.manual_seed(0)
    config = small_config(image_input=image_input, image_layers=6, pool=pool)
    model = build_hivlp(config, bench["train"], tok).eval()
    batch = pair_batch(bench["train"], tok, range(5), image_input)
    images, texts = model(batch)
    assert [tuple(x.shape) for x in images] == [(5, 4), (5, 8), (5, 16)]
    assert [tuple(x.shape) for x in texts] == [(5, 4), (5, 8), (5, 16)]
    assert model.image_at == [2, 4, 6] and model.text_at == [1, 2, 3]
    # level l is EOL_l of block image_at[l]'s global token (position 0) or
    # token mean, recomputed by hand
    states = model.image_tower(batch)
    assert len(states) == 6
    n_tokens = states[0].shape[1]
    # [IMG] and the unpadded regions; some images here have padded slots
    if image_input == "regions":
        real = torch.cat([torch.ones(5, 1), batch["region_mask"].float()], 1)
        assert not real.bool().all()
    else:
        real = torch.ones(5, n_tokens)
    for level, block in enumerate(model.image_at):
        pooled = naive_pool(states[block - 1], real, pool)
        torch.testing.assert_close(images[level], model.image_eols[level](pooled), atol=TOL, rtol=0)
    text_states = model.text_tower(batch, return_layers=True).layers
    for level, block in enumerate(model.text_at):
        pooled = naive_pool(text_states[block - 1], batch["attention_mask"], pool)
        torch.testing.assert_close(texts[level], model.text_eols[level](pooled), atol=TOL, rtol=0)
    torch.testing.assert_close(model.encode_images(batch), images[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(model.encode_texts(batch), texts[-1], atol=TOL, rtol=0)


def test_hrl_against_a_loop_over_levels():
    torch.manual_seed(1)
    B, widths = 5, (2, 3, 4)
    images = [torch.randn(B, w) for w in widths]
    texts = [torch.randn(B, w) for w in widths]
    expected = 0.0
    for i_l, t_l in zip(images, texts, strict=True):  # eq. 6-7 per level by hand, eq. 8 sums them
        # S[i][j], image i, text j
        s = [[float(i_l[i] @ t_l[j]) for j in range(B)] for i in range(B)]
        t2v = -sum(s[j][j] - math.log(sum(math.exp(s[k][j]) for k in range(B)))
                   for j in range(B)) / B
        v2t = -sum(s[i][i] - math.log(sum(math.exp(s[i][k]) for k in range(B)))
                   for i in range(B)) / B
        expected += (t2v + v2t) / 2
    assert abs(float(hrl_loss(images, texts)) - expected) < 1e-4


def test_model_loss_is_hrl_plus_lrm_and_logs_every_level(bench, tok):
    torch.manual_seed(0)
    # eval: no dropout
    model = build_hivlp(small_config(lrm_weight=1.0), bench["train"], tok).eval()
    batch = pair_batch(bench["train"], tok, range(8))
    out = model.loss(batch)
    torch.testing.assert_close(out["hrl"], hrl_loss(*model(batch)), atol=TOL, rtol=0)
    assert set(out) >= {"loss", "hrl", "lrm", "rl_1", "rl_2", "rl_3"}
    torch.testing.assert_close(out["loss"], out["hrl"] + out["lrm"], atol=TOL, rtol=0)
    assert isinstance(model.vmlm, VMLM)  # LightningDOT's VMLM reused (eq. 4)
    # lesson 05's ablation: the last level's L_RL alone, every level's logged as in eq. 8's loss
    last = build_hivlp(small_config(lrm_weight=0.0), bench["train"], tok).eval()
    out, full = last_level_loss(last, batch), last.loss(batch)
    torch.testing.assert_close(out["loss"], full["rl_3"], atol=TOL, rtol=0)
    assert all(torch.equal(out[f"rl_{level}"], full[f"rl_{level}"]) for level in (1, 2, 3))


def _grads(model, batch, loss_fn=hivlp_loss):
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch)["loss"].backward()
    return model


def test_gradient_reaches_every_level_and_only_trained_ones(bench, tok):
    batch = pair_batch(bench["train"], tok, range(8))
    torch.manual_seed(0)
    model = _grads(build_hivlp(small_config(lrm_weight=0.0), bench["train"], tok), batch)
    for eols in (model.image_eols, model.text_eols):
        for eol in eols:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in eol.parameters())
    # the default: the frozen pixel stem's grid under the region transformer
    tower = model.image_tower
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in tower.encoder.transformer.parameters())
    # frozen: no gradient, no update
    assert all(p.grad is None for p in tower.backbone.parameters())
    torch.manual_seed(0)
    vit = _grads(build_hivlp(small_config(stem="patch", lrm_weight=0.0),
                             bench["train"], tok), batch)
    assert vit.image_tower.vit.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    torch.manual_seed(0)
    last = _grads(build_hivlp(small_config(lrm_weight=0.0), bench["train"], tok), batch,
                  last_level_loss)
    for eols in (last.image_eols, last.text_eols):  # the ablation: only the last EOL learns
        assert all(p.grad is None for eol in eols[:-1] for p in eol.parameters())
        assert all(p.grad.abs().sum() > 0 for p in eols[-1].parameters())


def test_a_method_with_another_loss_trains_with_it_under_its_own_name(bench, tok, tmp_path):
    """Lesson 05 builds its "last level only" ablation from library parts: a HiVLPMethod whose
    loss_fn is last_level_loss and whose checkpoint_prefix is its own. It trains with that loss (the
    first EOLs keep their initial weights) and is cached apart from the eq. 8 model of the same
    config."""

    class LastLevelOnly(HiVLPMethod):
        checkpoint_prefix = "hivlp-last-level"
        loss_fn = staticmethod(last_level_loss)

    config = small_config(image_input="regions", lrm_weight=0.0, max_steps=3)
    last = LastLevelOnly(config, progress=False).fit(bench, tok, tmp_path)
    every = HiVLPMethod(config, progress=False)
    assert last.checkpoint_path.name != every.stage(bench, tok).file_name
    torch.manual_seed(config.seed)
    initial = build_hivlp(config, bench["train"], tok)  # train_hivlp's seed: its first weights
    for eols, start in ((last.model.image_eols, initial.image_eols),
                        (last.model.text_eols, initial.text_eols)):
        for level in range(2):
            assert all(torch.equal(a, b) for a, b in zip(eols[level].state_dict().values(),
                                                         start[level].state_dict().values(),
                                                         strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(eols[2].state_dict().values(),
                                                         start[2].state_dict().values(),
                                                         strict=True))


# ----------------------------------------------------------------------------------- coarse to fine

def _naive_cascade(gallery, query, survivors, top_k):
    """A query at a time, Python sorts: keep survivors[level] per level, then order by the last."""
    out = []
    for q in range(len(query[0])):
        kept = list(range(len(gallery[0])))
        for level, keep in enumerate(list(survivors) + [top_k]):
            scores = {g: float(gallery[level][g] @ query[level][q]) for g in kept}
            kept = sorted(kept, key=lambda g: -scores[g])[:keep]
        out.append(kept)
    return out


def test_coarse_to_fine_against_a_naive_loop():
    torch.manual_seed(2)
    widths, G, Q = (2, 4, 8), 60, 7
    gallery = [torch.randn(G, w) for w in widths]
    query = [torch.randn(Q, w) for w in widths]
    indices, scores = coarse_to_fine(gallery, query, survivors=(20, 6), top_k=4)
    assert indices.tolist() == _naive_cascade(gallery, query, (20, 6), 4)
    expected = torch.stack([gallery[2][indices[q]] @ query[2][q] for q in range(Q)])
    torch.testing.assert_close(scores, expected, atol=TOL, rtol=0)
    # the cascade really prunes: level 1 alone drops items that the last level would rank first
    flat = torch.topk(query[2] @ gallery[2].T, 4, dim=1).indices
    assert not torch.equal(flat, indices)


def test_nothing_pruned_is_flat_search():
    torch.manual_seed(3)
    widths, G = (2, 4, 8), 50
    gallery = [torch.randn(G, w) for w in widths]
    query = [torch.randn(5, w) for w in widths]
    indices, scores = coarse_to_fine(gallery, query, survivors=(G, G), top_k=10)
    flat = torch.topk(query[2] @ gallery[2].T, 10, dim=1)
    assert torch.equal(indices, flat.indices)
    torch.testing.assert_close(scores, flat.values, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="survivor"):
        coarse_to_fine(gallery, query, survivors=(10,), top_k=5)


@pytest.mark.parametrize("survivors", [(20, 6), (60, 6), (20, 20), (60, 60)])
def test_the_online_search_of_one_query_equals_coarse_to_fine(survivors):
    """coarse_to_fine_one (numpy, one query: the online path) against coarse_to_fine and the naive
    loop, with levels that prune and levels that keep all (skipped); one level alone is a
    flat search."""
    torch.manual_seed(4)
    widths, G, Q = (2, 4, 8), 60, 6
    gallery = [torch.randn(G, w) for w in widths]
    query = [torch.randn(Q, w) for w in widths]
    batched = coarse_to_fine(gallery, query, survivors=survivors, top_k=4)[0]
    assert batched.tolist() == _naive_cascade(gallery, query, survivors, 4)
    as_numpy = [g.numpy() for g in gallery]
    for q in range(Q):
        one = coarse_to_fine_one(as_numpy, [x[q].numpy() for x in query], survivors, top_k=4)
        assert one.tolist() == batched[q].tolist()
    alone = coarse_to_fine_one(as_numpy[2:], [query[2][0].numpy()], (), top_k=5)
    assert alone.tolist() == torch.topk(gallery[2] @ query[2][0], 5).indices.tolist()
    with pytest.raises(ValueError, match="survivor"):
        coarse_to_fine_one(as_numpy, [x[0].numpy() for x in query], (10,), top_k=5)


def test_rescore_against_a_loop_one_query_and_many():
    torch.manual_seed(5)
    gallery = torch.randn(40, 8)
    for Q in (1, 3):
        query, indices = torch.randn(Q, 8), torch.randint(0, 40, (Q, 12))
        expected = torch.tensor([[float(gallery[indices[q, m]] @ query[q]) for m in range(12)]
                                 for q in range(Q)])
        torch.testing.assert_close(rescore(gallery, query, indices), expected, atol=TOL, rtol=0)


class _NeverScored:
    """A gallery level that fails if anything scores it (len() still works)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __matmul__(self, other):
        raise AssertionError("a level that keeps every candidate was scored")

    __getitem__ = __matmul__


def test_levels_that_keep_everything_are_skipped_with_the_same_answer():
    torch.manual_seed(4)
    widths, G, Q = (2, 4, 8), 50, 6
    gallery = [torch.randn(G, w) for w in widths]
    query = [torch.randn(Q, w) for w in widths]
    # level 1 keeps all 50 (the paper's N2 = 1,000 on a 1k gallery): never scored, answer unchanged
    expected = _naive_cascade(gallery, query, (G, 6), 4)
    indices, scores = coarse_to_fine([_NeverScored(G)] + gallery[1:], query,
                                     survivors=(G, 6), top_k=4)
    assert indices.tolist() == expected
    torch.testing.assert_close(scores, torch.stack([gallery[2][indices[q]] @ query[2][q]
                                                    for q in range(Q)]),
                               atol=TOL, rtol=0)
    # a middle level that keeps all the survivors of the one before: skipped too
    expected = _naive_cascade(gallery, query, (20, 20), 4)
    indices, _ = coarse_to_fine([gallery[0], _NeverScored(G), gallery[2]], query,
                                survivors=(20, 20), top_k=4)
    assert indices.tolist() == expected


def assert_same_ranking(indices, scores, expected, expected_scores):
    """The same top-k lists with the same scores, up to the order of items whose scores tie within
    TOL: two paths summing the same dot product in another order may swap a near-tie (a
    smoke-trained model scores many candidates alike)."""
    torch.testing.assert_close(scores.float(), expected_scores.float(), atol=TOL, rtol=0)
    # (Q, k - 1) a tie with the next item
    gaps = (expected_scores[:, 1:] - expected_scores[:, :-1]).abs() < TOL
    tied = torch.zeros_like(indices, dtype=torch.bool)
    tied[:, 1:] |= gaps
    tied[:, :-1] |= gaps
    assert not ((indices != expected) & ~tied).any(), "the lists differ where no scores tie"


def test_cascade_method_matches_coarse_to_fine_and_query_fn(fitted, bench, tok):
    test = bench["test"]
    cascade = HiVLPCascade(fitted, survivors=(30, 10))
    states = fitted.states(test)
    indices, scores = cascade.rank(test, "t2i", 10)  # through the generic Cascade (Method API)
    queries = torch.as_tensor(test.text_queries, dtype=torch.long)
    expected, expected_scores = coarse_to_fine(states.image,
                                               [t[queries] for t in states.text], (30, 10), 10)
    assert_same_ranking(indices, scores, expected, expected_scores)
    for row, caption in enumerate(test.text_queries[:3]):  # the online path gives the same list
        online = torch.as_tensor(cascade.query_fn(test, int(caption), top_k=5)())
        online_scores = states.image[-1][online] @ states.text[-1][int(caption)]
        assert_same_ranking(online[None], online_scores[None], expected[row:row + 1, :5],
                            expected_scores[row:row + 1, :5])
    # the other direction: captions of the split searched by images
    i2t, i2t_scores = cascade.rank(test, "i2t", 5)
    images = torch.as_tensor(test.image_queries, dtype=torch.long)
    image_queries = [v[images] for v in states.image]
    expected_i2t, expected_i2t_scores = coarse_to_fine(states.text, image_queries, (30, 10), 5)
    assert_same_ranking(i2t, i2t_scores, expected_i2t, expected_i2t_scores)


def test_levels_count_no_cross_attention_pairs(fitted, bench):
    from course_lib.methods.rerank import Cascade

    test = bench["test"]
    assert HiVLPCascade(fitted, survivors=(30, 10)).pairs_per_query(test, "t2i") == 0
    # any stage without dot_product counts its survivors: here a stand-in
    reranker = fitted.level(2)
    levels = [fitted.level(k) for k in range(3)]
    plain = type("Pairwise", (), {"name": "pairwise", "score_pairs": reranker.score_pairs})()
    assert Cascade(levels + [plain], [30, 10, 5]).pairs_per_query(test, "t2i") == 5


def test_cached_states_equal_a_fresh_pass(fitted, bench, tok):
    test = bench["test"]
    states = compute_states(fitted.model, test, tok, batch_size=7)  # other batch boundaries
    cached = fitted.states(test)
    for fresh, kept in zip(states.image + states.text, cached.image + cached.text, strict=True):
        torch.testing.assert_close(fresh, kept, atol=TOL, rtol=0)
    flat, _ = fitted.rank(test, "t2i", 5)
    query_states = cached.text[-1][torch.as_tensor(test.text_queries)]
    expected = torch.topk(query_states @ cached.image[-1].T, 5).indices
    assert torch.equal(flat, expected)
    level1 = fitted.level(0)
    before = fitted.model
    # the parent's model, as it is
    assert level1.fit(bench, tok, fitted.checkpoint_path.parent) is level1
    assert level1.model is before and fitted.model is before and not hasattr(level1, "train")
    pairs = level1.score_pairs(test, np.array([0, 1, 2]), np.array([4, 4, 0]))
    torch.testing.assert_close(pairs,
                               (cached.image[0][[0, 1, 2]] * cached.text[0][[4, 4, 0]]).sum(-1))


def test_checkpoint_is_loaded_not_retrained(fitted, bench, tok):
    cache = fitted.checkpoint_path.parent
    stamp = fitted.checkpoint_path.stat().st_mtime_ns
    again = HiVLPMethod(small_config(), progress=False).fit(bench, tok, cache_dir=cache)
    assert fitted.checkpoint_path.stat().st_mtime_ns == stamp
    assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(),
                                                 fitted.model.state_dict().values(), strict=True))


# --------------------------------------------------------------------------------------- cost model

def test_cost_model_reproduces_the_papers_worked_example():
    """§3.4: N = 10^9, N2 = 10^5, N3 = 100, d = 768 / 128 / 300, t_e = 10^3: the paper says "about
    7e11 vs 1e11, ~7x"; exactly 12e3 + 7.68e11 vs 4e3 + 1.28e11 + 3e7 + 76,800 = 6.0x."""
    cost = cascade_cost(10**9, survivors=(10**5, 100))
    assert cost["flat"] == 12e3 + 768e9
    assert cost["cascade"] == 4e3 + 128e9 + 300e5 + 100 * 768
    assert abs(cost["speedup"] - 5.998) < 1e-3


def test_cost_model_by_hand_and_encoder_bound():
    model = CostModel(n_layers=3, level_layers=(1, 2, 3), widths=(2, 4, 8), t_e=10)
    # flat: 3 blocks + 100 * 8; cascade: 1 block, max(1 block, 100*2), max(1 block, 10*4), 5*8
    assert model.flat(100) == 30 + 800
    assert model.cascade([100, 10, 5]) == 10 + 200 + 40 + 40
    # a tiny gallery: the encoder blocks dominate each max()
    assert model.cascade([3, 2, 1]) == 10 + 10 + 10 + 8
    assert cascade_cost(5, survivors=(1000, 100), model=model)["candidates"] == [5, 5, 5]


def test_multiply_adds_by_hand():
    # 1 block, 2 tokens of width 2: projections 4*2*4 = 32, attention 2*4*2 = 16, MLP 8*2*4 = 64
    assert encoder_multiply_adds(tokens=2, hidden=2, layers=1) == 32 + 16 + 64
    count = query_multiply_adds(100, tokens=2, hidden=2, layers=1, widths=(1, 2), survivors=(10,))
    eols = (4 + 2) + (4 + 4)
    assert count["encoder"] == 112 + eols
    assert count["flat_similarity"] == 200 and count["cascade_similarity"] == 100 + 20


# ----------------------------------------------------------------------------- the exercise checker

def _loop_hrl(images, texts):
    """L_HRL written with per-level Python loops over the batch (an independent reference)."""
    total = 0.0
    for i_l, t_l in zip(images, texts, strict=True):
        s = i_l @ t_l.T  # (B, B)
        B = len(s)
        t2v = sum(-torch.log_softmax(s[:, j], 0)[j] for j in range(B)) / B
        v2t = sum(-torch.log_softmax(s[i], 0)[i] for i in range(B)) / B
        total = total + (t2v + v2t) / 2
    return total


def test_hrl_checker_passes_a_correct_answer_and_names_mistakes():
    import torch.nn.functional as F

    from course_lib.core.losses import contrastive_loss
    from course_lib.exercises.errors import ExerciseError
    from course_lib.exercises.hivlp import check_hrl_loss

    check_hrl_loss(hrl_loss)
    check_hrl_loss(_loop_hrl)
    wrong = {
        "averaged": lambda im, tx: sum(contrastive_loss(i @ t.T)
                                       for i, t in zip(im, tx, strict=True)) / len(im),
        "last level": lambda im, tx: contrastive_loss(im[-1] @ tx[-1].T),
        "text-to-image": lambda im, tx: sum(F.cross_entropy((i @ t.T).T, torch.arange(len(i)))
                                            for i, t in zip(im, tx, strict=True)),
        "normalised": lambda im, tx: sum(contrastive_loss(F.normalize(i, dim=-1)
                                                          @ F.normalize(t, dim=-1).T)
                                         for i, t in zip(im, tx, strict=True)),
        "gradient": lambda im, tx: hrl_loss(im, tx).detach(),
    }
    for expected, fn in wrong.items():
        with pytest.raises(ExerciseError, match=expected):
            check_hrl_loss(fn)


@pytest.mark.parametrize("n, k", [(50, 5), (40_000, 10), (200_000, 1000), (200_000, 7)])
def test_select_top_k_is_topk(n, k):
    torch.manual_seed(n + k)
    scores = torch.randn(1, n)
    values, indices = select_top_k(scores, k)
    expected = torch.topk(scores, k, dim=1)
    assert torch.equal(indices, expected.indices) and torch.equal(values, expected.values)
    # a row whose top scores are all tied above the rest still gives k of them
    tied = torch.zeros(1, n)
    tied[0, :3 * k] = 1.0
    values, indices = select_top_k(tied, k)
    assert values.shape == (1, k) and bool((values == 1.0).all())
    several = torch.randn(3, n)  # more than one query: torch.topk itself
    assert torch.equal(select_top_k(several, k)[1], torch.topk(several, k, dim=1).indices)


def test_tiled_levels_and_similarity_times():
    from course_lib.core.tiling import tile_rows
    from course_lib.studies.hivlp_cascade import similarity_times

    torch.manual_seed(4)
    levels = [torch.randn(30, w) for w in (2, 4, 8)]
    tiled = [tile_rows(level, 100, noise=0.1, seed=i) for i, level in enumerate(levels)]
    assert [tuple(t.shape) for t in tiled] == [(100, 2), (100, 4), (100, 8)]
    for level, big in zip(levels, tiled, strict=True):
        assert torch.equal(big[:30], level)  # the originals first, untouched
        moved = (big[30:60] - level).abs()
        assert 0 < moved.max() < 1.0  # copies moved a little
    query = [torch.randn(1, w) for w in (2, 4, 8)]
    times = similarity_times(tiled, query, survivors=(100, 100), top_k=5, repeats=2, warmup=0)
    assert times["overlap"] == 1.0  # nothing pruned: the cascade is flat search
    assert times["flat_ms"] >= 0 and times["cascade_ms"] >= 0 and times["n"] == 100


def test_cascade_notes_name_the_towers():
    # docs/results.md's methods list reads these notes: hivlp and
    # hivlp-regions must not read the same
    pixels = HiVLPCascade(HiVLPMethod(small_config(), progress=False))
    regions = HiVLPCascade(HiVLPMethod(small_config(image_input="regions"), progress=False),
                           name="hivlp-regions")
    assert ("pixel stem" in pixels.notes and "region tower" in regions.notes
            and pixels.notes != regions.notes)
    assert "ViT" in HiVLPCascade(HiVLPMethod(small_config(stem="patch"), progress=False)).notes


# ---------------------------------------------------------------------------- the pixel stem's grid

def test_grid_boxes_by_hand():
    boxes = grid_boxes(2).numpy()  # (x1, y1, x2, y2, w, h, area), row by row
    expected = [[0, 0, .5, .5, .5, .5, .25], [.5, 0, 1, .5, .5, .5, .25],
                [0, .5, .5, 1, .5, .5, .25], [.5, .5, 1, 1, .5, .5, .25]]
    np.testing.assert_allclose(boxes, expected, atol=1e-7)
    assert grid_boxes(4).shape == (16, 7)


def test_stem_grid_tower_reads_the_stem_map_as_grid_regions(bench, tok):
    torch.manual_seed(0)
    model = build_hivlp(small_config(), bench["train"], tok).eval()
    tower = model.image_tower
    batch = pair_batch(bench["train"], tok, range(3))
    grid = tower.backbone(batch["pixels"])[-1]  # (3, C, 4, 4)
    # cell by cell, by hand
    tokens = torch.stack([grid[:, :, r, c] for r in range(4) for c in range(4)], dim=1)
    regions = {"regions": tokens, "boxes": grid_boxes(4).expand(3, -1, -1),
               "region_mask": torch.ones(3, 16, dtype=torch.bool)}
    expected = tower.encoder(regions, return_layers=True).layers
    states = tower(batch)
    assert len(states) == 3 and tuple(states[-1].shape) == (3, 1 + 16, 16)
    for got, want in zip(states, expected, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    model.train()
    # BatchNorm keeps the stem's statistics
    assert not tower.backbone.training and tower.encoder.training


def test_training_on_the_stem_grid_computed_once_equals_training_on_pixels(bench, tok):
    from course_lib.data.synthetic import with_fresh_scenes
    from course_lib.methods.hivlp.method import with_stem_grid

    torch.manual_seed(0)
    # (dropout 0: two passes agree)
    model = build_hivlp(small_config(), bench["train"], tok).train()
    tower = model.image_tower
    split = with_fresh_scenes(bench["train"], 5)
    cached = with_stem_grid(split, tower, batch_size=7)  # batches that do not divide the split
    assert cached.n_images == split.n_images and cached.captions == split.captions
    assert cached.regions.shape == (split.n_images, 16, tower.backbone.out_dim)
    rows = [0, 3, len(split.captions) - 1]  # the last caption is a fresh scene's
    pixels = pair_batch(split, tok, rows)
    grid = tower.backbone.eval()(pixels["pixels"])[-1]  # (3, C, 4, 4), by hand: cell by cell
    by_hand = torch.stack([grid[:, :, r, c] for r in range(4) for c in range(4)], dim=1)
    images = split.txt2img[rows]
    torch.testing.assert_close(torch.from_numpy(cached.regions[images]), by_hand, atol=TOL, rtol=0)
    torch.testing.assert_close(torch.from_numpy(np.asarray(cached.boxes[images])),
                               grid_boxes(4).float().expand(3, -1, -1), atol=0, rtol=0)
    assert cached.region_mask.all()
    model.train()  # the frozen stem stays in eval mode: its tokens are the cached ones
    from_pixels = model.loss(pixels)
    from_grid = model.loss(pair_batch(cached, tok, rows, modality="regions"))
    for key in ("loss", "rl_1", "rl_2", "rl_3"):
        torch.testing.assert_close(from_grid[key], from_pixels[key], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="16 per image"):
        tower({"regions": torch.zeros(2, 5, tower.backbone.out_dim)})


def test_grid_boxes_are_built_once_and_never_saved(bench, tok):
    tower = build_hivlp(small_config(), bench["train"], tok).image_tower
    torch.testing.assert_close(tower.boxes, grid_boxes(4).float(), atol=0, rtol=0)
    # shipped files unchanged
    assert "boxes" in dict(tower.named_buffers()) and "boxes" not in tower.state_dict()


def test_hivlp_stem_reads_each_cell_in_place_by_default():
    from course_lib.methods.fast_slow.model import FastConfig
    from course_lib.methods.pixel_stem import PixelStemConfig, stem_config

    assert stem_config(HiVLPConfig()) == PixelStemConfig(head_pool="cells", max_steps=400, seed=0)
    # one stem file for both, trained once
    assert stem_config(FastConfig()) == stem_config(HiVLPConfig())
    flat = stem_config(HiVLPConfig(stem_head_pool="flatten", stem_steps=7, seed=3))
    assert ((flat.head_pool, flat.max_steps, flat.seed, flat.channels)
            == ("flatten", 7, 3, PixelStemConfig().channels))
    fast = FastConfig(channels=(8, 16, 32), stem_head_pool="cells")
    assert stem_config(fast).channels == (8, 16, 32) and stem_config(fast).head_pool == "cells"
    with pytest.raises(ValueError, match="stem_head_pool"):
        HiVLPConfig(stem_head_pool="mean")
    with pytest.raises(ValueError, match="stem_head_pool"):
        FastConfig(stem_head_pool="mean")


def test_training_starts_from_the_cached_pixel_stem_and_keeps_it_frozen(bench, tok, tmp_path):
    from course_lib.methods.hivlp.method import train_hivlp
    from course_lib.methods.pixel_stem import (
        pixel_stem_stage,
        stem_config,
        train_pixel_stem,
    )

    config = small_config(stem_steps=3, max_steps=3)  # its own stem file, not the fixture's
    method = HiVLPMethod(config, progress=False)
    stem_file = pixel_stem_stage(bench, stem_config(config)).file_name
    assert method.stem_stage(bench).file_name == stem_file
    # a new stem retrains the model
    assert method.stage(bench, tok).fingerprint["starts_from"] == [stem_file]
    assert method.stem_checkpoint(bench, tmp_path) == tmp_path / stem_file
    assert (method.stem_checkpoint(bench, None) is None
            and HiVLPMethod(small_config(stem="patch")).stem_checkpoint(bench, tmp_path) is None)
    method.fit(bench, tok, cache_dir=tmp_path)
    assert (tmp_path / stem_file).exists()  # trained once, cached beside the model
    stem, _ = train_pixel_stem(bench, stem_config(config), checkpoint_path=tmp_path / stem_file,
                               progress=False)
    # weights and BatchNorm statistics unchanged
    for name, value in stem.backbone.state_dict().items():
        torch.testing.assert_close(method.model.image_tower.backbone.state_dict()[name], value,
                                   atol=0, rtol=0)
    # the same model whether the stem was trained inside or loaded from the cache
    again, _ = train_hivlp(bench, tok, config, stem_checkpoint=tmp_path / stem_file, progress=False)
    for name, value in method.model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, atol=0, rtol=0)
    regions = HiVLPMethod(small_config(image_input="regions"), progress=False)
    assert regions.stem_stage(bench) is None
    patches = HiVLPMethod(small_config(stem="patch"), progress=False)
    assert patches.stage(bench, tok).fingerprint["starts_from"] == []
