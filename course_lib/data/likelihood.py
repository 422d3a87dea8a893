"""P(caption | scene) under the generator's own caption process, which the oracle ceiling
(course_lib.data.oracle) ranks by.

Standard splits: P(meaning | scene) = P(f) * drop(meaning) * words(meaning) * K(meaning, scene),
with a uniform over the n objects, b over the other n - 1, a relation uniform among those true:
  pair:     K = #{(a, b) ordered, a != b, a matches A, b matches B} / (n (n - 1))
  relation: K = sum over those pairs with the relation true of 1 / #relations true of (a, b),
            / (n (n - 1))
  place:    K = [the object in that cell matches A] / n
            (times (w_place + w_pair + w_relation) / w_place if n = 1)
  count:    K = [count = n] #{a matching A} / n, or with b: [count = n] #{(a, b)} / (n (n - 1))
P(f), drop = p^dropped (1 - p)^kept and words(meaning) do not depend on the scene, so they cancel
in t2i and in i2t (the posterior divides L[t, :] by its own sum). `caption_likelihood` returns
L = 5040 * K (5040 = lcm of 2 n (n - 1) and 2 n for n <= 9: integers, exact ties). Not modelled:
the redrawing of repeated captions, and the dependence between an image's 5 captions in i2t.

Compositional split: a is one of the two swapped objects, b the other with prob. 1/2 + 1/(2(n - 1))
and each other object with 1/(2(n - 1)); a draw is rejected unless false of the twin (attempts
0-19 with the config's families, later ones relation/place 1:1). The likelihood is that proposal
renormalised by the per-image acceptance probability, mixed over the two regimes; it ignores the
preference for words unlike the image's other captions. It reads info["twin_of"] and
info["swapped_objects"], so it bounds models that compare gallery images."""

import numpy as np

from .captions import (
    COUNT,
    PAIR,
    PLACE,
    RELATION,
    TERSE,
    _b_mask,
    _bit_tables,
    _named,
    _relation_code,
    _relations,
    iter_satisfies,
    satisfies,
    satisfies_rows,
)
from .scenes import Meanings, Scenes
from .synthetic import FAMILY_CODES, SyntheticConfig

SCALE = 5040  # lcm over n <= 9 of 2 n (n - 1) and 2 n: K * SCALE is an integer
_POPCOUNT = np.array([bin(x).count("1") for x in range(1 << 16)], dtype=np.int64)
_ATTEMPTS = (20, 200)  # compositional: attempts with the config's families, attempts in all


def _params(config) -> dict:
    """Family weights (by code), count_objects, attribute_dropout of a config, its dict or None."""
    if not isinstance(config, dict):
        config = (config or SyntheticConfig()).to_dict()
    weights = {code: 0.0 for code in FAMILY_CODES.values()}
    weights.update({FAMILY_CODES[name]: float(w) for name, w in config["caption_families"].items()})
    return {"weights": weights, "count_objects": int(config["count_objects"]),
            "attribute_dropout": float(config["attribute_dropout"])}


def _snap(x: np.ndarray) -> np.ndarray:
    """Round to 40 mantissa bits, so values equal up to float rounding tie exactly."""
    mant, exp = np.frexp(x)
    return np.ldexp(np.round(np.ldexp(mant, 40)), exp - 40)


def dropout_factor(meanings: Meanings, attribute_dropout: float) -> np.ndarray:
    """(T,) p^dropped * (1 - p)^kept over the sizes and colours named: P(dropout pattern)."""
    m, p, has_b = meanings, attribute_dropout, meanings.has_b
    dropped = ((m.a_size < 0).astype(int) + (m.a_color < 0)
               + has_b * ((m.b_size < 0).astype(int) + (m.b_color < 0)))
    return p ** dropped * (1 - p) ** (2 + 2 * has_b - dropped)


def scene_free_factor(meanings: Meanings, config=None) -> np.ndarray:
    """(T,) P(family) * dropout_factor: what caption_likelihood leaves out, besides the words.
    For place captions P(family) is the weight on scenes with >= 2 objects (see _values_at)."""
    par, m = _params(config), meanings
    w = par["weights"]
    total = sum(w.values())
    p_family = np.array([w.get(int(f), 0.0) for f in m.family], dtype=np.float64) / total
    if w[PLACE] <= 0:  # place captions then only come from 1-object scenes: the reference weight
        p_family[m.family == PLACE] = (w[PAIR] + w[RELATION]) / total
    return p_family * dropout_factor(m, par["attribute_dropout"])


def _structure_ok(m: Meanings) -> np.ndarray:
    """(T,) whether the generator can produce a meaning of this form at all (any scene)."""
    has_b, rel, place, count = m.has_b, m.relation >= 0, m.place >= 0, m.count >= 0
    fam = m.family
    return (((fam == PAIR) & has_b & ~rel & ~place & ~count)
            | ((fam == RELATION) & has_b & rel & ~place & ~count)
            | ((fam == PLACE) & ~has_b & ~rel & place & ~count)
            | ((fam == COUNT) & ~rel & ~place & count)
            ) & (m.a_shape >= 0) & (~has_b | (m.b_shape >= 0))


def _values_at(m: Meanings, scenes: Scenes, bits: dict, par: dict,
               ok: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """SCALE * K(meaning rows[e], scene cols[e]) for each entry e (see the module docstring)."""
    f = lambda x: x[rows].astype(np.int64)  # noqa: E731  (-1 indexes the 'all objects' row)
    A = (bits["shape"][f(m.a_shape), cols] & bits["color"][f(m.a_color), cols]
         & bits["size"][f(m.a_size), cols] & bits["cell"][f(m.place), cols]).astype(np.int64)
    B = _b_mask(bits, m, rows, cols).astype(np.int64)
    code = _relation_code(m)[rows]
    directed = (code < 4).astype(np.int64)
    twice = np.zeros(len(rows), dtype=np.int64)  # 2 * sum over (a, b) of P(relation | a, b)
    for o in range(scenes.max_objects):
        rb = bits["rel"][code, o, cols].astype(np.int64) & B
        twice += ((A >> o) & 1) * (2 * _POPCOUNT[rb]
                                   - directed * _POPCOUNT[rb & bits["diagonal"][o, cols]])
    n, has_b, fam = scenes.n_objects[cols].astype(np.int64), m.has_b[rows], m.family[rows]
    denom = np.where(has_b, 2 * n * (n - 1), 2 * n)
    value = (twice * (SCALE // np.maximum(denom, 1))).astype(np.float64)
    # a place caption's weight on a scene with >= 2 objects (w_place) and on a 1-object scene
    # (pair and relation draws fall back to place there), relative to the first (the reference)
    w = par["weights"]
    small = w[PLACE] + w[PAIR] + w[RELATION]
    ref = w[PLACE] if w[PLACE] > 0 else (small if small > 0 else 1.0)
    factor = np.where(fam == PLACE, np.where(n < 2, small / ref, w[PLACE] / ref), 1.0)
    count_ok = np.where(has_b, (par["count_objects"] == 2) & (n >= 2),
                        (par["count_objects"] == 1) | (n < 2))
    factor = np.where(fam == COUNT, factor * (count_ok & (m.count[rows] == n)), factor)
    return _snap(value * factor * ok[rows])


def _iter_sparse(meanings: Meanings, scenes: Scenes, config=None, chunk: int = 2048):
    """Yield (start, n_rows, rows, cols, values): the nonzero entries of captions start.."""
    m = meanings
    if (m.family == TERSE).any():
        raise ValueError("caption_likelihood covers the pair/relation/place/count families, not "
                         "terse captions")
    par, bits = _params(config), _bit_tables(scenes)
    ok, N = _structure_ok(m), len(scenes)
    for start, block in iter_satisfies(m, scenes, chunk):
        flat = np.flatnonzero(block)
        rows, cols = start + flat // N, flat % N
        values = _values_at(m, scenes, bits, par, ok, rows, cols)
        keep = values > 0
        yield start, len(block), rows[keep], cols[keep], values[keep]


def iter_caption_likelihood(meanings: Meanings, scenes: Scenes, config=None, chunk: int = 2048):
    """Yield (start, block): float64 (rows, N) caption_likelihood of captions start..start+rows."""
    for start, n_rows, rows, cols, values in _iter_sparse(meanings, scenes, config, chunk):
        block = np.zeros((n_rows, len(scenes)))
        block[rows - start, cols] = values
        yield start, block


def caption_likelihood(meanings: Meanings, scenes: Scenes, config=None) -> np.ndarray:
    """float64 (n_texts, n_images): 5040 * P(meaning_t | scene_i) / scene_free_factor(meaning_t)
    under the standard generator with `config` (a SyntheticConfig, its dict, or None)."""
    out = np.zeros((len(meanings), len(scenes)))
    for start, block in iter_caption_likelihood(meanings, scenes, config):
        out[start:start + len(block)] = block
    return out


# ---- compositional ---------------------------------------------------------------------------

def _acceptance(scenes: Scenes, twin_of, swapped, p_drop: float) -> np.ndarray:
    """(N, 3) per image and family (pair, relation, place): the probability that the family's
    proposal draws a caption false of the twin (enumerating a, b, relation and dropout)."""
    N, n_slots, n = len(scenes), scenes.max_objects, scenes.n_objects.astype(np.int64)
    rel = _relations(scenes)  # (N, O, O, 4)
    n_true, img = rel.sum(axis=3), np.arange(N)  # (N, O, O), (N,)
    # the 16 dropout patterns, columns: a size, a colour, b size, b colour
    drops = np.array([[(d >> k) & 1 for k in range(4)] for d in range(16)], dtype=bool)
    parts, where = [], []  # candidate meanings; (image, family column, probability) of each
    for k in (0, 1):
        a, partner = swapped[:, k], swapped[:, 1 - k]
        cases = [(PLACE, -1, -1, np.full(N, 0.5))]
        for o in range(n_slots):
            p_b = 0.5 * (0.5 / np.maximum(n - 1, 1) + 0.5 * (o == partner)) * ((o != a) & (o < n))
            cases.append((PAIR, o, -1, p_b))
            cases += [(RELATION, o, r, p_b * rel[img, a, o, r] / np.maximum(n_true[img, a, o], 1))
                      for r in range(4)]
        for fam, o, r, prob in cases:
            live = np.flatnonzero(prob > 0)
            for drop in drops[:16 if o >= 0 else 4]:
                p_drop_pattern = np.prod(np.where(drop, p_drop, 1 - p_drop)[:4 if o >= 0 else 2])
                parts.append(_named(scenes, live, a[live], np.full(len(live), o), fam, r, drop))
                column = np.full(len(live), (PAIR, RELATION, PLACE).index(fam))
                where.append((live, column, prob[live] * p_drop_pattern))
    m = Meanings.concatenate(parts)
    image, column, prob = (np.concatenate([w[j] for w in where]) for j in range(3))
    accept = ~satisfies_rows(m, scenes.take(twin_of[image]))
    out = np.zeros((N, 3))
    np.add.at(out, (image, column), prob * accept)
    return out


def compositional_likelihood(meanings: Meanings, scenes: Scenes, twin_of, swapped,
                             config=None) -> np.ndarray:
    """float64 (n_texts, n_images): P(meaning_t | image i) / drop(meaning_t) under the
    compositional generator. swapped: (n_images, 2) the swapped object slots of each image."""
    par, m = _params(config), meanings
    if not np.isin(m.family, (PAIR, RELATION, PLACE)).all():
        raise ValueError("compositional captions are pair, relation or place captions")
    twin_of, swapped = np.asarray(twin_of, dtype=np.int64), np.asarray(swapped, dtype=np.int64)
    N, n_slots, n = len(scenes), scenes.max_objects, scenes.n_objects.astype(np.int64)
    rel = _relations(scenes)  # (N, O, O, 4)
    n_true, img = rel.sum(axis=3), np.arange(N)  # (N, O, O), (N,)
    sh, co, sz, ce = (getattr(scenes, f).astype(np.int64)
                      for f in ("shape", "color", "size", "cell"))
    col = lambda x: x.astype(np.int64)[:, None]  # noqa: E731
    matches = lambda s, c, z, j, o: (  # noqa: E731
        (col(s) == sh[j, o]) & ((col(c) < 0) | (col(c) == co[j, o]))
        & ((col(z) < 0) | (col(z) == sz[j, o])))
    r_safe, is_rel = np.maximum(m.relation.astype(np.int64), 0), col(m.relation) >= 0
    q = np.zeros((len(m), N))
    for k in (0, 1):
        a, partner = swapped[:, k], swapped[:, 1 - k]
        a_ok = (matches(m.a_shape, m.a_color, m.a_size, img, a)
                & ((col(m.place) < 0) | (col(m.place) == ce[img, a])))
        inner = np.zeros((len(m), N))
        for o in range(n_slots):
            p_b = (0.5 / np.maximum(n - 1, 1) + 0.5 * (o == partner)) * ((o != a) & (o < n))
            w_rel = (rel[img, a, o] / np.maximum(n_true[img, a, o], 1)[:, None]).T[r_safe]  # (T, N)
            b_ok = matches(m.b_shape, m.b_color, m.b_size, img, np.full(N, o))
            inner += b_ok * p_b * np.where(is_rel, w_rel, 1.0)
        q += 0.5 * a_ok * np.where(col(m.family) == PLACE, 1.0, inner)
    q *= _structure_ok(m)[:, None]
    q *= ~satisfies(m, scenes)[:, twin_of]  # rejected unless false of the twin
    # (3,) the proposal's probabilities of pair, relation, place (codes 0-2): first, fallback
    w = [par["weights"][f] for f in (PAIR, RELATION, PLACE)]
    first = np.array(w) / sum(w) if sum(w) > 0 else np.full(3, 1 / 3)
    fallback = np.array([0.0, 0.5, 0.5])
    acc = _acceptance(scenes, twin_of, swapped, par["attribute_dropout"])  # (N, 3)
    z1, z2 = acc @ first, acc @ fallback
    n1, n_all = _ATTEMPTS
    stay = (1 - z1) ** n1  # no acceptance in the first regime
    late = stay * (1 - (1 - z2) ** (n_all - n1))  # accepted in the fallback regime
    total = (1 - stay) + late
    g1 = np.where(z1 > 0, (1 - stay) / np.maximum(z1, 1e-300), 0.0) / total
    g2 = np.where(z2 > 0, late / np.maximum(z2, 1e-300), 0.0) / total
    p1, p2 = first[m.family][:, None], fallback[m.family][:, None]
    return _snap(q * (p1 * g1[None] + p2 * g2[None]))
