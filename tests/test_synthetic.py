"""Tests of the synthetic benchmark: determinism, shapes, truth of captions, the oracle, speed."""

from __future__ import annotations

import io
import time
from math import comb

import numpy as np
import pytest

from course_lib.data.captions import caption_vocabulary, satisfies, satisfies_rows, truth_ceiling
from course_lib.data.oracle import oracle_ceiling
from course_lib.data.render import detect_regions, geometry, render_pixels
from course_lib.data.scenes import FAMILIES, Meanings, Scenes
from course_lib.data.split import RetrievalSplit
from course_lib.data.synthetic import (
    SyntheticConfig,
    fresh_scenes,
    make_benchmark,
    with_fresh_scenes,
)

SMALL = dict(n_train=60, n_val=20, n_test=30, n_pretrain=80, n_compositional=12)
SPLIT_NAMES = ("train", "val", "test", "pretrain", "compositional", "full")


@pytest.fixture(scope="module")
def bench():
    return make_benchmark(SyntheticConfig(**SMALL), seed=3)


def _assert_same(a: RetrievalSplit, b: RetrievalSplit):
    assert a.captions == b.captions and a.image_ids == b.image_ids
    for name in ("images", "regions", "boxes", "region_mask", "region_classes", "txt2img"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.scenes == b.scenes and a.meanings == b.meanings


def test_deterministic(bench):
    again = make_benchmark(SyntheticConfig(**SMALL), seed=3)
    assert set(again) == set(SPLIT_NAMES)
    for name in SPLIT_NAMES:
        _assert_same(bench[name], again[name])


def test_different_seeds_differ(bench):
    other = make_benchmark(SyntheticConfig(**SMALL), seed=4)
    for name in SPLIT_NAMES:
        assert other[name].captions != bench[name].captions
        assert not np.array_equal(other[name].images, bench[name].images)


def test_splits_independent_of_other_sizes(bench):
    other = make_benchmark(SyntheticConfig(**{**SMALL, "n_train": 75, "n_pretrain": 10}), seed=3)
    for name in ("val", "test", "compositional"):
        _assert_same(bench[name], other[name])


def test_fresh_scenes_are_new_training_scenes(bench):
    """fresh_scenes: deterministic, captioned as the training split (5 true captions per scene),
    drawn from streams no benchmark split uses, each draw another batch."""
    cfg = SyntheticConfig(**SMALL)
    fresh = fresh_scenes(cfg, 40, seed=3)
    _assert_same(fresh, fresh_scenes(cfg, 40, seed=3))
    assert fresh.n_images == 40 and fresh.n_texts == 40 * cfg.captions_per_image
    assert np.array_equal(np.bincount(fresh.txt2img), np.full(40, cfg.captions_per_image))
    assert fresh.images.shape[1:] == bench["train"].images.shape[1:]
    assert fresh.regions.shape[1:] == bench["train"].regions.shape[1:]
    truth = satisfies(fresh.meanings, fresh.scenes)  # (T, N)
    # every caption true of its own scene
    assert truth[np.arange(fresh.n_texts), fresh.txt2img].all()
    for name in SPLIT_NAMES:
        assert not np.array_equal(fresh.images[:10], bench[name].images[:10]), name
    other = fresh_scenes(cfg, 40, seed=3, draw=1)
    assert other.captions != fresh.captions and other.image_ids[0] != fresh.image_ids[0]
    with pytest.raises(ValueError, match="n >= 1"):
        fresh_scenes(cfg, 0)


def test_with_fresh_scenes_appends_them_to_the_training_split(bench):
    train = bench["train"]
    assert with_fresh_scenes(train, 0) is train
    longer = with_fresh_scenes(train, 20)
    fresh = fresh_scenes(SyntheticConfig(**SMALL), 20, seed=3)
    assert (longer.n_images == train.n_images + 20
            and longer.captions == train.captions + fresh.captions)
    np.testing.assert_array_equal(longer.images, np.concatenate([train.images, fresh.images]))
    np.testing.assert_array_equal(longer.txt2img,
                                  np.concatenate([train.txt2img, fresh.txt2img + train.n_images]))
    with pytest.raises(ValueError, match="not made by make_benchmark.*fresh_scenes=0"):
        with_fresh_scenes(longer, 5)  # a pooled split has no single generator config


def test_shapes_dtypes_ranges(bench):
    cfg = SyntheticConfig(**SMALL)
    for name in SPLIT_NAMES:
        s = bench[name]
        n, R = s.n_images, cfg.max_regions
        assert s.images.dtype == np.uint8 and s.images.shape == (n, 32, 32, 3)
        assert s.regions.dtype == np.float32 and s.regions.shape == (n, R, cfg.region_dim)
        assert s.boxes.dtype == np.float32 and s.boxes.shape == (n, R, 7)
        assert s.region_mask.dtype == bool and s.region_classes.shape == (n, R, 48)
        per = 1 if name == "pretrain" else 5
        assert (s.n_texts == per * n
                and np.array_equal(np.bincount(s.txt2img, minlength=n), np.full(n, per)))
        assert len(s.scenes) == n and len(s.meanings) == s.n_texts
        # no clutter regions by default
        assert np.array_equal(s.region_mask.sum(1), s.scenes.n_objects)
        assert s.region_mask[:, :4].all()  # real regions first, padding last
        valid, pad = s.region_mask, ~s.region_mask
        b = s.boxes[valid]
        assert b.min() >= 0 and b.max() <= 1
        assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
        np.testing.assert_allclose(b[:, 4], b[:, 2] - b[:, 0], atol=1e-6)
        np.testing.assert_allclose(b[:, 5], b[:, 3] - b[:, 1], atol=1e-6)
        np.testing.assert_allclose(b[:, 6], b[:, 4] * b[:, 5], atol=1e-6)
        np.testing.assert_allclose(s.region_classes[valid].sum(-1), 1.0, atol=1e-5)
        assert (not s.regions[pad].any() and not s.boxes[pad].any()
                and not s.region_classes[pad].any())
        # lower case, single spaces, letters only
        assert all(c == c.lower() == " ".join(c.split()) and c.replace(" ", "").isalpha()
                   for c in s.captions)
    assert bench["test"].image_ids[12] == "test_000012"
    assert (bench["test"].info["seed"] == 3
            and bench["test"].info["config"]["n_test"] == SMALL["n_test"])
    assert bench["full"].n_images == sum(SMALL[k] for k in ("n_train", "n_val", "n_test"))


def test_detector_classes_and_shuffle():
    scenes = make_benchmark(SyntheticConfig(**SMALL), seed=0)["train"].scenes
    rng = np.random.default_rng(0)
    _, boxes = render_pixels(scenes, np.zeros((len(scenes), 5, 2), dtype=np.int64) + 1, rng)
    det = detect_regions(scenes, boxes, rng, region_dim=32, clutter_regions=2)
    assert det["regions"].shape == (len(scenes), 7, 32)
    assert det["region_mask"].sum() == scenes.n_objects.sum() + 2 * len(scenes)
    img, slot = np.nonzero(det["region_object"] >= 0)
    obj = det["region_object"][img, slot]
    true_class = scenes.shape[img, obj] * 8 + scenes.color[img, obj]
    probs = det["region_classes"][img, slot]
    assert (probs.argmax(-1) == true_class).mean() > 0.6  # a decent, imperfect detector
    assert probs[np.arange(len(obj)), true_class].mean() > 0.25
    np.testing.assert_array_equal(det["boxes"][img, slot], boxes[img, obj])
    first = det["region_object"][:, 0]
    assert len(np.unique(first)) > 3  # the first slot is not always the same object or clutter
    # the features are a function of the attributes: the same (shape, colour,
    # size) is close, others far
    f = det["regions"][img, slot]
    key = true_class * 2 + scenes.size[img, obj]
    same = key[:, None] == key[None, :]
    d = ((f[:, None] - f[None]) ** 2).sum(-1)
    assert d[same & ~np.eye(len(f), dtype=bool)].mean() < 0.3 * d[~same].mean()


def _slow_true(m: Meanings, t: int, sc: Scenes, n: int) -> bool:
    """Independent reference: loop over objects of scene n for caption t."""
    objs = [(sc.shape[n, o], sc.color[n, o], sc.size[n, o], sc.cell[n, o])
            for o in range(sc.n_objects[n])]

    def match(obj, shape, color, size):
        return all(want < 0 or have == want
                   for have, want in zip(obj[:3], (shape, color, size), strict=True))

    if m.count[t] >= 0 and m.count[t] != len(objs):
        return False
    has_b = m.b_shape[t] >= 0 or m.b_color[t] >= 0 or m.b_size[t] >= 0
    for i, oi in enumerate(objs):
        elsewhere = m.place[t] >= 0 and oi[3] != m.place[t]
        if not match(oi, m.a_shape[t], m.a_color[t], m.a_size[t]) or elsewhere:
            continue
        if not has_b:
            return True
        for j, oj in enumerate(objs):
            if j == i or not match(oj, m.b_shape[t], m.b_color[t], m.b_size[t]):
                continue
            (ri, ci), (rj, cj) = divmod(int(oi[3]), 3), divmod(int(oj[3]), 3)
            if m.relation[t] < 0 or [ci < cj, ci > cj, ri < rj, ri > rj][m.relation[t]]:
                return True
    return False


@pytest.mark.parametrize("name", ["test", "pretrain", "compositional"])
def test_satisfies_matches_slow_loop(bench, name):
    s = bench[name].subset(np.arange(14))
    fast = satisfies(s.meanings, s.scenes)
    slow = np.array([[_slow_true(s.meanings, t, s.scenes, n) for n in range(s.n_images)]
                     for t in range(s.n_texts)])
    assert fast.shape == (s.n_texts, s.n_images) and fast.dtype == bool
    np.testing.assert_array_equal(fast, slow)
    assert fast.sum() > s.n_texts  # captions are often true of other images too: ambiguity exists
    own = satisfies_rows(s.meanings, s.scenes.take(s.txt2img))
    np.testing.assert_array_equal(own, fast[np.arange(s.n_texts), s.txt2img])


def test_every_caption_true_of_its_own_scene(bench):
    for name in SPLIT_NAMES:
        s = bench[name]
        own = satisfies_rows(s.meanings, s.scenes.take(s.txt2img))
        assert own[~s.meanings.noisy].all(), name
    noisy = bench["pretrain"].meanings.noisy
    assert 0 < noisy.sum() < 0.3 * len(noisy) and not bench["test"].meanings.noisy.any()


def test_families_and_caption_variety(bench):
    fam = bench["train"].meanings.family
    counts = np.bincount(fam, minlength=len(FAMILIES)) / len(fam)
    assert counts[FAMILIES.index("relation")] > 0.35 and counts[FAMILIES.index("terse")] == 0
    assert all(counts[FAMILIES.index(f)] > 0 for f in ("pair", "place", "count"))
    assert (bench["pretrain"].meanings.family == FAMILIES.index("terse")).all()
    s = bench["train"]
    assert np.mean([len(set(c)) == 5 for c in np.array(s.captions).reshape(-1, 5)]) > 0.98


def test_compositional_twins(bench):
    s = bench["compositional"]
    n = SMALL["n_compositional"]
    twin, kinds, pairs = s.info["twin_of"], s.info["swap_kind"], s.info["swapped_objects"]
    assert s.n_images == 2 * n and np.array_equal(twin, np.arange(2 * n) ^ 1) and len(kinds) == n
    sc = s.scenes
    for i in range(n):
        base, other = 2 * i, 2 * i + 1
        field = "color" if kinds[i] == "color" else "cell"
        p, q = pairs[i]
        for f in Scenes.FIELDS:
            a, b = getattr(sc, f)[base].copy(), getattr(sc, f)[other]
            if f == field:
                assert a[p] != a[q]
                a[[p, q]] = a[[q, p]]
            np.testing.assert_array_equal(a, b)
    sat = satisfies(s.meanings, s.scenes)
    t = np.arange(s.n_texts)
    assert sat[t, s.txt2img].all() and not sat[t, twin[s.txt2img]].any()
    m = s.meanings
    for t in range(s.n_texts):  # object a is one of the swapped objects
        img = s.txt2img[t]
        wanted = (("shape", m.a_shape[t]), ("color", m.a_color[t]), ("size", m.a_size[t]))
        ok = [all(w < 0 or getattr(sc, f)[img, o] == w for f, w in wanted) for o in pairs[img // 2]]
        assert any(ok)
    assert set(kinds) == {"color", "cell"}
    assert s.image_ids[:2] == ["compositional_000000_base", "compositional_000000_twin"]


def _simulated_recall(sat: np.ndarray, txt2img: np.ndarray, k: int, reps: int,
                      rng) -> tuple[float, float]:
    """R@K of the truth ranker (satisfying first, random ties), estimated by simulation."""
    T, N = sat.shape
    t2i = i2t = 0.0
    for _ in range(reps):
        score = sat + 0.5 * rng.random((T, N))  # (T, N): ties broken by the noise
        rank_t = (score > score[np.arange(T), txt2img][:, None]).sum(1)
        t2i += (rank_t < k).mean()
        rank_i = np.full(N, T)
        for c in range(T):  # best rank of each image's own captions among all captions
            rank_i[txt2img[c]] = min(rank_i[txt2img[c]],
                                     (score[:, txt2img[c]] > score[c, txt2img[c]]).sum())
        i2t += (rank_i < k).mean()
    return 100 * t2i / reps, 100 * i2t / reps


def test_truth_ceiling_matches_simulation(bench):
    s = bench["test"].subset(np.arange(12))
    sat = satisfies(s.meanings, s.scenes)
    rng = np.random.default_rng(0)
    oracle = truth_ceiling(s, ks=(1, 2, 5))
    for k in (1, 2, 5):
        t2i, i2t = _simulated_recall(sat, s.txt2img, k, 400, rng)
        close = abs(oracle[f"t2i_r{k}"] - t2i) < 2.5 and abs(oracle[f"i2t_r{k}"] - i2t) < 3.5
        assert close, (k, oracle, t2i, i2t)
    # exact formula check on the same ground truth
    m = sat.sum(1)
    assert oracle["t2i_r1"] == pytest.approx(100 * np.mean(1 / m))
    s_i, g_i = sat.sum(0), np.bincount(s.txt2img, minlength=s.n_images)
    expect = np.mean([1 - comb(a - g, 2) / comb(a, 2) for a, g in zip(s_i, g_i, strict=True)])
    assert oracle["i2t_r2"] == pytest.approx(100 * expect)


def test_truth_ceiling_hand_worked_example():
    # scene 0: small red circle top left, big blue square top middle
    # scene 1: small red circle in the middle, big green triangle bottom right
    # scene 2: big blue square top left, small red circle top right
    i8 = lambda x: np.array(x, dtype=np.int8)  # noqa: E731
    scenes = Scenes(shape=i8([[0, 1], [0, 2], [1, 0]]), color=i8([[0, 2], [0, 1], [2, 0]]),
                    size=i8([[0, 1], [0, 1], [1, 0]]), cell=i8([[0, 1], [4, 8], [0, 2]]),
                    n_objects=i8([2, 2, 2]))
    meanings = Meanings(  # c0 relation, c1 place, c2 pair, c3 count
        family=i8([1, 2, 0, 3]), a_shape=i8([0, 0, 0, 0]), a_color=i8([0, 0, 0, 0]),
        a_size=i8([0, 0, 0, 0]),
        b_shape=i8([1, -1, 1, -1]), b_color=i8([2, -1, 2, -1]), b_size=i8([1, -1, 1, -1]),
        relation=i8([0, -1, -1, -1]), place=i8([-1, 4, -1, -1]), count=i8([-1, -1, -1, 2]),
        noisy=np.zeros(4, dtype=bool))
    split = RetrievalSplit(name="hand", captions=[
        "a small red circle left of a big blue square", "a small red circle in the middle",
        "a small red circle and a big blue square", "two shapes one of them a small red circle"],
        txt2img=[0, 1, 2, 0], image_ids=["s0", "s1", "s2"], scenes=scenes, meanings=meanings)
    expected = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(satisfies(meanings, scenes), expected)
    o = truth_ceiling(split, ks=(1, 2))
    # t2i: m = 1, 1, 2, 3 -> R@1 = mean(1, 1, 1/2, 1/3); R@2 = mean(1, 1, 1, 2/3)
    assert o["t2i_r1"] == pytest.approx(100 * (1 + 1 + 1 / 2 + 1 / 3) / 4)
    assert o["t2i_r2"] == pytest.approx(100 * (1 + 1 + 1 + 2 / 3) / 4)
    # i2t: scene 0 satisfies 3 captions, 2 its own (2/3); scenes 1 and 2 satisfy 2, 1 own (1/2)
    assert o["i2t_r1"] == pytest.approx(100 * (2 / 3 + 1 / 2 + 1 / 2) / 3)
    assert o["i2t_r2"] == pytest.approx(100.0)


@pytest.mark.parametrize("image_size", [32, 64])
def test_boxes_match_drawn_pixels(image_size):
    """A one-object scene per (shape, size, cell): the box is the coloured pixels' bounding box."""
    g = geometry(image_size)
    rows = [(s, c % 8, z, c % 9) for s in range(6) for z in range(2) for c in range(9)]
    i8 = lambda x: np.array(x, dtype=np.int8)[:, None]  # noqa: E731
    scenes = Scenes(shape=i8([r[0] for r in rows]), color=i8([r[1] for r in rows]),
                    size=i8([r[2] for r in rows]), cell=i8([r[3] for r in rows]),
                    n_objects=np.ones(len(rows), dtype=np.int8))
    rng = np.random.default_rng(1)
    offsets = (g["lo"][scenes.size.astype(int)][..., None]
               + rng.integers(0, 2, size=(len(rows), 1, 2)))
    images, boxes = render_pixels(scenes, offsets, rng, image_size=image_size, pixel_noise=0.0)
    for i in range(len(rows)):
        ys, xs = np.nonzero((images[i].astype(int) - [18, 18, 26]).any(-1))
        x1, y1, x2, y2 = boxes[i, 0, :4] * image_size
        assert (x1, y1, x2, y2) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        r, c = divmod(rows[i][3], 3)  # inside its own cell
        assert g["margin"] + c * g["cs"] <= x1 and x2 <= g["margin"] + (c + 1) * g["cs"]
        assert g["margin"] + r * g["cs"] <= y1 and y2 <= g["margin"] + (r + 1) * g["cs"]


def test_knobs_work():
    cfg = SyntheticConfig(n_train=20, n_val=5, n_test=5, n_pretrain=0, n_compositional=3,
                          image_size=64, min_objects=1, max_objects=3, clutter=2.0,
                          clutter_regions=2, region_dim=16, pixel_noise=0.0, count_objects=2,
                          caption_families={"count": 1.0, "pair": 1.0})
    b = make_benchmark(cfg, seed=1, progress=False)
    assert b["train"].images.shape[1:] == (64, 64, 3) and b["train"].regions.shape[1:] == (5, 16)
    assert b["pretrain"].n_images == 0 and b["compositional"].n_images == 6
    for name in SPLIT_NAMES:
        s = b[name]
        assert satisfies_rows(s.meanings, s.scenes.take(s.txt2img))[~s.meanings.noisy].all()


def test_vocabulary_size(bench):
    vocab = caption_vocabulary()
    used = {w for name in SPLIT_NAMES for c in bench[name].captions for w in c.split()}
    print(f"vocabulary: {len(vocab)} words ({len(used)} used in this small benchmark)")
    assert used <= set(vocab) and 60 <= len(vocab) <= 160 and len(used) > 50
    assert "next" not in vocab  # 'next to' is ambiguous and not used


def test_table_round_trips(bench):
    for table in (bench["full"].scenes, bench["full"].meanings):
        buf = io.BytesIO()
        np.savez(buf, **table.to_arrays())
        buf.seek(0)
        with np.load(buf) as z:
            again = type(table).from_arrays(dict(z))
        assert again == table
        idx = np.array([3, 1, 4, 1])
        part = table.take(idx)
        assert len(part) == 4 and part == type(table).from_arrays(
            {k: v[idx] for k, v in table.to_arrays().items()})
        assert type(table).concatenate([table.take(np.arange(5)),
                                        table.take(np.arange(5, len(table)))]) == table
    full = bench["full"]
    assert full.scenes == Scenes.concatenate([bench[k].scenes for k in ("train", "val", "test")])
    six = SyntheticConfig(n_train=2, n_val=1, n_test=1, n_pretrain=0, n_compositional=1,
                          max_objects=6)
    wider = Scenes.concatenate([full.scenes, make_benchmark(six, seed=0)["test"].scenes])
    assert wider.max_objects == 6 and (wider.shape[: len(full.scenes), 5] == -1).all()


def test_config_constructors(monkeypatch):
    cfg = SyntheticConfig.scaled(10_000)
    sizes = (cfg.n_train, cfg.n_val, cfg.n_test, cfg.n_pretrain, cfg.n_compositional)
    assert sizes == (8334, 833, 833, 20_000, 416)
    tiny = SyntheticConfig.scaled(5)
    assert min(tiny.n_val, tiny.n_test, tiny.n_compositional) >= 1
    assert SyntheticConfig.smoke().n_train < 1000 and SyntheticConfig().n_train == 10_000
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert SyntheticConfig.for_course() == SyntheticConfig.smoke()
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert SyntheticConfig.for_course() == SyntheticConfig()
    with pytest.raises(ValueError):
        SyntheticConfig(caption_families={"nonsense": 1.0})


def test_generation_budget():
    """The course's budget: 10k scenes with images, regions and captions in <= 10 s on a 2-core CPU.
    scaled(10_000) builds more than that (plus 20k pre-training scenes and the twins)."""
    start = time.perf_counter()
    b = make_benchmark(SyntheticConfig.scaled(10_000), seed=0)
    seconds = time.perf_counter() - start
    n_images = sum(b[k].n_images for k in SPLIT_NAMES[:5])
    print(f"make_benchmark(scaled(10_000)): {seconds:.2f} s, {n_images} images")
    assert seconds <= 10.0


def test_full_setting_queries_are_the_test_split():
    # LightningDOT §4.3: the test split's captions and images query a gallery of every split
    bench = make_benchmark(SyntheticConfig(**SMALL), seed=0)
    full, test = bench["full"], bench["test"]
    assert full.n_text_queries == test.n_texts and full.n_image_queries == test.n_images
    assert [full.captions[t] for t in full.text_queries] == test.captions
    assert [full.image_ids[i] for i in full.image_queries] == test.image_ids
    assert np.array_equal(full.txt2img[full.text_queries], full.image_queries[test.txt2img])
    assert full.n_images == sum(bench[k].n_images for k in ("train", "val", "test"))
    # a bigger gallery can only make the ceiling lower: the oracle stays a
    # ceiling of the same queries
    ks = (5, 10, 20)
    full_oracle, test_oracle = oracle_ceiling(full, ks), oracle_ceiling(test, ks)
    assert all(full_oracle[k] <= test_oracle[k] + 1e-9 for k in full_oracle)
    # subsets keep the queries that survive, renumbered
    sub = full.subset(np.arange(full.n_images)[::-1])
    assert sub.n_text_queries == test.n_texts and sub.n_image_queries == test.n_images
    assert sorted(sub.captions[t] for t in sub.text_queries) == sorted(test.captions)
