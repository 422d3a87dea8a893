"""Pixels and "detector" regions of synthetic scenes, vectorised numpy.

Pixels: each object a stamp of its shape and colour in its cell of a 3x3 grid, slightly offset.
Regions mirror Faster R-CNN bottom-up features: per object a feature vector (a fixed function of
shape, colour and size, from DETECTOR_SEED so it means the same in every split), its UNITER box
and a soft class distribution over shape x colour."""

from functools import lru_cache
from itertools import product
from statistics import NormalDist

import numpy as np

from .scenes import COLORS, GRID, N_CLASSES, SHAPES, Scenes

DETECTOR_SEED = 1_2345_6789  # fixed: the "pretrained detector" is the same for every data seed
BACKGROUND = np.array([18, 18, 26], dtype=np.uint8)
PALETTE = np.array(  # RGB per colour, in COLORS order
    [[220, 40, 40], [40, 190, 60], [50, 90, 235], [230, 220, 50],
     [150, 60, 210], [245, 140, 30], [240, 240, 240], [40, 215, 225]], dtype=np.uint8)
CLASS_SHARPNESS = 2.5  # detector logit bonus for the right shape and for the right colour
CLASS_NOISE = 1.0  # std of the detector's logit noise


def _stamp(shape: str, k: int) -> np.ndarray:
    """bool (k, k) mask of one shape, by 4x supersampling (a pixel is on if half of it is in)."""
    t = (np.arange(4 * k) + 0.5) / (2 * k) - 1.0  # sub-pixel centres in [-1, 1]
    v, u = np.meshgrid(t, t, indexing="ij")  # v: down, u: right
    r2 = u * u + v * v
    inside = {
        "circle": r2 <= 1.0,
        "square": (np.abs(u) <= 0.9) & (np.abs(v) <= 0.9),
        "triangle": (v <= 0.9) & (np.abs(u) <= (v + 1.0) / 1.9 * 0.95),
        "diamond": np.abs(u) + np.abs(v) <= 1.0,
        "cross": (((np.abs(u) <= 0.3) | (np.abs(v) <= 0.3)) & (np.abs(u) <= 0.95)
                  & (np.abs(v) <= 0.95)),
        "ring": (r2 <= 1.0) & (r2 >= 0.5 ** 2),
    }[shape]
    return inside.reshape(k, 4, k, 4).mean(axis=(1, 3)) >= 0.5


@lru_cache(maxsize=8)
def geometry(image_size: int) -> dict:
    """Cell size, margin, stamps and boxes of one image size. masks (n_shapes, 2, P, P, cs, cs):
    the stamp of (shape, size) at offset (oy, ox) in a cell; bbox (n_shapes, 2, 4): y1, x1, y2, x2
    (exclusive) of the stamp's pixels; lo, hi (2,): the allowed offsets per size."""
    cs = image_size // GRID
    if cs < 6:
        raise ValueError(f"image_size {image_size} is too small; use at least {6 * GRID}")
    k = np.array([max(3, round(cs * 0.55)), cs - 2])  # stamp side: small, big
    centre, jitter = (cs - k) // 2, max(1, cs // 10)
    lo, hi = np.maximum(0, centre - jitter), np.minimum(cs - k, centre + jitter)
    P = int(hi.max()) + 1
    masks = np.zeros((len(SHAPES), 2, P, P, cs, cs), dtype=bool)
    bbox = np.zeros((len(SHAPES), 2, 4), dtype=np.int64)
    for s, name in enumerate(SHAPES):
        for z in range(2):
            stamp = _stamp(name, int(k[z]))
            ys, xs = np.nonzero(stamp)
            bbox[s, z] = ys.min(), xs.min(), ys.max() + 1, xs.max() + 1
            for oy, ox in product(range(lo[z], hi[z] + 1), repeat=2):
                masks[s, z, oy, ox, oy:oy + k[z], ox:ox + k[z]] = stamp
    return dict(cs=cs, margin=(image_size - GRID * cs) // 2, masks=masks, bbox=bbox, lo=lo, hi=hi)


def sample_offsets(rng: np.random.Generator, scenes: Scenes, image_size: int) -> np.ndarray:
    """int64 (N, O, 2): each object's (oy, ox) stamp offset inside its cell (0 in empty slots)."""
    g = geometry(image_size)
    size = np.maximum(scenes.size, 0).astype(np.int64)  # (N, O)
    span = (g["hi"] - g["lo"] + 1)[size]  # (N, O)
    u = rng.random((len(scenes), scenes.max_objects, 2))
    offsets = g["lo"][size][..., None] + np.floor(u * span[..., None]).astype(np.int64)
    return np.where(scenes.valid[..., None], offsets, 0)


CLUTTER_GREYS = np.array([[60, 60, 60], [75, 75, 80], [90, 90, 90], [105, 100, 100]],
                         dtype=np.uint8)
_PIXEL_COLORS = np.concatenate([BACKGROUND[None], PALETTE, CLUTTER_GREYS])  # (13, 3)


@lru_cache(maxsize=8)
def _noisy_palette(pixel_noise: float) -> np.ndarray:
    """uint8 (13 * 256, 3): each base colour plus the 256 quantiles of N(0, pixel_noise), clipped:
    a random byte per pixel indexes Gaussian-like noise, far faster than drawing normals."""
    sigma = pixel_noise * 255.0
    levels = np.array([NormalDist(0.0, sigma).inv_cdf((b + 0.5) / 256.0) for b in range(256)])
    table = np.clip(np.round(_PIXEL_COLORS[:, None, :] + levels[None, :, None]), 0, 255)
    return table.astype(np.uint8).reshape(-1, 3)


def render_pixels(scenes: Scenes, offsets: np.ndarray, rng: np.random.Generator, image_size=32,
                  pixel_noise=0.0, clutter=0.0) -> tuple[np.ndarray, np.ndarray]:
    """images uint8 (N, S, S, 3) and the stamps' UNITER boxes float32 (N, O, 7) (0: no object)."""
    g = geometry(image_size)
    cs, m, n = g["cs"], g["margin"], len(scenes)
    index = np.zeros((n, image_size, image_size), dtype=np.uint8)  # (N, S, S), 0 = background
    if clutter > 0:  # specks first, so objects are drawn over them
        img = np.repeat(np.arange(n), rng.poisson(clutter, size=n))  # (specks,) their images
        side = max(1, image_size // 16)
        y, x = rng.integers(0, image_size - side + 1, size=(2, len(img)))
        grey = (1 + len(PALETTE)
                + rng.integers(0, len(CLUTTER_GREYS), size=len(img))).astype(np.uint8)
        for dy, dx in product(range(side), repeat=2):
            index[img, y + dy, x + dx] = grey
    board = index[:, m:m + GRID * cs, m:m + GRID * cs].copy()  # (N, 3cs, 3cs)
    cells = board.reshape(n, GRID, cs, GRID, cs)  # a view: cells[n, row, :, col] is one cell
    img, obj = np.nonzero(scenes.valid)  # (M,) one entry per object
    shape, color, size, cell = (scenes.shape[img, obj], scenes.color[img, obj],
                                scenes.size[img, obj], scenes.cell[img, obj].astype(np.int64))
    oy, ox = offsets[img, obj, 0], offsets[img, obj, 1]
    row, col = cell // GRID, cell % GRID
    mask = g["masks"][shape, size, oy, ox]  # (M, cs, cs)
    blocks = cells[img, row, :, col]  # (M, cs, cs); cells are distinct, so no write conflicts
    cells[img, row, :, col] = np.where(mask, (color + 1).astype(np.uint8)[:, None, None], blocks)
    index[:, m:m + GRID * cs, m:m + GRID * cs] = board
    if pixel_noise > 0:
        flat = index.reshape(-1).astype(np.uint16) << 8
        flat |= np.frombuffer(rng.bytes(flat.size), dtype=np.uint8)
        images = np.take(_noisy_palette(float(pixel_noise)), flat, axis=0)
    else:
        images = np.take(_PIXEL_COLORS, index.reshape(-1), axis=0)
    images = images.reshape(n, image_size, image_size, 3)
    bb = g["bbox"][shape, size]  # (M, 4) y1, x1, y2, x2 in the stamp
    y, x = m + row * cs + oy, m + col * cs + ox  # (M,) the stamp's top left pixel
    xyxy = np.stack([x + bb[:, 1], y + bb[:, 0], x + bb[:, 3], y + bb[:, 2]], axis=1)
    boxes = np.zeros((n, scenes.max_objects, 7), dtype=np.float32)
    boxes[img, obj] = uniter_boxes(xyxy / image_size)
    return images, boxes


def uniter_boxes(xyxy: np.ndarray) -> np.ndarray:
    """(M, 4) normalised x1, y1, x2, y2 -> (M, 7) with w, h, area appended."""
    w, h = xyxy[:, 2] - xyxy[:, 0], xyxy[:, 3] - xyxy[:, 1]
    return np.concatenate([xyxy, w[:, None], h[:, None], (w * h)[:, None]],
                          axis=1).astype(np.float32)


@lru_cache(maxsize=8)
def detector_tables(region_dim: int) -> dict:
    """The fixed random "detector": clean features per (shape, colour, size), its mixing map.
    feature(s, c, z) = tanh(0.6 * (E_shape[s] + E_color[c] + E_size[z] + 0.5 * E_pair[s, c]) @ W),
    mixed so that no coordinate is a one-hot attribute indicator."""
    rng = np.random.default_rng(DETECTOR_SEED)
    D, S, C = region_dim, len(SHAPES), len(COLORS)
    e_shape, e_color = rng.standard_normal((S, D)), rng.standard_normal((C, D))
    e_size, e_pair = rng.standard_normal((2, D)), rng.standard_normal((S, C, D))
    mix = rng.standard_normal((D, D)) / np.sqrt(D)
    latent = (e_shape[:, None, None] + e_color[None, :, None] + e_size[None, None, :]
              + 0.5 * e_pair[:, :, None])  # (S, C, 2, D)
    clean = np.tanh(0.6 * latent @ mix).astype(np.float32)  # (S, C, 2, D)
    return dict(clean=clean, mix=mix)


def detect_regions(scenes: Scenes, object_boxes: np.ndarray, rng: np.random.Generator,
                   region_dim: int = 64, region_noise: float = 0.1,
                   clutter_regions: int = 0) -> dict[str, np.ndarray]:
    """The "detector" output over R = max_objects + clutter_regions slots: regions (N, R, D),
    boxes (N, R, 7), region_mask (N, R), region_classes (N, R, 48), region_object (N, R): the
    object slot shown, or -1. Real regions first in a random order (slot order must not leak
    object identity), padding last."""
    n, n_slots = len(scenes), scenes.max_objects
    R, D = n_slots + clutter_regions, region_dim
    tables = detector_tables(region_dim)

    def widen(a, value=0):  # (N, O, ...) -> (N, R, ...), the clutter slots filled with value
        return np.pad(a, [(0, 0), (0, clutter_regions)] + [(0, 0)] * (a.ndim - 2),
                      constant_values=value)
    valid = widen(scenes.valid, False)
    shape, color = widen(scenes.shape, -1), widen(scenes.color, -1)  # (N, R)
    feats = widen(tables["clean"][np.maximum(scenes.shape, 0), np.maximum(scenes.color, 0),
                                  np.maximum(scenes.size, 0)])  # (N, R, D)
    boxes = widen(np.asarray(object_boxes, dtype=np.float32))  # (N, R, 7)
    if clutter_regions:  # false positives: random appearance, small random boxes
        valid[:, n_slots:] = True
        latent = rng.standard_normal((n, clutter_regions, D)) * 1.8
        feats[:, n_slots:] = np.tanh(0.6 * latent @ tables["mix"])
        xy = rng.random((n, clutter_regions, 2)) * 0.8
        wh = 0.05 + 0.15 * rng.random((n, clutter_regions, 2))
        xyxy = np.concatenate([xy, xy + wh], axis=-1).reshape(-1, 4)
        boxes[:, n_slots:] = uniter_boxes(xyxy).reshape(n, clutter_regions, 7)
    feats += region_noise * rng.standard_normal((n, R, D), dtype=np.float32)
    # soft classes: softmax(alpha [same shape] + alpha [same colour] + noise); flat-ish for clutter
    class_shape, class_color = divmod(np.arange(N_CLASSES), len(COLORS))  # (48,) each
    logits = CLASS_NOISE * rng.standard_normal((n, R, N_CLASSES), dtype=np.float32)
    logits += CLASS_SHARPNESS * (shape[..., None] == class_shape).astype(np.float32)
    logits += CLASS_SHARPNESS * (color[..., None] == class_color).astype(np.float32)
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    region_object = np.where(np.arange(R) < n_slots, np.arange(R), -1)[None].repeat(n, axis=0)
    # shuffle the real regions of each scene; padding sorts to the end
    order = np.argsort(np.where(valid, rng.random((n, R)), 2.0 + np.arange(R)), axis=1)  # (N, R)

    def pick(a):
        return np.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1)
    valid = pick(valid)
    zero = ~valid
    out = dict(regions=pick(feats), boxes=pick(boxes), region_mask=valid,
               region_classes=pick(probs.astype(np.float32)),
               region_object=np.where(zero, -1, pick(region_object)).astype(np.int8))
    for key in ("regions", "boxes", "region_classes"):
        out[key][zero] = 0.0  # padding slots hold zeros, not noise
    return out
