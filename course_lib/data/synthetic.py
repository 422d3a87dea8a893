"""The synthetic image-caption benchmark (docs/data.md): configuration and entry points.

    cfg = SyntheticConfig.for_course()   # smoke sizes under COURSE_SMOKE=1, else defaults
    bench = make_benchmark(cfg, seed=0)  # train, val, test, pretrain, compositional, full
    oracle_ceiling(bench["test"])        # the best R@K any model could reach (data.oracle)

Each split has its own random stream (SeedSequence(seed) spawned by split name), so changing
n_train leaves the test split unchanged. Every caption is true of its image except the noisy
pre-training ones (`meanings.noisy`). The compositional gallery interleaves base scenes and their
counterfactual twins (images 2i and 2i + 1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from course_lib.core.settings import smoke_mode

from .captions import (
    COUNT,
    PAIR,
    PLACE,
    RELATION,
    meanings_of,
    satisfies_rows,
    terse_meanings,
    two_objects,
    word_captions,
)
from .render import detect_regions, render_pixels, sample_offsets
from .scenes import GRID, Meanings, Scenes, sample_scenes
from .split import RetrievalSplit, concatenate

SPLITS = ("train", "val", "test", "pretrain", "compositional")  # order fixes each split's stream
FAMILY_CODES = {"pair": PAIR, "relation": RELATION, "place": PLACE, "count": COUNT}


@dataclass
class SyntheticConfig:
    """Sizes and knobs of the benchmark. The defaults are calibrated so that a cross-attention
    model clearly beats a one-vector dual encoder on t2i R@1 at far more cost per query: 4-5
    objects per scene (one pooled vector must answer many partial descriptions), captions weighted
    to the two-object `relation` family (only a model looking at both objects can check it), and
    little attribute dropout (more lowers the ceiling quickly)."""

    n_train: int = 10_000
    n_val: int = 1_000
    n_test: int = 1_000
    n_pretrain: int = 20_000
    n_compositional: int = 500  # base scenes; the gallery holds each with its twin (2x images)
    captions_per_image: int = 5
    min_objects: int = 4
    max_objects: int = 5
    image_size: int = 32  # 32 or 64 (anything >= 18 works)
    pixel_noise: float = 0.03  # std of pixel noise, fraction of full scale
    clutter: float = 0.0  # mean number of grey clutter specks per image
    region_dim: int = 64
    region_noise: float = 0.1  # std of the Gaussian noise on region features
    clutter_regions: int = 0  # false-positive detector regions per image
    caption_families: dict = field(
        default_factory=lambda: {"relation": 0.5, "pair": 0.2, "place": 0.2, "count": 0.1})
    count_objects: int = 1  # objects a counting caption names: 1 ("four shapes one of them") or 2
    attribute_dropout: float = 0.02  # chance a caption leaves out an object's size (or colour)
    pretrain_caption_noise: float = 0.1  # chance a pre-training caption names a wrong colour/shape

    def __post_init__(self):
        if not 1 <= self.min_objects <= self.max_objects <= GRID * GRID:
            raise ValueError("need 1 <= min_objects <= max_objects <= 9, "
                             f"got {self.min_objects}, {self.max_objects}")
        weights = self.caption_families.values()
        if set(self.caption_families) - set(FAMILY_CODES) or sum(weights) <= 0 or min(weights) < 0:
            raise ValueError(f"caption_families: non-negative weights over {sorted(FAMILY_CODES)}, "
                             f"got {self.caption_families}")
        if self.count_objects not in (1, 2):
            raise ValueError(f"count_objects must be 1 or 2, got {self.count_objects}")
        if min(self.n_train, self.n_val, self.n_test, self.n_pretrain, self.n_compositional) < 0:
            raise ValueError("split sizes must be >= 0")

    @property
    def max_regions(self) -> int:
        return self.max_objects + self.clutter_regions

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def smoke(cls, **overrides) -> SyntheticConfig:
        """Tiny sizes for CI and quick checks; same code path."""
        sizes = dict(n_train=600, n_val=100, n_test=100, n_pretrain=800, n_compositional=50)
        return cls(**{**sizes, **overrides})

    @classmethod
    def for_course(cls, **overrides) -> SyntheticConfig:
        """smoke() when COURSE_SMOKE is set, else the defaults."""
        return cls.smoke(**overrides) if smoke_mode() else cls(**overrides)

    @classmethod
    def scaled(cls, n_scenes: int, **overrides) -> SyntheticConfig:
        """n_scenes split 10:1:1 over train/val/test; pretrain 2n; compositional n_test // 2."""
        n_eval = max(1, n_scenes // 12)
        sizes = dict(n_train=max(1, n_scenes - 2 * n_eval), n_val=n_eval, n_test=n_eval,
                     n_pretrain=2 * n_scenes, n_compositional=max(1, n_eval // 2))
        return cls(**{**sizes, **overrides})


def _streams(seed: int, split: str | int) -> list[np.random.Generator]:
    """Generators (scenes, pixels and regions, captions) of a split name or spawn key."""
    key = split if isinstance(split, int) else SPLITS.index(split)
    seq = np.random.SeedSequence(seed, spawn_key=(key,))
    return [np.random.default_rng(s) for s in seq.spawn(3)]


def _set_rows(table, rows, new) -> None:
    for f in table.FIELDS:
        getattr(table, f)[rows] = getattr(new, f)


def _family_sampler(cfg: SyntheticConfig, allowed=tuple(FAMILY_CODES)):
    """A function (rng, n) -> n family codes drawn with the config's weights, among `allowed`."""
    weights = {k: v for k, v in cfg.caption_families.items() if k in allowed and v > 0}
    if not weights:  # e.g. a count-only config asked for compositional captions
        weights = {k: 1.0 for k in allowed}
    codes = np.array([FAMILY_CODES[k] for k in weights])
    p = np.array(list(weights.values()), dtype=np.float64)
    return lambda rng, n: codes[rng.choice(len(codes), size=n, p=p / p.sum())]


def _objects_for(rng, scenes: Scenes, scene_idx, family, a=None, two_families=(PAIR, RELATION)):
    """(family, a, b): b != a for two-object families (place on a 1-object scene), else -1."""
    n_objects = scenes.n_objects[scene_idx]
    two = np.isin(family, two_families) & (n_objects >= 2)
    family = np.where(np.isin(family, (PAIR, RELATION)) & ~two, PLACE, family)
    rand_a, b = two_objects(rng, n_objects)
    if a is None:
        a = rand_a
    else:  # another random object than the given a
        b = two_objects(rng, n_objects, a)[1]
    return family, a, np.where(two, b, -1)


def _split_captions(rng, scenes: Scenes, cfg: SyntheticConfig) -> tuple[Meanings, list[str]]:
    """captions_per_image true captions per scene; an image's repeats redrawn (up to 5 times)."""
    per, draw_family = cfg.captions_per_image, _family_sampler(cfg)

    def draw(rows):
        scene_idx = rows // per
        two = (PAIR, RELATION, COUNT) if cfg.count_objects == 2 else (PAIR, RELATION)
        family, a, b = _objects_for(rng, scenes, scene_idx, draw_family(rng, len(rows)),
                                    two_families=two)
        m = meanings_of(rng, scenes, scene_idx, family, a, b, cfg.attribute_dropout)
        return m, word_captions(m, rng)

    meanings, texts = draw(np.arange(len(scenes) * per))
    for _ in range(5):
        repeats = np.array([t for t in range(len(texts)) if texts[t] in texts[t - t % per:t]],
                           dtype=np.int64)
        if not len(repeats):
            break
        new_m, new_texts = draw(repeats)
        _set_rows(meanings, repeats, new_m)
        for t, text in zip(repeats.tolist(), new_texts, strict=True):
            texts[t] = text
    return meanings, texts


def _to_split(name, scenes, meanings, texts, txt2img, rng, cfg, seed, offsets=None,
              image_ids=None, info=None):
    if offsets is None:
        offsets = sample_offsets(rng, scenes, cfg.image_size)
    images, object_boxes = render_pixels(scenes, offsets, rng, cfg.image_size, cfg.pixel_noise,
                                         cfg.clutter)
    det = detect_regions(scenes, object_boxes, rng, cfg.region_dim, cfg.region_noise,
                         cfg.clutter_regions)
    return RetrievalSplit(
        name=name, captions=texts, txt2img=txt2img,
        image_ids=image_ids or [f"{name}_{i:06d}" for i in range(len(scenes))],
        images=images, regions=det["regions"], boxes=det["boxes"], region_mask=det["region_mask"],
        region_classes=det["region_classes"], scenes=scenes, meanings=meanings,
        info={"config": cfg.to_dict(), "seed": seed, "split": name, **(info or {})})


def _make_split(name: str, n: int, cfg: SyntheticConfig, seed: int, stream=None) -> RetrievalSplit:
    rng_scenes, rng_pixels, rng_text = _streams(seed, name if stream is None else stream)
    scenes = sample_scenes(rng_scenes, n, cfg.min_objects, cfg.max_objects)
    if name == "pretrain":
        meanings = terse_meanings(rng_text, scenes, cfg.pretrain_caption_noise)
        texts, txt2img = word_captions(meanings, rng_text), np.arange(n)
        info = {"n_noisy_captions": int(meanings.noisy.sum())}
    else:
        meanings, texts = _split_captions(rng_text, scenes, cfg)
        txt2img, info = np.repeat(np.arange(n), cfg.captions_per_image), None
    return _to_split(name, scenes, meanings, texts, txt2img, rng_pixels, cfg, seed, info=info)


def _choose_swaps(rng, scenes: Scenes) -> tuple[np.ndarray, np.ndarray]:
    """Per scene a swap kind (0 = colours, 1 = cells) and two object slots whose swap changes it."""
    kinds, pairs = np.zeros(len(scenes), dtype=np.int64), np.zeros((len(scenes), 2), dtype=np.int64)
    for i in range(len(scenes)):
        k = int(scenes.n_objects[i])
        desc = list(zip(scenes.shape[i, :k], scenes.color[i, :k], scenes.size[i, :k], strict=True))
        pairs_i = list(combinations(range(k), 2))
        cand = ([(p, q) for p, q in pairs_i if desc[p][1] != desc[q][1]],
                [(p, q) for p, q in pairs_i if desc[p] != desc[q]])
        kind = int(rng.random() < 0.5)
        if not cand[kind]:
            kind = 1 - kind  # the caller guarantees the cell-swap list is never empty
        kinds[i], pairs[i] = kind, cand[kind][rng.integers(len(cand[kind]))]
    return kinds, pairs


def _make_compositional(cfg: SyntheticConfig, seed: int) -> RetrievalSplit:
    """Base scenes (images 2i) and twins with two objects' colours or cells swapped (2i + 1), each
    captioned true of it and false of its twin, naming a swapped object."""
    rng_scenes, rng_pixels, rng_text = _streams(seed, "compositional")
    n, per = cfg.n_compositional, cfg.captions_per_image
    lo, hi = max(2, cfg.min_objects), max(2, cfg.max_objects)
    base = sample_scenes(rng_scenes, n, lo, hi)
    while True:  # every scene needs two objects that differ (all identical is rare: redraw it)
        same = [(a == a[:, :1]) | ~base.valid for a in (base.shape, base.color, base.size)]
        redo = np.flatnonzero((same[0] & same[1] & same[2]).all(axis=1))
        if not len(redo):
            break
        _set_rows(base, redo, sample_scenes(rng_scenes, len(redo), lo, hi))
    kinds, pairs = _choose_swaps(rng_scenes, base)
    twin = base.take(np.arange(n))
    for kind, name in ((0, "color"), (1, "cell")):
        r = np.flatnonzero(kinds == kind)
        arr = getattr(twin, name)
        arr[r, pairs[r, 0]], arr[r, pairs[r, 1]] = arr[r, pairs[r, 1]], arr[r, pairs[r, 0]]
    def interleave(a, b):
        return np.stack([a, b], axis=1).reshape((2 * len(a),) + a.shape[1:])
    gallery = Scenes(**{f: interleave(getattr(base, f), getattr(twin, f)) for f in Scenes.FIELDS})
    offsets = sample_offsets(rng_pixels, base, cfg.image_size)
    offsets = interleave(offsets, offsets)  # an object keeps its stamp offset in its twin
    twin_of = np.arange(2 * n) ^ 1
    swapped = np.repeat(pairs, 2, axis=0)  # (2n, 2) the swapped slots, per image

    # a count never differs between twins
    draw_family = _family_sampler(cfg, allowed=("pair", "relation", "place"))
    # pair captions cannot tell cell-swapped twins apart; if a config has no other family, fall back
    fallback = _family_sampler(SyntheticConfig(caption_families={"relation": 1.0, "place": 1.0}))
    T = 2 * n * per
    meanings = Meanings(**{f: np.full(T, -1, dtype=np.int8) for f in Meanings.FIELDS[:-1]},
                        noisy=np.zeros(T, dtype=bool))
    texts, pending = [""] * T, np.arange(T)
    for attempt in range(200):
        if not len(pending):
            break
        img = pending // per
        a = swapped[img, (rng_text.random(len(img)) < 0.5).astype(np.int64)]
        family = (draw_family if attempt < 20 else fallback)(rng_text, len(img))
        family, a, b = _objects_for(rng_text, gallery, img, family, a=a)
        partner = swapped[img, 0] + swapped[img, 1] - a  # the other swapped object
        b = np.where((b >= 0) & (rng_text.random(len(img)) < 0.5), partner, b)
        m = meanings_of(rng_text, gallery, img, family, a, b, cfg.attribute_dropout)
        words = word_captions(m, rng_text)
        ok = satisfies_rows(m, gallery.take(img)) & ~satisfies_rows(m, gallery.take(twin_of[img]))
        if attempt < 100:  # prefer captions that differ from the image's others
            ok &= np.array([words[j] not in texts[t - t % per:t - t % per + per]
                            for j, t in enumerate(pending)])
        accept = np.flatnonzero(ok)
        _set_rows(meanings, pending[accept], m.take(accept))
        for j in accept.tolist():
            texts[pending[j]] = words[j]
        pending = pending[~ok]
    if len(pending):
        raise RuntimeError(f"compositional: could not find discriminating captions for "
                           f"{len(pending)} slots")
    info = {"twin_of": twin_of, "swap_kind": ["color" if k == 0 else "cell" for k in kinds],
            "swapped_objects": pairs, "is_twin": np.arange(2 * n) % 2 == 1}
    ids = [f"compositional_{i // 2:06d}_{'twin' if i % 2 else 'base'}" for i in range(2 * n)]
    return _to_split("compositional", gallery, meanings, texts, np.repeat(np.arange(2 * n), per),
                     rng_pixels, cfg, seed, offsets=offsets, image_ids=ids, info=info)


FRESH_STREAMS = 1000  # spawn keys of fresh_scenes' draws start here, clear of the splits' 0..4


def fresh_scenes(cfg: SyntheticConfig, n: int, seed: int = 0, draw: int = 0) -> RetrievalSplit:
    """n more training scenes from their own random streams; `draw` picks another batch."""
    if n < 1 or draw < 0:
        raise ValueError(f"fresh_scenes needs n >= 1 scenes and draw >= 0, got n={n}, draw={draw}")
    return _make_split(f"fresh{draw}", n, cfg, seed, stream=FRESH_STREAMS + draw)


def with_fresh_scenes(train: RetrievalSplit, n: int, draw: int = 0) -> RetrievalSplit:
    """`train` (made by make_benchmark) followed by n fresh_scenes of its config and seed."""
    if n == 0:
        return train
    if not {"config", "seed"} <= train.info.keys():
        raise ValueError(f"split {train.name!r} was not made by make_benchmark (no config and "
                         "seed in its info): fresh scenes need the generator's settings. On other "
                         "data (Flickr30k, COCO) set the model config's fresh_scenes=0")
    fresh = fresh_scenes(SyntheticConfig(**train.info["config"]), n, train.info["seed"], draw)
    return concatenate([train, fresh], f"{train.name}+{n}fresh")


def make_benchmark(cfg: SyntheticConfig | None = None, seed: int = 0,
                   progress: bool = False) -> dict[str, RetrievalSplit]:
    """Every split of SPLITS, and "full": train + val + test pooled, queried by test only."""
    cfg = cfg or SyntheticConfig()
    from tqdm.auto import tqdm

    bench = {name: _make_compositional(cfg, seed) if name == "compositional"
             else _make_split(name, getattr(cfg, f"n_{name}"), cfg, seed)
             for name in tqdm(SPLITS, desc="synthetic benchmark", disable=not progress)}
    # the full setting (LightningDOT §4.3): the test queries against every split's gallery
    bench["full"] = concatenate([bench["train"], bench["val"], bench["test"]], "full",
                                queries_from=bench["test"])
    bench["full"].info.update({"config": cfg.to_dict(), "seed": seed, "split": "full"})
    return bench
