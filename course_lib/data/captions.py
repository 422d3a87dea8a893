"""Captions of the synthetic benchmark: sampling meanings, wording them, deciding their truth.

A caption is sampled as a meaning (a `Meanings` row read off one scene, so true of it), then
worded with templates and synonyms. `satisfies` decides every caption's truth on every scene with
per-scene bitmasks of objects (fast enough for 12k scenes x 60k captions)."""

import numpy as np

from course_lib.core.metrics import hit_probability

from .scenes import COLORS, FAMILIES, GRID, SHAPES, SIZES, Meanings, Scenes

PAIR, RELATION, PLACE, COUNT, TERSE = range(len(FAMILIES))
SIZE_WORDS = (("small", "little", "tiny"), ("big", "large", "huge"))
SHAPE_WORDS = (("circle", "disc", "disk"), ("square", "box"), ("triangle",),
               ("diamond", "rhombus"), ("cross", "plus sign"), ("ring", "hoop", "donut"))
# "next to" is ambiguous: not used
RELATION_WORDS = (("left of", "to the left of", "on the left of"),
                  ("right of", "to the right of", "on the right of"),
                  ("above", "over", "on top of", "higher than"),
                  ("below", "under", "beneath", "underneath", "lower than"))
PLACE_WORDS = (  # one tuple per cell, row-major from the top left
    ("in the top left corner", "in the upper left corner", "at the top left"),
    ("at the top in the middle", "in the top middle", "in the middle of the top edge"),
    ("in the top right corner", "in the upper right corner", "at the top right"),
    ("on the left in the middle", "in the middle of the left edge", "in the left middle"),
    ("in the middle", "in the center", "in the centre"),
    ("on the right in the middle", "in the middle of the right edge", "in the right middle"),
    ("in the bottom left corner", "in the lower left corner", "at the bottom left"),
    ("at the bottom in the middle", "in the bottom middle", "in the middle of the bottom edge"),
    ("in the bottom right corner", "in the lower right corner", "at the bottom right"),
)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = {
    PAIR: ("{a} and {b}", "there is {a} and {b}", "{a} as well as {b}", "{a} along with {b}"),
    RELATION: ("{a} {rel} {b}", "{a} is {rel} {b}", "there is {a} {rel} {b}"),
    PLACE: ("{a} {place}", "{a} is {place}", "there is {a} {place}"),
    COUNT: ("{n} shapes one of them {a}", "{n} objects including {a}",
            "there are {n} things and one of them is {a}", "{a} among {n} shapes"),
}
COUNT_ONE = ("{a} alone", "{a} on its own")  # count == 1: "one shapes" is not English
COUNT_TWO = ("{n} shapes including {a} and {b}", "{n} objects among them {a} and {b}",
             "there are {n} things including {a} and {b}")  # count captions naming two objects
TERSE_PREFIXES = ("", "", "", "photo of", "image of", "stock photo", "picture with", "shapes")
TERSE_JOINERS = (" ", " ", " and ", " with ")
TERSE_ORDERS = ((0, 1, 2), (1, 0, 2), (2, 1, 0))  # word order of (size, colour, shape), terse
N_CHOICES = 9  # random integers drawn per caption for template and synonym choices


def _pick(options: tuple, choice: int):
    return options[choice % len(options)]


def _words(shape, color, size, ch_size, ch_shape, no_shape="") -> tuple[str, str, str]:
    """An object's (size, colour, shape) words; "" for an attribute of -1 (no_shape for shape)."""
    return (_pick(SIZE_WORDS[size], ch_size) if size >= 0 else "",
            COLORS[color] if color >= 0 else "",
            _pick(SHAPE_WORDS[shape], ch_shape) if shape >= 0 else no_shape)


def _phrase(shape: int, color: int, size: int, ch_det: int, ch_size: int, ch_shape: int) -> str:
    """'a small red circle' (an attribute of -1 is left out; 'one' for 'a' one time in five)."""
    words = " ".join(w for w in _words(shape, color, size, ch_size, ch_shape, "shape") if w)
    det = "one" if ch_det % 5 == 0 else ("an" if words[0] in "aeiou" else "a")
    return det + " " + words


def _terse_phrase(shape, color, size, ch_order, ch_size, ch_shape) -> str:
    """'red circle', 'big red circle', 'circle red' ...: no article, attributes in varied order."""
    words = _words(shape, color, size, ch_size, ch_shape)
    return " ".join(words[i] for i in _pick(TERSE_ORDERS, ch_order) if words[i])


def word_captions(meanings: Meanings, rng: np.random.Generator) -> list[str]:
    """The words of each meaning: random template and synonyms, lower case, no punctuation."""
    fields = [getattr(meanings, f).tolist() for f in Meanings.FIELDS[:-1]]
    choices = rng.integers(0, 1 << 30, size=(len(meanings), N_CHOICES)).tolist()
    out = []
    rows = zip(zip(*fields, strict=True), choices, strict=True)
    for (fam, a_s, a_c, a_z, b_s, b_c, b_z, rel, place, count), ch in rows:
        has_b = b_s >= 0 or b_c >= 0 or b_z >= 0
        if fam == TERSE:
            parts = [_terse_phrase(a_s, a_c, a_z, ch[1], ch[2], ch[3])]
            if has_b:
                parts.append(_terse_phrase(b_s, b_c, b_z, ch[4], ch[5], ch[6]))
                if ch[7] % 2:
                    parts.reverse()
            text, prefix = _pick(TERSE_JOINERS, ch[8]).join(parts), _pick(TERSE_PREFIXES, ch[0])
            out.append(f"{prefix} {text}" if prefix else text)
            continue
        fill = {"a": _phrase(a_s, a_c, a_z, ch[1], ch[2], ch[3]),
                "b": _phrase(b_s, b_c, b_z, ch[4], ch[5], ch[6]) if has_b else ""}
        templates = TEMPLATES[fam]
        if fam == RELATION:
            fill["rel"] = _pick(RELATION_WORDS[rel], ch[7])
        elif fam == PLACE:
            fill["place"] = _pick(PLACE_WORDS[place], ch[7])
        elif fam == COUNT:
            fill["n"] = NUMBER_WORDS[count]
            templates = COUNT_TWO if has_b else (COUNT_ONE if count == 1 else templates)
        out.append(_pick(templates, ch[0]).format(**fill))
    return out


def caption_vocabulary() -> list[str]:
    """Every word the generator can emit, sorted."""
    groups = (*SIZE_WORDS, *SHAPE_WORDS, *RELATION_WORDS, *PLACE_WORDS, *TEMPLATES.values(), COLORS,
              NUMBER_WORDS[1:], ("a an one shape",), COUNT_ONE, COUNT_TWO, TERSE_PREFIXES)
    return sorted({w for g in groups for t in g for w in t.split() if not w.startswith("{")})


def meanings_of(rng: np.random.Generator, scenes: Scenes, scene_idx, family, a_obj, b_obj,
                attribute_dropout: float = 0.0) -> Meanings:
    """Meanings read off the scenes, so each is true of its scene: caption t names object slot
    a_obj[t] (and b_obj[t] unless -1) of scene scene_idx[t]; size and colour are each left out
    with probability attribute_dropout."""
    s, a, b, family = (np.asarray(x, dtype=np.int64) for x in (scene_idx, a_obj, b_obj, family))
    T, has_b, b_safe = len(s), b >= 0, np.maximum(b, 0)
    drop = rng.random((T, 4)) < attribute_dropout  # a size, a colour, b size, b colour
    a_cell, b_cell = scenes.cell[s, a].astype(np.int64), scenes.cell[s, b_safe].astype(np.int64)
    (a_row, a_col), (b_row, b_col) = divmod(a_cell, GRID), divmod(b_cell, GRID)  # (T,) each
    true_rel = np.stack([a_col < b_col, a_col > b_col, a_row < b_row, a_row > b_row], axis=1)
    relation = np.argmax(true_rel * (1.0 + rng.random((T, 4))), axis=1)  # a random true relation
    relation = np.where((family == RELATION) & has_b, relation, -1)
    return _named(scenes, s, a, b, family, relation, drop.T)


def _named(scenes: Scenes, i, a, b, family, relation, drop) -> Meanings:
    """Meanings naming object a (and b unless -1) of scenes i, with the given family and relation
    (scalars or per row), dropping the attributes marked in drop = (a size, a colour, b size,
    b colour); place and count are read off the scene for place and count captions."""
    i, a, b, family = (np.asarray(x, dtype=np.int64) for x in (i, a, b, family))
    no_b, bs = b < 0, np.maximum(b, 0)
    pick = lambda f, o, off: np.where(off, -1, getattr(scenes, f)[i, o]).astype(np.int8)  # noqa: E731
    full = lambda v: np.full(len(i), v, dtype=np.int8)  # noqa: E731
    return Meanings(family=full(family), a_shape=pick("shape", a, False),
                    a_color=pick("color", a, drop[1]), a_size=pick("size", a, drop[0]),
                    b_shape=pick("shape", bs, no_b), b_color=pick("color", bs, no_b | drop[3]),
                    b_size=pick("size", bs, no_b | drop[2]), relation=full(relation),
                    place=pick("cell", a, family != PLACE),
                    count=full(np.where(family == COUNT, scenes.n_objects[i], -1)),
                    noisy=np.zeros(len(i), dtype=bool))


def two_objects(rng: np.random.Generator, n_objects, a=None) -> tuple[np.ndarray, np.ndarray]:
    """Two distinct random object slots per row (b = a when a scene has one object); only b is
    drawn when a is given."""
    n_objects = np.asarray(n_objects, dtype=np.int64)
    if a is None:
        a = np.floor(rng.random(len(n_objects)) * n_objects).astype(np.int64)
    other = np.floor(rng.random(len(n_objects)) * np.maximum(n_objects - 1, 1)).astype(np.int64)
    return a, (a + 1 + other) % n_objects


def terse_meanings(rng: np.random.Generator, scenes: Scenes, noise: float) -> Meanings:
    """One pre-training caption per scene, one or two objects with attributes often dropped; with
    probability `noise` a's colour or shape is wrong (noisy = True: the row records the words)."""
    n = len(scenes)
    a, b = two_objects(rng, scenes.n_objects)
    b = np.where((rng.random(n) < 0.6) & (scenes.n_objects >= 2), b, -1)
    m = meanings_of(rng, scenes, np.arange(n), np.full(n, TERSE), a, b)
    for obj in ("a", "b"):
        u = rng.random((n, 3))
        size, color, shape = (getattr(m, f"{obj}_{f}") for f in ("size", "color", "shape"))
        size[u[:, 0] < 0.5] = -1
        drop_color = u[:, 1] < 0.2
        color[drop_color] = -1
        shape[~drop_color & (u[:, 2] < 0.15)] = -1
    m.noisy = rng.random(n) < noise
    fix_color = m.noisy & (m.a_color >= 0) & ((m.a_shape < 0) | (rng.random(n) < 0.5))
    fix_shape = m.noisy & ~fix_color
    shift_c, shift_s = rng.integers(1, len(COLORS), n), rng.integers(1, len(SHAPES), n)
    m.a_color = np.where(fix_color, (m.a_color + shift_c) % len(COLORS), m.a_color).astype(np.int8)
    m.a_shape = np.where(fix_shape, (m.a_shape + shift_s) % len(SHAPES), m.a_shape).astype(np.int8)
    return m


# ---- truth -------------------------------------------------------------------------------------

def _relations(scenes: Scenes) -> np.ndarray:
    """bool (N, O, O, 4): relation r (RELATIONS) holds from object i to object j, both real."""
    row, col = scenes.cell // GRID, scenes.cell % GRID  # (N, O)
    rel = np.stack([col[:, :, None] < col[:, None, :], col[:, :, None] > col[:, None, :],
                    row[:, :, None] < row[:, None, :], row[:, :, None] > row[:, None, :]], axis=3)
    return rel & (scenes.valid[:, :, None] & scenes.valid[:, None, :])[..., None]


def _bit_tables(scenes: Scenes) -> dict[str, np.ndarray]:
    """Per scene, bitmasks of its objects (bit o = slot o). Per attribute (values + 1, N): row v =
    objects with value v, row -1 = all objects. rel (6, O, N): objects j with r(i, j); r = 4 is
    'any other object', r = 5 is 'i itself' (captions without b). diagonal (O, N): objects j in
    another row and column than i (two relations hold)."""
    n_slots = scenes.max_objects
    dtype = np.uint8 if n_slots <= 8 else np.uint16
    bit = (np.ones(n_slots, dtype=np.int64) << np.arange(n_slots)) * scenes.valid  # (N, O)
    out = {}
    for name, n_values in zip(("shape", "color", "size", "cell"),
                              (len(SHAPES), len(COLORS), len(SIZES), GRID * GRID), strict=True):
        values = getattr(scenes, name).astype(np.int64)
        onehot = values[None, :, :] == np.arange(n_values)[:, None, None]  # (V, N, O)
        table = (onehot * bit[None]).sum(axis=2)
        out[name] = np.concatenate([table, bit.sum(axis=1)[None]]).astype(dtype)  # (V + 1, N)
    pair = scenes.valid[:, :, None] & scenes.valid[:, None, :]  # (N, O, O)
    eye = np.eye(n_slots, dtype=bool)
    rel = _relations(scenes)
    diagonal = (rel[..., 0] | rel[..., 1]) & (rel[..., 2] | rel[..., 3])  # (N, O, O)
    rels = [*np.moveaxis(rel, 3, 0), pair & ~eye, pair & eye, diagonal]
    tables = np.stack([(r * bit[:, None, :]).sum(axis=2).T for r in rels]).astype(dtype)
    out["rel"], out["diagonal"] = tables[:6], tables[6]
    return out


def _relation_code(m: Meanings) -> np.ndarray:
    return np.where(m.relation >= 0, m.relation, np.where(m.has_b, 4, 5)).astype(np.int64)


def _partners(bits: dict, a_shape, a_color, a_size, place, rel, cols=slice(None)) -> np.ndarray:
    """Bitmask of the objects j in relation `rel` to an object matching a (rows x scenes)."""
    a = (bits["shape"][a_shape, cols] & bits["color"][a_color, cols] & bits["size"][a_size, cols]
         & bits["cell"][place, cols])  # objects matching a
    out = np.zeros_like(a)
    for i in range(bits["rel"].shape[1]):
        out |= ((a >> i) & 1) * bits["rel"][rel, i, cols]
    return out


def _b_mask(bits: dict, m: Meanings, rows, cols=slice(None)) -> np.ndarray:
    """Bitmask of the objects matching b (all objects when b is absent), as _partners."""
    return np.bitwise_and.reduce([bits[f][getattr(m, f"b_{f}")[rows].astype(np.int64), cols]
                                  for f in ("shape", "color", "size")])


def satisfies_rows(meanings: Meanings, scenes: Scenes) -> np.ndarray:
    """bool (T,): whether caption t is true of scene t (both tables have T rows)."""
    bits, m, idx = _bit_tables(scenes), meanings, np.arange(len(scenes))
    a = (x.astype(np.int64) for x in (m.a_shape, m.a_color, m.a_size, m.place))  # -1: all objects
    partners = _partners(bits, *a, _relation_code(m), idx)
    ok = (partners & _b_mask(bits, m, slice(None), idx)) != 0
    return ok & ((m.count < 0) | (m.count == scenes.n_objects))


def iter_satisfies(meanings: Meanings, scenes: Scenes, chunk: int = 2048):
    """Yield (start, block): bool (rows, N) satisfies of captions start..start+rows."""
    m, bits = meanings, _bit_tables(scenes)
    code = np.stack([m.a_shape, m.a_color, m.a_size, m.place, _relation_code(m)],
                    axis=1).astype(np.int64)
    keys, inverse = np.unique(code, axis=0, return_inverse=True)  # few distinct a-descriptors
    partners = _partners(bits, *keys.T)  # (U, N)
    for start in range(0, len(m), chunk):
        rows = slice(start, min(start + chunk, len(m)))
        block = (partners[inverse.reshape(-1)[rows]] & _b_mask(bits, m, rows)) != 0  # (rows, N)
        counted = np.flatnonzero(m.count[rows] >= 0)  # count captions: also the right count
        block[counted] &= m.count[rows][counted, None] == scenes.n_objects[None, :]
        yield start, block


def satisfies(meanings: Meanings, scenes: Scenes) -> np.ndarray:
    """bool (n_texts, n_images): whether each caption is true of each scene (ground truth)."""
    out = np.empty((len(meanings), len(scenes)), dtype=bool)
    for start, block in iter_satisfies(meanings, scenes):
        out[start:start + len(block)] = block
    return out


def truth_ceiling(split, ks=(1, 5, 10)) -> dict[str, float]:
    """Expected R@K (percent) of the truth-only ranker: every item satisfying the query first,
    ties broken at random. NOT an upper bound (oracle_ceiling is): a model that learns how specific
    a caption is beats it, above all on i2t.
    t2i: caption c is true of m_c images including its own: R@K = min(1, K / m_c). i2t: image i
    satisfies s_i captions, g_i of them its own: R@K = 1 - C(s_i - g_i, K) / C(s_i, K)."""
    m, scenes, txt2img = split.meanings, split.scenes, split.txt2img
    T, N = len(m), len(scenes)
    own = satisfies_rows(m, scenes.take(txt2img))  # (T,)
    per_text = np.zeros(T, dtype=np.int64)  # m_c: images satisfying caption c
    per_image = np.zeros(N, dtype=np.int64)  # s_i: captions satisfied by image i
    for start, block in iter_satisfies(m, scenes):
        per_text[start:start + len(block)] = block.sum(axis=1)
        per_image += block.sum(axis=0)
    good = np.bincount(txt2img, weights=own, minlength=N)  # g_i
    bad = np.bincount(txt2img, weights=~own, minlength=N)  # own captions the image does not satisfy
    out = {}
    for k in ks:
        late_k = np.maximum(k - per_text, 0)  # slots left after every satisfying image
        t2i = np.where(own, np.minimum(1.0, k / np.maximum(per_text, 1)),
                       np.minimum(1.0, late_k / np.maximum(N - per_text, 1)))
        i2t = np.where(good > 0, hit_probability(per_image, good, k), 0.0)
        for i in np.flatnonzero((good == 0) & (bad > 0)):  # rare: only noisy captions of its own
            left = k - per_image[i]
            i2t[i] = hit_probability(T - per_image[i], bad[i], left) if left > 0 else 0.0
        has_text = (good + bad) > 0
        if split.query_images is not None:  # the full setting: only the test images query
            has_text &= np.isin(np.arange(N), split.query_images)
        t2i = t2i[split.text_queries]
        out[f"t2i_r{k}"] = 100.0 * float(t2i.mean()) if len(t2i) else float("nan")
        out[f"i2t_r{k}"] = 100.0 * float(i2t[has_text].mean()) if has_text.any() else float("nan")
    return out
