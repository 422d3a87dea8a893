"""Two-stage retrieval against a naive per-query loop, its identities (top_m = everything gives the
re-ranker's own ranking), the cross-encoder's pair scorer against its full score matrix, and the
benchmark method built from two stand-in methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.core.metrics import retrieval_metrics
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.cross_encoder.model import (
    CrossEncoder,
    CrossEncoderConfig,
    score_index_pairs,
    score_matrix,
)
from course_lib.methods.rerank import TwoStageMethod, top_m_candidates, two_stage_scores


def naive_two_stage_order(first: np.ndarray, rerank: np.ndarray, m: int) -> list[int]:
    """One query's final order: its top-m by the first stage re-sorted by the re-ranker, then the
    rest in first-stage order. first, rerank: (n_candidates,) scores of one query."""
    by_first = sorted(range(len(first)), key=lambda c: -first[c])
    top = sorted(by_first[:m], key=lambda c: -rerank[c])
    return top + by_first[m:]


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
@pytest.mark.parametrize("m", [1, 3, 7])
def test_two_stage_scores_order_matches_a_naive_loop(direction, m):
    g = torch.Generator().manual_seed(m)
    first = torch.randn(7, 11, generator=g)  # (N, T), distinct scores
    full = torch.randn(7, 11, generator=g) * 5  # the re-ranker's score of every pair
    calls = []

    def score_pairs(images, texts):
        calls.append(len(images))
        return full[images, texts]

    out = two_stage_scores(first, score_pairs, m, direction)
    assert out.shape == first.shape and calls == [m * (11 if direction == "t2i" else 7)]
    for q in range(11 if direction == "t2i" else 7):
        f, r, o = ((first[:, q], full[:, q], out[:, q]) if direction == "t2i"
                   else (first[q], full[q], out[q]))
        expected = naive_two_stage_order(f.numpy(), r.numpy(), m)
        assert torch.argsort(o, descending=True).tolist() == expected


def test_top_m_of_everything_is_the_rerankers_own_ranking():
    g = torch.Generator().manual_seed(0)
    txt2img = np.repeat(np.arange(6), 5)  # 6 images, 5 captions each
    first, full = torch.randn(6, 30, generator=g), torch.randn(6, 30, generator=g)
    scorer = lambda i, t: full[i, t]  # noqa: E731
    i2t = two_stage_scores(first, scorer, 30, "i2t")
    t2i = two_stage_scores(first, scorer, 6, "t2i")
    assert retrieval_metrics(i2t, txt2img, t2i_sims=t2i) == retrieval_metrics(full, txt2img)
    # and top_m = 1 keeps the first stage's ranking exactly
    one = retrieval_metrics(two_stage_scores(first, scorer, 1, "i2t"), txt2img,
                            t2i_sims=two_stage_scores(first, scorer, 1, "t2i"))
    assert one == retrieval_metrics(first, txt2img)


def test_top_m_candidates_checks_its_input():
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.2], [0.3, 0.4]])  # (3 images, 2 texts)
    assert top_m_candidates(scores, 2, "t2i").tolist() == [[1, 2], [0, 2]]
    assert top_m_candidates(scores, 5, "i2t").tolist() == [[1, 0], [0, 1], [1, 0]]  # capped
    with pytest.raises(ValueError, match="direction"):
        top_m_candidates(scores, 2, "both")
    with pytest.raises(ValueError, match="top_m"):
        top_m_candidates(scores, 0)


def test_retrieval_metrics_t2i_sims_must_match_shape():
    with pytest.raises(ValueError, match="t2i_sims"):
        retrieval_metrics(torch.zeros(2, 4), np.array([0, 0, 1, 1]), t2i_sims=torch.zeros(2, 3))


def test_cross_encoder_pair_scorer_matches_its_score_matrix():
    torch.set_num_threads(1)
    bench = make_benchmark(SyntheticConfig.smoke(n_train=10, n_val=2, n_test=6, n_pretrain=2,
                                                 n_compositional=1), seed=0)
    split = bench["test"]
    tokenizer = build_word_tokenizer(bench["train"].captions + split.captions)
    torch.manual_seed(0)
    model = CrossEncoder(split.regions.shape[-1], len(tokenizer),
                         CrossEncoderConfig(hidden=16, layers=1, heads=2, towers="none")).eval()
    full = score_matrix(model, split, tokenizer, progress=False)  # (N, T)
    images = torch.tensor([0, 5, 2, 2, 3])
    texts = torch.tensor([7, 7, 0, 29, 12])
    got = score_index_pairs(model, split, tokenizer, images, texts, batch_size=2)
    assert torch.allclose(got, full[images, texts], atol=1e-5)
    with pytest.raises(ValueError, match="pairs"):
        score_index_pairs(model, split, tokenizer, images, texts[:3])


class _Stub:
    """A stand-in method whose scores are a fixed matrix."""

    def __init__(self, name, scores):
        self.name, self.scores, self.model = name, scores, "fitted"

    def similarity(self, split):
        return self.scores

    eval_pairs = (None, None)

    def score_pairs(self, split, images, texts):
        return self.scores[images, texts]

    def pairs_per_query(self, split, direction):
        return 0

    def rank(self, split, direction, top_k, queries):
        by_query = (self.scores.T if direction == "t2i" else self.scores)[torch.as_tensor(queries)]
        top = torch.topk(by_query, min(top_k, by_query.shape[1]), dim=1)
        return top.indices, top.values

    def query_fn(self, split, caption_index=0, top_k=10, with_scores=False):
        top = torch.topk(self.scores[:, caption_index], top_k)
        return lambda: ((top.indices.numpy(), top.values.numpy()) if with_scores
                        else top.indices.numpy())


class _Queries:
    """The least of a split a Cascade needs: its query indices."""

    def __init__(self, n_images, n_texts):
        self.text_queries, self.image_queries = np.arange(n_texts), np.arange(n_images)
        self.n_texts, self.n_images = n_texts, n_images


def naive_cascade(stage_scores, top_ms, combine, query, direction):
    """One query at a time, plain Python: the reference order of a cascade on dense matrices."""
    column = lambda m: (m[:, query] if direction == "t2i" else m[query]).tolist()  # noqa: E731
    per_stage = [column(m) for m in stage_scores]
    order = sorted(range(len(per_stage[0])), key=lambda i: -per_stage[0][i])
    survivors, dropped = order[:top_ms[0]], [order[top_ms[0]:]]
    for j in range(1, len(stage_scores)):
        keep = top_ms[j] if j < len(top_ms) else len(survivors)
        fused = {i: combine([per_stage[s][i] for s in range(j + 1)]) for i in survivors}
        ranked = sorted(survivors, key=lambda i: -fused[i])  # stable: earlier order breaks ties
        survivors, dropped = ranked[:keep], [ranked[keep:]] + dropped
    return survivors + [i for group in dropped for i in group]


def naive_weighted_sum(weights):
    """The combine of weighted_sum(weights), spelled out: sum of w * score over the stages so far
    (a prefix of the weights before the last stage)."""
    return lambda v: sum(w * x for w, x in zip(weights, v, strict=False))


def test_two_stage_method_combines_first_stage_and_reranker():
    g = torch.Generator().manual_seed(4)
    first, full = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    method = TwoStageMethod(_Stub("fast", first), _Stub("slow", full), top_m=3)
    assert method.name == "fast+rerank@3"
    i2t, t2i = method.similarity(None)
    assert torch.equal(t2i, method.t2i_similarity(None))
    assert torch.equal(t2i, two_stage_scores(first, lambda i, t: full[i, t], 3, "t2i"))
    top = method.query_fn(None, top_k=2, caption_index=5)()
    assert top.tolist() == naive_two_stage_order(first[:, 5].numpy(), full[:, 5].numpy(), 3)[:2]


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_cascade_matches_a_naive_loop_with_three_stages_and_a_weighted_combine(direction):
    from course_lib.methods.rerank import Cascade, weighted_sum

    g = torch.Generator().manual_seed(7)
    mats = [torch.randn(9, 27, generator=g) for _ in range(3)]
    stages = [_Stub(f"s{j}", m) for j, m in enumerate(mats)]
    split = _Queries(9, 27)
    n_gallery = 9 if direction == "t2i" else 27
    for top_ms, weights in (([6, 3], None), ([5, 5], [0.5, 1.0, 2.0])):
        cascade = Cascade(stages, top_ms, **({"combine": weighted_sum(weights)} if weights else {}))
        indices, scores = cascade.rank(split, direction, top_k=n_gallery)
        combine = naive_weighted_sum(weights) if weights else (lambda v: v[-1])
        for q in range(len(indices)):
            assert indices[q].tolist() == naive_cascade(mats, top_ms, combine, q, direction)
        # best first, strictly below past the survivors
        assert (scores[:, :-1] >= scores[:, 1:]).all()
    cascade = Cascade(stages[:2], [4], combine=weighted_sum([0.3, 1.0]))
    top = cascade.query_fn(split, caption_index=5, top_k=3)()
    assert top.tolist() == naive_cascade(mats[:2], [4], lambda v: 0.3 * v[0] + v[1], 5, "t2i")[:3]


def test_cascade_rejects_bad_shapes():
    from course_lib.methods.rerank import Cascade

    a = _Stub("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one top_m"):
        Cascade([a, a], [3, 2])
    with pytest.raises(ValueError, match="non-increasing"):
        Cascade([a, a, a], [2, 5])
    with pytest.raises(ValueError, match="non-increasing"):
        Cascade([a, a, a], [5, 2], top_ms_i2t=[2, 5])
    with pytest.raises(ValueError, match="one top_m"):
        Cascade([a, a], [3], top_ms_i2t=[3, 2])


def test_cascade_keeps_its_own_top_m_per_direction():
    from course_lib.methods.rerank import Cascade

    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(9, 27, generator=g) for _ in range(2)]
    split = _Queries(9, 27)
    cascade = Cascade([_Stub("a", mats[0]), _Stub("b", mats[1])], [3], top_ms_i2t=[7])
    assert cascade.survivors("t2i") == [3] and cascade.survivors("i2t") == [7]
    assert cascade.pairs_per_query(split, "t2i") == 3 and cascade.pairs_per_query(split, "i2t") == 7
    for direction, m in (("t2i", 3), ("i2t", 7)):
        indices, _ = cascade.rank(split, direction, top_k=9)
        for q in range(len(indices)):
            assert (indices[q].tolist()
                    == naive_cascade(mats, [m], lambda v: v[-1], q, direction)[:9])
    two_stage = TwoStageMethod(_Stub("a", mats[0]), _Stub("b", mats[1]), top_m=3, top_m_i2t=7)
    i2t, t2i = two_stage.similarity(None)
    assert torch.equal(i2t, two_stage_scores(mats[0], lambda i, t: mats[1][i, t], 7, "i2t"))
    assert torch.equal(t2i, two_stage_scores(mats[0], lambda i, t: mats[1][i, t], 3, "t2i"))


def test_cascade_fit_fits_only_unfitted_stages():
    from course_lib.methods.rerank import Cascade

    class Fittable(_Stub):
        fits = 0

        def fit(self, bench, tokenizer, cache_dir=None):
            Fittable.fits += 1
            self.model = "fitted"
            return self

    fresh = Fittable("fresh", torch.zeros(2, 4))
    fresh.model = None
    cascade = Cascade([_Stub("done", torch.zeros(2, 4)), fresh], [2])
    # it trains nothing of its own
    assert cascade.fit({}, None) is cascade and not hasattr(cascade, "train")
    assert Fittable.fits == 1 and fresh.model == "fitted"
    cascade.fit({}, None)
    assert Fittable.fits == 1  # a fitted stage is not fitted again


class _CountingStub(_Stub):
    """A _Stub that records every pair it is asked to score."""

    def __init__(self, name, scores):
        super().__init__(name, scores)
        self.asked = []

    def score_pairs(self, split, images, texts):
        self.asked += list(zip(images.tolist(), texts.tolist(), strict=True))
        return super().score_pairs(split, images, texts)


def test_cascades_sharing_a_reranker_score_each_pair_once_in_evaluation():
    from course_lib.methods.rerank import Cascade

    g = torch.Generator().manual_seed(11)
    first, full = torch.randn(12, 36, generator=g), torch.randn(12, 36, generator=g)
    split = _Queries(12, 36)
    reranker = _CountingStub("slow", full)
    wide, narrow = (Cascade([_Stub("fast", first), reranker], [m]) for m in (6, 3))
    expected = {m: Cascade([_Stub("fast", first), _Stub("slow", full)], [m]).rank(split, "t2i", 12)
                for m in (6, 3)}
    got_wide = wide.rank(split, "t2i", 12)
    assert len(reranker.asked) == len(set(reranker.asked)) == 36 * 6
    got_narrow = narrow.rank(split, "t2i", 12)  # its top 3 are among the top 6 already scored
    assert len(reranker.asked) == 36 * 6
    for got, m in ((got_wide, 6), (got_narrow, 3)):
        assert torch.equal(got[0], expected[m][0]) and torch.allclose(got[1], expected[m][1])
    wide.rank(split, "i2t", 36)  # the other direction scores only pairs it has not seen
    assert len(reranker.asked) == len(set(reranker.asked))
    other = _Queries(12, 36)  # another split: nothing carries over
    narrow.rank(other, "t2i", 12)
    assert len(reranker.asked) == len(set(reranker.asked)) + 36 * 3
    reranker.model = "retrained"  # another model: nothing carries over either
    narrow.rank(split, "t2i", 12)
    assert len(reranker.asked) == len(set(reranker.asked)) + 2 * 36 * 3
    # a timed query pays for its pairs every time
    before = len(reranker.asked)
    narrow.query_fn(split, caption_index=0, top_k=3)()
    assert len(reranker.asked) == before + 3
