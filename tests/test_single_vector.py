"""The bag-of-objects reference: its vectors on hand-worked scenes and captions, expected recall
with ties against a loop over shuffles, and the identity that no ranking beats the oracle."""

import numpy as np
import pytest

from course_lib.core.metrics import expected_hits, hit_probability
from course_lib.data.bag_of_objects import (
    N_CELLS,
    N_KINDS,
    image_vectors,
    kind_of,
    random_projection,
    text_vectors,
)
from course_lib.data.captions import COUNT, PAIR, PLACE, RELATION
from course_lib.data.oracle import oracle_ceiling
from course_lib.data.scenes import Meanings, Scenes
from course_lib.studies import single_vector

BENCH_SIZES = dict(n_train=20, n_val=10, n_test=60, n_pretrain=10, n_compositional=10)


def scenes(*objects_per_scene, max_objects=3):
    """Scenes from lists of (shape, colour, size, cell) tuples."""
    pad = lambda values: values + [-1] * (max_objects - len(values))  # noqa: E731
    rows = {f: [] for f in ("shape", "color", "size", "cell")}
    for objects in objects_per_scene:
        for i, f in enumerate(rows):
            rows[f].append(pad([o[i] for o in objects]))
    return Scenes(**{f: np.array(v, np.int8) for f, v in rows.items()},
                  n_objects=np.array([len(o) for o in objects_per_scene], np.int8))


def meanings(*rows):
    """Meanings from dicts of what a caption says (family, a_*, b_*, relation, place, count)."""
    fields = [f for f in Meanings.FIELDS if f != "noisy"]
    table = {f: np.array([r.get(f, -1) for r in rows], np.int8) for f in fields}
    return Meanings(**table, noisy=np.zeros(len(rows), bool))


def test_vectors_of_a_hand_worked_scene_and_captions():
    # scene 0: a small red circle (shape 0, colour 0, size 0) in cell 4 and a
    # big blue square in cell 0
    images = image_vectors(scenes([(0, 0, 0, 4), (1, 2, 1, 0)], [(0, 0, 1, 4)]))
    circle, square = kind_of(0, 0, 0), kind_of(1, 2, 1)
    assert images[0, [circle, square]].tolist() == [1, 1] and images[0, :N_KINDS].sum() == 2
    assert (images[0, N_KINDS + circle * N_CELLS + 4] == 1
            and images[0, N_KINDS:N_KINDS * (1 + N_CELLS)].sum() == 2)
    assert (images[0, N_KINDS * (1 + N_CELLS) + 2] == 1
            and images[1, N_KINDS * (1 + N_CELLS) + 1] == 1)
    # "a red circle" of any size
    captions = meanings({"family": PAIR, "a_shape": 0, "a_color": 0},
                        {"family": PLACE, "a_shape": 0, "a_color": 0, "a_size": 0, "place": 4},
                        {"family": RELATION, "a_shape": 0, "b_shape": 1, "b_color": 2, "b_size": 1,
                         "a_color": 0, "a_size": 0, "relation": 0},
                        {"family": COUNT, "a_shape": 1, "a_color": 2, "a_size": 1, "count": 2})
    texts = text_vectors(captions, 3)
    scores = images @ texts.T  # (2 scenes, 4 captions)
    # half of the weight on each size: both scenes hold half
    assert scores[:, 0].tolist() == [0.5, 0.5]
    assert scores[:, 1].tolist() == [1.0, 0.0]  # the small red circle in the centre: scene 0 only
    assert scores[:, 2].tolist() == [2.0, 0.0]  # both objects; the relation adds nothing
    assert scores[:, 3].tolist() == [2.0, 0.0]  # the square and the count of two
    assert texts[0].sum() == pytest.approx(1.0) and texts[2].sum() == pytest.approx(2.0)


def shuffled_hits(images, texts, txt2img, k, direction, rng, trials=4000):
    """The same probability by brute force: random tie-breaking jitter, ranks counted, averaged."""
    scores = images @ texts.T  # (N, T)
    hits = []
    for q in range(len(texts) if direction == "t2i" else len(images)):
        n = 0
        for _ in range(trials):
            if direction == "t2i":
                jittered = scores[:, q] + rng.random(len(images)) * 1e-6
                n += (jittered > jittered[txt2img[q]]).sum() < k
            else:
                jittered = scores[q] + rng.random(len(texts)) * 1e-6
                best = jittered[txt2img == q].max()
                n += (jittered > best).sum() < k
        hits.append(n / trials)
    return np.array(hits)


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_expected_hits_match_random_tie_breaking(direction):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 2, (6, 3)).astype(float)  # few distinct values: many ties
    texts = rng.integers(0, 2, (12, 3)).astype(float)
    txt2img = np.repeat(np.arange(6), 2)
    for k in (1, 2, 4):
        want = shuffled_hits(images, texts, txt2img, k, direction, rng)
        got = expected_hits(images, texts, txt2img, k, direction, chunk=5)
        np.testing.assert_allclose(got, want, atol=0.03)
    assert (hit_probability(4, 1, 1) == pytest.approx(0.25)
            and hit_probability(4, 2, 2) == pytest.approx(5 / 6))


def test_no_single_vector_beats_the_oracle(bench):
    for split in (bench["test"], bench["full"]):
        reference, oracle = single_vector.reference_metrics(split), oracle_ceiling(split)
        for key in ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5"):
            assert 0 < reference[key] <= oracle[key] + 1e-6, (split.name, key)


def test_family_table_and_projection(bench):
    rows = single_vector.recall_by_family_and_width(bench["test"], widths=(None, 16, 512))
    assert rows[-1]["family"] == "all" and rows[-1]["captions"] == bench["test"].n_texts
    assert sum(r["captions"] for r in rows[:-1]) == rows[-1]["captions"]
    assert rows[-1][16] < rows[-1][None]  # 16 numbers cannot hold 966 dimensions' distinctions
    assert abs(rows[-1][512] - rows[-1][None]) < 10
    assert "t2i R@1 exact" in single_vector.family_table(rows)
    images = image_vectors(bench["test"].scenes)
    texts = text_vectors(bench["test"].meanings, bench["test"].scenes.max_objects)
    pi, pt = random_projection(images, texts, 4096, seed=1)
    exact, projected = images @ texts[:50].T, pi @ pt[:50].T
    # dot products kept in expectation
    assert np.corrcoef(exact.ravel(), projected.ravel())[0, 1] > 0.9
