"""The oracle ceiling: the generator's caption likelihood (checked against the generator itself)
and the expected recall of the Bayes ranking (checked against simulation and the truth ceiling)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from course_lib.core.metrics import hit_probability
from course_lib.data import synthetic
from course_lib.data.captions import (
    COUNT,
    PAIR,
    PLACE,
    RELATION,
    meanings_of,
    satisfies,
    truth_ceiling,
)
from course_lib.data.likelihood import (
    SCALE,
    caption_likelihood,
    compositional_likelihood,
    dropout_factor,
    iter_caption_likelihood,
    scene_free_factor,
)
from course_lib.data.oracle import bayes_recall, oracle_ceiling
from course_lib.data.scenes import GRID, Meanings, Scenes
from course_lib.data.split import RetrievalSplit
from course_lib.data.synthetic import SyntheticConfig, make_benchmark

SMALL = dict(n_train=60, n_val=20, n_test=30, n_pretrain=80, n_compositional=12)
FAMILY_NAME = {PAIR: "pair", RELATION: "relation", PLACE: "place", COUNT: "count"}
i8 = lambda x: np.array(x, dtype=np.int8)  # noqa: E731


def _scenes(rows: list[list[tuple]]) -> Scenes:
    """Scenes from lists of (shape, colour, size, cell) objects, padded to the longest."""
    n_slots = max(len(r) for r in rows)
    pad = lambda k: [[o[k] for o in r] + [-1] * (n_slots - len(r)) for r in rows]  # noqa: E731
    return Scenes(shape=i8(pad(0)), color=i8(pad(1)), size=i8(pad(2)), cell=i8(pad(3)),
                  n_objects=i8([len(r) for r in rows]))


# 4 objects: two identical small red circles (one shares a row with the square), a diagonal
# triangle; 5 objects: every pair geometry, two squares that differ only in size; 1 object: a pair
# or relation draw becomes a place caption
FIXED = _scenes([
    [(0, 0, 0, 0), (1, 2, 1, 1), (0, 0, 0, 5), (2, 3, 1, 6)],
    [(0, 0, 0, 0), (1, 2, 1, 4), (1, 2, 0, 2), (0, 0, 1, 8), (2, 3, 0, 3)],
    [(3, 5, 1, 7)],
])


def _slow_likelihood(m: Meanings, t: int, sc: Scenes, i: int, cfg: SyntheticConfig,
                     relation_weight: bool = True) -> float:
    """P(meaning t | scene i) / scene_free_factor, by looping over the generator's choices."""
    n = int(sc.n_objects[i])
    objs = [(sc.shape[i, o], sc.color[i, o], sc.size[i, o], sc.cell[i, o]) for o in range(n)]

    def fits(o, shape, color, size):
        return objs[o][0] == shape and color in (-1, objs[o][1]) and size in (-1, objs[o][2])

    fam, has_b = int(m.family[t]), bool(m.has_b[t])
    A = (m.a_shape[t], m.a_color[t], m.a_size[t])
    B = (m.b_shape[t], m.b_color[t], m.b_size[t])
    if fam == COUNT and m.count[t] != n:
        return 0.0
    if has_b:
        if n < 2 or (fam == COUNT and cfg.count_objects != 2):
            return 0.0
        total = 0.0
        for a, b in itertools.permutations(range(n), 2):
            if not (fits(a, *A) and fits(b, *B)):
                continue
            if fam == RELATION:
                (ra, ca), (rb, cb) = divmod(int(objs[a][3]), GRID), divmod(int(objs[b][3]), GRID)
                true = [ca < cb, ca > cb, ra < rb, ra > rb]
                if true[m.relation[t]]:
                    total += 1 / sum(true) if relation_weight else 1.0
            else:
                total += 1.0
        return total / (n * (n - 1))
    if fam == COUNT:
        return sum(fits(a, *A) for a in range(n)) / n if (cfg.count_objects == 1 or n < 2) else 0.0
    w = cfg.caption_families
    boost = (w["place"] + w["pair"] + w["relation"]) / w["place"] if n < 2 else 1.0
    return boost * sum(fits(a, *A) and objs[a][3] == m.place[t] for a in range(n)) / n


def _meaning_keys(m: Meanings) -> np.ndarray:
    return np.stack([getattr(m, f).astype(np.int64) for f in Meanings.FIELDS[:-1]], axis=1)


def _compare_frequencies(m: Meanings, prob: np.ndarray) -> tuple[float, float]:
    """(z, mass): the empirical frequency of each distinct sampled meaning against its computed
    probability, as the chi-square statistic turned into a standard normal score (Wilson-Hilferty;
    z > 4 has probability 3e-5 when the probabilities are right), and the computed probability
    mass of the distinct meanings seen (close to 1 once nearly all possible meanings are seen)."""
    keys, first, counts = np.unique(_meaning_keys(m), axis=0, return_index=True, return_counts=True)
    expected = prob[first] * len(m)
    assert (expected > 0).all(), "the generator said something the likelihood calls impossible"
    chi2, dof = float(((counts - expected) ** 2 / expected).sum()), max(len(keys) - 1, 1)
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / np.sqrt(2 / (9 * dof))
    return float(z), float(prob[first].sum())


@pytest.mark.parametrize("family,count_objects",
                         [(PAIR, 1), (RELATION, 1), (PLACE, 1), (COUNT, 1), (COUNT, 2)])
@pytest.mark.parametrize("scene", [0, 1, 2])
def test_likelihood_matches_the_generators_frequencies(family, count_objects, scene):
    """Sample meanings of one scene with the generator's own functions (_objects_for, meanings_of:
    what _split_captions' draw() runs once the family is drawn) and compare the frequency of each
    meaning with its probability, scene_free_factor * caption_likelihood / SCALE."""
    cfg = SyntheticConfig(caption_families={FAMILY_NAME[family]: 1.0}, count_objects=count_objects,
                          attribute_dropout=0.2)
    rng, n_samples = np.random.default_rng(10 * family + scene + count_objects), 20_000
    idx = np.full(n_samples, scene)
    two = (PAIR, RELATION, COUNT) if count_objects == 2 else (PAIR, RELATION)
    fam, a, b = synthetic._objects_for(rng, FIXED, idx, np.full(n_samples, family),
                                       two_families=two)
    m = meanings_of(rng, FIXED, idx, fam, a, b, cfg.attribute_dropout)
    prob = caption_likelihood(m, FIXED, cfg)[:, scene] * scene_free_factor(m, cfg) / SCALE
    z, mass = _compare_frequencies(m, prob)
    assert z < 4 and 0.98 < mass <= 1 + 1e-9, (z, mass)
    # the check can fail: without the 1 / #true-relations factor it does
    if family == RELATION and scene < 2:
        wrong = np.array([_slow_likelihood(m, t, FIXED, scene, cfg, relation_weight=False)
                          for t in range(len(m))])
        wrong = wrong * scene_free_factor(m, cfg)
        z_wrong, _ = _compare_frequencies(m, wrong / wrong[np.unique(_meaning_keys(m), axis=0,
                                                                     return_index=True)[1]].sum())
        assert z_wrong > 10, z_wrong


@pytest.mark.parametrize("cfg", [SyntheticConfig(**SMALL),
                                 SyntheticConfig(**SMALL, min_objects=1, count_objects=2,
                                                 attribute_dropout=0.3)])
def test_likelihood_matches_a_slow_loop(cfg):
    bench = make_benchmark(cfg, seed=5)
    s = bench["test"].subset(np.arange(12))
    other = bench["val"]  # captions of other scenes, scored on these scenes too
    m = Meanings.concatenate([s.meanings, other.meanings])
    L = caption_likelihood(m, s.scenes, cfg)
    for c in (cfg, SyntheticConfig(**{**cfg.to_dict(), "count_objects": 3 - cfg.count_objects})):
        slow = np.array([[_slow_likelihood(m, t, s.scenes, i, c) for i in range(s.n_images)]
                         for t in range(len(m))])
        np.testing.assert_allclose(caption_likelihood(m, s.scenes, c) / SCALE, slow,
                                   rtol=1e-12, atol=0)
    own = L[np.arange(len(s.meanings)), s.txt2img]
    assert (own > 0).all() and ((L > 0) <= satisfies(m, s.scenes)).all()
    chunks = iter_caption_likelihood(m, s.scenes, cfg, chunk=7)
    blocks = np.concatenate([block for _, block in chunks])
    np.testing.assert_array_equal(blocks, L)


def test_likelihood_hand_worked():
    # scene A, 4 objects: small red circle top left, big blue square top middle (same row), 2 others
    # scene B, 5 objects: small red circle top left, big blue square in the
    # middle (diagonal), 3 others
    others = [(2, 3, 1, 6), (3, 4, 0, 8), (4, 5, 0, 2)]
    scenes = _scenes([[(0, 0, 0, 0), (1, 2, 1, 1)] + others[:2],
                      [(0, 0, 0, 0), (1, 2, 1, 4)] + others])
    # relation "left of", pair, place top left, count "four ... a small red circle"
    captions = Meanings(
        family=i8([RELATION, PAIR, PLACE, COUNT]), a_shape=i8([0] * 4), a_color=i8([0] * 4),
        a_size=i8([0] * 4),
        b_shape=i8([1, 1, -1, -1]), b_color=i8([2, 2, -1, -1]), b_size=i8([1, 1, -1, -1]),
        relation=i8([0, -1, -1, -1]), place=i8([-1, -1, 0, -1]), count=i8([-1, -1, -1, 4]),
        noisy=np.zeros(4, dtype=bool))
    L = caption_likelihood(captions, scenes) / SCALE
    # relation: A has one ordered pair (circle, square) out of 4 * 3, and "left of" is the only true
    # relation; B has one out of 5 * 4, and "left of" is one of the two true ones (also "above")
    assert L[0] == pytest.approx([1 / 12, 1 / 40]) and L[0, 0] / L[0, 1] == pytest.approx(10 / 3)
    assert L[1] == pytest.approx([1 / 12, 1 / 20])  # pair: the relation plays no part
    assert L[2] == pytest.approx([1 / 4, 1 / 5])  # place: a is the circle
    assert L[3] == pytest.approx([1 / 4, 0])  # count: B has five objects
    np.testing.assert_array_equal(caption_likelihood(captions, scenes),
                                  [[420, 126], [420, 252], [1260, 1008], [1260, 0]])
    # the oracle on the two-image gallery: c0 from A, c1 and c2 from B, a third image C (a copy of
    # A without captions of its own) ties with A everywhere
    gallery = Scenes.concatenate([scenes, scenes.take([0])])
    split = RetrievalSplit(name="hand", captions=["c0", "c1", "c2"], txt2img=[0, 1, 1],
                           image_ids=["A", "B", "C"], scenes=gallery,
                           meanings=captions.take([0, 1, 2]))
    o = oracle_ceiling(split, ks=(1, 2, 3))
    # t2i: c0 (A, C tied first): 1/2, 1, 1; c1 (B third): 0, 0, 1; c2 (B third): 0, 0, 1
    assert [o[f"t2i_r{k}"] for k in (1, 2, 3)] == pytest.approx([100 / 6, 100 / 3, 100])
    # i2t posteriors, over (A, B, C): c0 (10, 3, 10) / 23, c1 (5, 3, 5) / 13, c2 (5, 4, 5) / 14.
    # A: own c0 (10/23 = .43) beats c1 (.38), c2 (.36): rank 1. B: own c2 (4/14 = .29) beats c1
    # (3/13 = .23) and c0 (3/23 = .13): rank 1. C has no captions of its own: skipped.
    assert o["i2t_r1"] == pytest.approx(100.0)
    t = truth_ceiling(split, ks=(1,))  # every caption is true of every image: ties everywhere
    assert (t["t2i_r1"] == pytest.approx(100 / 3)
            and t["i2t_r1"] == pytest.approx(100 * (1 / 3 + 2 / 3) / 2))


def _simulated(values_t2i: np.ndarray, txt2img: np.ndarray, ks, reps: int, rng) -> dict:
    """Mean R@K of the Bayes ranking (posterior for i2t) with ties broken by fresh random keys."""
    T, N = values_t2i.shape
    post = values_t2i / np.maximum(values_t2i.sum(1, keepdims=True), 1e-300)
    post = np.round(post, 12)
    out = {f"{d}_r{k}": 0.0 for d in ("t2i", "i2t") for k in ks}
    has_text = np.bincount(txt2img, minlength=N) > 0
    for _ in range(reps):
        u = rng.random((T, N))
        own_v, own_u = values_t2i[np.arange(T), txt2img], u[np.arange(T), txt2img]
        rank_t = ((values_t2i > own_v[:, None]) | ((values_t2i == own_v[:, None])
                                                   & (u > own_u[:, None]))).sum(1)
        rank_i = np.full(N, T)
        for t in range(T):
            i = txt2img[t]
            col, cu = post[:, i], u[:, i]
            rank_i[i] = min(rank_i[i], ((col > col[t]) | ((col == col[t]) & (cu > cu[t]))).sum())
        for k in ks:
            out[f"t2i_r{k}"] += 100 * (rank_t < k).mean() / reps
            out[f"i2t_r{k}"] += 100 * (rank_i[has_text] < k).mean() / reps
    return out


def test_bayes_oracle_matches_simulation():
    bench = make_benchmark(SyntheticConfig(**SMALL), seed=3)
    rng = np.random.default_rng(0)
    # a gallery with exact ties: six scenes, each twice (the copy keeps no captions of its own)
    s = bench["test"].subset(np.arange(6))
    scenes = Scenes.concatenate([s.scenes, s.scenes])
    dup = RetrievalSplit(name="dup", captions=s.captions, txt2img=s.txt2img,
                         image_ids=[str(i) for i in range(12)],
                         scenes=scenes, meanings=s.meanings, info=s.info)
    comp = bench["compositional"]
    for split in (bench["test"].subset(np.arange(12)), dup, comp):
        L = (compositional_likelihood(split.meanings, split.scenes, split.info["twin_of"],
                                      np.repeat(split.info["swapped_objects"], 2, axis=0),
                                      split.info["config"])
             if split is comp else caption_likelihood(split.meanings, split.scenes,
                                                      split.info["config"]))
        # said of an image only if false of its twin, and then also true of the image
        if split is comp:
            sat = satisfies(split.meanings, split.scenes)
            assert ((L > 0) <= (sat & ~sat[:, split.info["twin_of"]])).all()
        oracle = oracle_ceiling(split, ks=(1, 2, 5))
        sim = _simulated(L, split.txt2img, (1, 2, 5), 300, rng)
        for key, value in oracle.items():
            assert abs(value - sim[key]) < 3.0, (split.name, key, value, sim[key])


def test_bayes_recall_closed_form():
    # 4 captions x 3 images: c0 ties images 0 and 1, c2 fits nothing (a noisy caption), c3 says
    # what c0 says but belongs to image 1
    L = np.array([[2.0, 2.0, 1.0], [1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 1.0]])
    rows, cols = np.nonzero(L)
    o = bayes_recall(rows, cols, L[rows, cols], np.array([0, 1, 2, 1]), 3, ks=(1, 2, 3))
    # t2i: c0 tied first of 2 (1/2, 1), c1 first, c2 tied among all 3 (1/3, 2/3), c3 like c0
    assert o["t2i_r1"] == pytest.approx(100 * (1 / 2 + 1 + 1 / 3 + 1 / 2) / 4)
    assert o["t2i_r2"] == pytest.approx(100 * (1 + 1 + 2 / 3 + 1) / 4)
    # i2t posteriors: c0 and c3 (.4, .4, .2), c1 (.25, .75, 0), c2 (0, 0, 0). image 0: own c0 tied
    # with c3 (1/2, 1); image 1: own c1 first; image 2: c0, c3 (.2) first,
    # then c1 and own c2 tied at 0
    assert o["i2t_r1"] == pytest.approx(100 * (1 / 2 + 1 + 0) / 3)
    assert o["i2t_r2"] == pytest.approx(100 * 2 / 3)
    assert o["i2t_r3"] == pytest.approx(100 * (1 + 1 + 1 / 2) / 3)


@pytest.fixture(scope="module")
def smoke_bench():
    return make_benchmark(SyntheticConfig.smoke(), seed=0)


def test_bayes_beats_truth_in_expectation_for_every_caption(smoke_bench):
    """t2i: given a caption and the gallery, its origin has posterior p_i = L[t, i] / sum_j L[t, j];
    the Bayes top K holds the most posterior mass of any ranking, so its expected recall (over the
    origin) is >= the truth ranker's for every single caption. A realised split can still fall a
    little short on t2i (an unlikely caption said by its image), hence the tolerance
    further down."""
    s = smoke_bench["test"]
    L = caption_likelihood(s.meanings, s.scenes, s.info["config"])
    post = L / L.sum(1, keepdims=True)
    sat = satisfies(s.meanings, s.scenes)
    T, N = L.shape
    ones = np.ones(N)
    for k in (1, 5):
        # hit probability of image i under each ranking, for every caption
        better = (L[:, None, :] > L[:, :, None]).sum(2)
        tied = (L[:, None, :] == L[:, :, None]).sum(2)
        bayes = hit_probability(tied, ones, k - better)
        m = sat.sum(1, keepdims=True)
        truth = np.where(sat, np.minimum(1, k / m), np.maximum(k - m, 0) / np.maximum(N - m, 1))
        assert ((post * bayes).sum(1) >= (post * truth).sum(1) - 1e-12).all()


def test_bayes_oracle_sanity(smoke_bench):
    for name, ks in (("test", (1, 5, 10)), ("full", (5, 10, 20)), ("compositional", (1, 5, 10))):
        bayes, truth = oracle_ceiling(smoke_bench[name], ks), truth_ceiling(smoke_bench[name], ks)
        for key in truth:
            assert bayes[key] <= 100.0 + 1e-9
            assert bayes[key] >= truth[key] - 1.0, (name, key, bayes[key], truth[key])
        # caption specificity pays
        assert bayes["i2t_r" + str(ks[0])] > truth["i2t_r" + str(ks[0])] + 5


def test_compositional_likelihood_matches_the_generator(monkeypatch):
    """Many captions of one base scene and its twin from the generator's own loop
    (_make_compositional, with unique stand-in words so that no caption is redrawn for repeating
    words): frequencies and total mass (the per-image acceptance normalisation) match."""
    counter = itertools.count()
    monkeypatch.setattr(synthetic, "word_captions",
                        lambda m, rng: [f"c{next(counter)}" for _ in range(len(m))])
    kinds = set()
    for seed in range(6):
        cfg = SyntheticConfig(**{**SMALL, "n_compositional": 1}, captions_per_image=3000,
                              image_size=18, attribute_dropout=0.2)
        comp = synthetic._make_compositional(cfg, seed)
        kind = comp.info["swap_kind"][0]
        if kind in kinds:
            continue
        kinds.add(kind)
        L = compositional_likelihood(comp.meanings, comp.scenes, comp.info["twin_of"],
                                     np.repeat(comp.info["swapped_objects"], 2, axis=0), cfg)
        drop = dropout_factor(comp.meanings, cfg.attribute_dropout)
        for image in (0, 1):
            rows = np.flatnonzero(comp.txt2img == image)
            assert (L[rows, 1 - image] == 0).all()  # every caption is false of the twin
            m = comp.meanings.take(rows)
            z, mass = _compare_frequencies(m, L[rows, image] * drop[rows])
            assert z < 4 and 0.98 < mass <= 1 + 1e-9, (kind, image, z, mass)
        if len(kinds) == 2:
            break
    assert kinds == {"color", "cell"}


def test_compositional_caption_true_of_the_twin_is_never_said():
    """A pair caption naming the two objects whose cells a twin swapped is true of both twins, so
    the generator never says it (likelihood 0); the relation between them flips, so that
    one is said."""
    comp = make_benchmark(SyntheticConfig(**SMALL), seed=3)["compositional"]
    sc, pairs = comp.scenes, np.repeat(comp.info["swapped_objects"], 2, axis=0)
    images = np.flatnonzero(np.repeat(np.array(comp.info["swap_kind"]) == "cell", 2))
    assert len(images) >= 2
    p, q = pairs[images, 0], pairs[images, 1]
    row, col = sc.cell // GRID, sc.cell % GRID
    left, right = col[images, p] < col[images, q], col[images, p] > col[images, q]
    above = row[images, p] < row[images, q]
    rel = np.where(left, 0, np.where(right, 1, np.where(above, 2, 3)))
    pick = lambda f, o: getattr(sc, f)[images, o].astype(np.int8)  # noqa: E731
    none = np.full(len(images), -1, dtype=np.int8)
    for family, relation in ((PAIR, none), (RELATION, rel.astype(np.int8))):
        m = Meanings(family=np.full(len(images), family, dtype=np.int8), a_shape=pick("shape", p),
                     a_color=pick("color", p), a_size=pick("size", p), b_shape=pick("shape", q),
                     b_color=pick("color", q), b_size=pick("size", q), relation=relation,
                     place=none, count=none, noisy=np.zeros(len(images), dtype=bool))
        L = compositional_likelihood(m, sc, comp.info["twin_of"], pairs, comp.info["config"])
        own = L[np.arange(len(images)), images]
        assert (own == 0).all() if family == PAIR else (own > 0).all()
