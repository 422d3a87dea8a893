"""A hand-built single vector per image and per caption from the generator's ground truth: what
one dot product can represent when perception is perfect.

The image vector is multi-hot over object kinds (shape, colour, size), (kind, cell) pairs and the
object count. A caption spreads a weight of 1 over the kinds each named object matches (at its
cell for a place caption), plus its count. Relations get nothing: a bag of objects cannot say
where one object is relative to another, the point of the reference."""

import numpy as np

from .scenes import COLORS, GRID, SHAPES, SIZES, Meanings, Scenes

N_KINDS = len(SHAPES) * len(COLORS) * len(SIZES)  # object kinds: (shape, colour, size)
N_CELLS = GRID * GRID


def kind_of(shape, color, size) -> np.ndarray:
    """The object kind index of (shape, colour, size) arrays: (shape * 8 + colour) * 2 + size."""
    return ((np.asarray(shape, np.int64) * len(COLORS) + np.asarray(color, np.int64)) * len(SIZES)
            + np.asarray(size, np.int64))


def _spread(shape, color, size) -> np.ndarray:
    """(T, N_KINDS) float32: a weight of 1 spread over the kinds a description (-1: any) fits."""
    kinds = np.array(list(np.ndindex(len(SHAPES), len(COLORS), len(SIZES)))).T[:, None]  # (3, 1, K)
    wanted = np.stack([shape, color, size]).astype(np.int64)[:, :, None]  # (3, T, 1)
    match = ((wanted < 0) | (wanted == kinds)).all(axis=0).astype(np.float32)  # kind_of order
    return match / np.maximum(match.sum(axis=1, keepdims=True), 1.0)


def vector_width(max_objects: int) -> int:
    return N_KINDS + N_KINDS * N_CELLS + max_objects + 1


def image_vectors(scenes: Scenes) -> np.ndarray:
    """(N, D) float32: each scene's objects, (object, cell) pairs and object count, multi-hot."""
    n, width = len(scenes), vector_width(scenes.max_objects)
    out = np.zeros((n, width), dtype=np.float32)
    rows, slots = np.nonzero(scenes.valid)  # every object of every scene
    kind = kind_of(scenes.shape[rows, slots], scenes.color[rows, slots], scenes.size[rows, slots])
    out[rows, kind] = 1.0
    out[rows, N_KINDS + kind * N_CELLS + scenes.cell[rows, slots]] = 1.0
    out[np.arange(n), N_KINDS * (1 + N_CELLS) + scenes.n_objects.astype(np.int64)] = 1.0
    return out


def text_vectors(meanings: Meanings, max_objects: int) -> np.ndarray:
    """(T, D) float32: each named object's weight of 1 spread over the kinds it matches."""
    t, width = len(meanings), vector_width(max_objects)
    out = np.zeros((t, width), dtype=np.float32)
    a = _spread(meanings.a_shape, meanings.a_color, meanings.a_size)  # (T, K)
    placed = meanings.place >= 0
    out[~placed, :N_KINDS] += a[~placed]
    rows = np.flatnonzero(placed)
    places = out[:, N_KINDS:N_KINDS * (1 + N_CELLS)].reshape(t, N_KINDS, N_CELLS)  # a view into out
    places[rows, :, meanings.place[rows].astype(np.int64)] += a[rows]
    b = _spread(meanings.b_shape, meanings.b_color, meanings.b_size)
    out[meanings.has_b, :N_KINDS] += b[meanings.has_b]
    counted = np.flatnonzero(meanings.count >= 0)
    out[counted, N_KINDS * (1 + N_CELLS) + meanings.count[counted].astype(np.int64)] = 1.0
    return out


def bag_of_objects(split) -> tuple[np.ndarray, np.ndarray]:
    """(image vectors (N, D), caption vectors (T, D)) of a synthetic split's ground truth."""
    if split.scenes is None or split.meanings is None:
        raise ValueError(f"split {split.name!r} has no ground truth (scenes, meanings): the "
                         "bag-of-objects reference exists for the synthetic benchmark only")
    return image_vectors(split.scenes), text_vectors(split.meanings, split.scenes.max_objects)


def random_projection(images: np.ndarray, texts: np.ndarray, width: int, seed: int = 0):
    """Both sides through one Gaussian map (D, width) / sqrt(width), which keeps dot products."""
    rng = np.random.default_rng(seed)
    project = rng.standard_normal((images.shape[1], width)).astype(np.float32) / np.sqrt(width)
    return images @ project, texts @ project
