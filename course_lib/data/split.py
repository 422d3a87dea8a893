"""RetrievalSplit: one gallery of images with their captions, the form every loader returns
(synthetic or Karpathy-split real data). Queries differ from the gallery only in the papers' "full"
setting (LightningDOT §4.3): the test split's queries against every split pooled."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

# the arrays and lists with one row per image, besides image_ids and scenes
PER_IMAGE = ("images", "image_paths", "regions", "boxes", "region_mask", "region_classes")


@dataclass
class RetrievalSplit:
    name: str
    captions: list[str]  # T strings
    txt2img: np.ndarray  # int64 (T,) each caption's image index
    image_ids: list[str]
    images: np.ndarray | None = None  # uint8 (N, H, W, 3) pixels in memory
    image_paths: list[str] | None = None  # N files on disk (real data, read lazily)
    regions: np.ndarray | None = None  # float32 (N, R, D) "detector" region features
    boxes: np.ndarray | None = None  # float32 (N, R, 7) UNITER x1, y1, x2, y2, w, h, area
    region_mask: np.ndarray | None = None  # bool (N, R), True where a slot holds a region
    region_classes: np.ndarray | None = None  # float32 (N, R, C) detector class distribution
    scenes: object | None = None  # synthetic ground truth (data.scenes.Scenes)
    meanings: object | None = None  # what each synthetic caption asserts (data.scenes.Meanings)
    info: dict = field(default_factory=dict)
    query_texts: np.ndarray | None = None  # int64 (Q_t,) the t2i query captions; None: all
    query_images: np.ndarray | None = None  # int64 (Q_i,) the i2t query images; None: all

    def __post_init__(self):
        self.txt2img = np.asarray(self.txt2img, dtype=np.int64)
        n = len(self.image_ids)
        for name, size in (("query_texts", len(self.captions)), ("query_images", n)):
            value = getattr(self, name)
            if value is None:
                continue
            value = np.asarray(value, dtype=np.int64)
            if value.ndim != 1 or (len(value) and (value.min() < 0 or value.max() >= size)):
                raise ValueError(f"split {self.name!r}: {name} must be indices in [0, {size})")
            setattr(self, name, value)
        if len(self.captions) != len(self.txt2img):
            raise ValueError(
                f"split {self.name!r}: {len(self.captions)} captions but {len(self.txt2img)} "
                "txt2img entries; give one image index per caption")
        if len(self.txt2img) and (self.txt2img.min() < 0 or self.txt2img.max() >= n):
            raise ValueError(
                f"split {self.name!r}: txt2img holds indices outside [0, {n}); every caption must "
                "point at one of the split's images")
        for name in PER_IMAGE:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"split {self.name!r}: {name} has {len(value)} rows, expected {n}")

    @property
    def n_images(self) -> int:
        return len(self.image_ids)

    @property
    def n_texts(self) -> int:
        return len(self.captions)

    @property
    def has_pixels(self) -> bool:
        return self.images is not None or self.image_paths is not None

    @property
    def has_regions(self) -> bool:
        return self.regions is not None

    @property
    def text_queries(self) -> np.ndarray:
        """Indices of the captions that query images (t2i): query_texts, or every caption."""
        return np.arange(self.n_texts) if self.query_texts is None else self.query_texts

    @property
    def image_queries(self) -> np.ndarray:
        """Indices of the images that query captions (i2t): query_images, or every image."""
        return np.arange(self.n_images) if self.query_images is None else self.query_images

    @property
    def n_text_queries(self) -> int:
        return len(self.text_queries)

    @property
    def n_image_queries(self) -> int:
        return len(self.image_queries)

    def img2txt(self) -> list[np.ndarray]:
        """For each image, the indices of its captions (the i2t ground truth)."""
        order = np.argsort(self.txt2img, kind="stable")
        counts = np.bincount(self.txt2img, minlength=self.n_images)
        return np.split(order, np.cumsum(counts)[:-1])

    def subset(self, image_indices, name: str | None = None) -> RetrievalSplit:
        """The split restricted to some images (in the given order) and all of their captions."""
        image_indices = np.asarray(image_indices, dtype=np.int64)
        remap = np.full(self.n_images, -1, dtype=np.int64)
        remap[image_indices] = np.arange(len(image_indices))
        keep = np.flatnonzero(remap[self.txt2img] >= 0)
        keep = keep[np.argsort(remap[self.txt2img[keep]], kind="stable")]
        return replace(
            self, **{f: _take(getattr(self, f), image_indices)
                     for f in ("image_ids", *PER_IMAGE, "scenes")},
            name=name or f"{self.name}[subset]", captions=_take(self.captions, keep),
            txt2img=remap[self.txt2img[keep]], meanings=_take(self.meanings, keep),
            info=dict(self.info), query_texts=_kept(self.query_texts, keep, self.n_texts),
            query_images=_kept(self.query_images, image_indices, self.n_images))

    def texts_subset(self, text_indices, name: str | None = None) -> RetrievalSplit:
        """Every image, only the given captions as t2i queries (i2t, needing them all, has none)."""
        text_indices = np.asarray(text_indices, dtype=np.int64)
        if self.query_texts is not None and not np.isin(text_indices, self.query_texts).all():
            raise ValueError(f"split {self.name!r}: texts_subset takes query texts only "
                             "(split.text_queries); the others are gallery items, not queries")
        return replace(
            self, name=name or f"{self.name}[texts]", captions=_take(self.captions, text_indices),
            txt2img=self.txt2img[text_indices], meanings=_take(self.meanings, text_indices),
            info=dict(self.info), query_texts=None,
            query_images=np.zeros(0, dtype=np.int64))  # i2t needs every caption: none here

    def summary(self) -> str:
        parts = [f"{self.name}: {self.n_images} images, {self.n_texts} captions"]
        if self.query_texts is not None or self.query_images is not None:
            parts.append(f"queries: {self.n_text_queries} captions, {self.n_image_queries} images")
        parts += [f"{name} {tuple(array.shape[1:])}" for name, array in
                  (("pixels", self.images), ("regions", self.regions)) if array is not None]
        return ", ".join(parts)


def _take(value, rows):
    """The given rows of an array, an ArrayTable or a list; None stays None."""
    if value is None or isinstance(value, np.ndarray):
        return None if value is None else value[rows]
    return value.take(rows) if hasattr(value, "take") else [value[i] for i in rows]


def _cat(values: list):
    """Arrays, ArrayTables or lists pooled in order; None if any is None."""
    if any(v is None for v in values):
        return None
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    if hasattr(values[0], "take"):  # ArrayTable
        return type(values[0]).concatenate(values)
    return [x for v in values for x in v]


def _kept(queries, kept_items, n_before) -> np.ndarray | None:
    """Query indices after a subset keeps `kept_items` (in that order): those left, renumbered."""
    if queries is None:
        return None
    position = np.full(n_before, -1, dtype=np.int64)
    position[np.asarray(kept_items, dtype=np.int64)] = np.arange(len(kept_items))
    moved = position[queries]
    return np.sort(moved[moved >= 0])


def concatenate(splits: list[RetrievalSplit], name: str,
                queries_from: RetrievalSplit | None = None) -> RetrievalSplit:
    """Pool splits into one gallery; queries_from: the split whose items stay the only queries."""
    offsets = np.cumsum([0] + [s.n_images for s in splits[:-1]])
    text_offsets = np.cumsum([0] + [s.n_texts for s in splits[:-1]])
    query_texts = query_images = None
    if queries_from is not None:
        q = next((i for i, s in enumerate(splits) if s is queries_from), None)
        if q is None:
            raise ValueError(f"queries_from must be one of the pooled splits, got "
                             f"{queries_from.name!r}")
        query_texts = text_offsets[q] + queries_from.text_queries
        query_images = offsets[q] + queries_from.image_queries
    pooled = {f: _cat([getattr(s, f) for s in splits])
              for f in ("captions", "image_ids", *PER_IMAGE, "scenes", "meanings")}
    txt2img = np.concatenate([s.txt2img + o for s, o in zip(splits, offsets, strict=True)])
    return RetrievalSplit(name=name, txt2img=txt2img, query_texts=query_texts,
                          query_images=query_images, info={"pooled_from": [s.name for s in splits]},
                          **pooled)
