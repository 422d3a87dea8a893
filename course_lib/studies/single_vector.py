"""What one vector per image can do here: the bag-of-objects reference scored like a method, per
caption family and embedding width. Recalls are expected values over random tie-breaking: the
hand-built vectors tie often."""

from __future__ import annotations

import numpy as np

from course_lib.core.metrics import expected_hits
from course_lib.data.bag_of_objects import bag_of_objects, random_projection
from course_lib.data.scenes import FAMILIES

NAME = "bag-of-objects"
NOTE = ("reference, not trained: a hand-built multi-hot of each scene's objects, (object, cell) "
        "pairs and count against each caption's named objects, dot product, ties broken at random "
        "(expected recall); relations cannot be represented (course_lib.data.bag_of_objects)")
WIDTHS = (64, 128, 256, 512)  # random projections' widths (the course's joint spaces: 64-256)


def _vectors(split, width: int | None, seed: int):
    images, texts = bag_of_objects(split)
    return (images, texts) if width is None else random_projection(images, texts, width, seed)


def reference_metrics(split, ks=(1, 5, 10), width: int | None = None,
                      seed: int = 0) -> dict[str, float]:
    """Expected recalls (percent) of the bag of objects, randomly projected to `width` if given."""
    images, texts = _vectors(split, width, seed)
    asked = {"t2i": split.text_queries, "i2t": split.image_queries}
    return {f"{d}_r{k}": 100.0 * expected_hits(images, texts, split.txt2img, k, d, asked[d]).mean()
            for k in ks for d in ("t2i", "i2t")}


def recall_by_family_and_width(split, k: int = 1, widths=(None, *WIDTHS),
                               seed: int = 0) -> list[dict]:
    """t2i R@k (percent) per caption family and over all: {"family", "captions", width: recall}
    for the exact vectors (width None) and each projection width."""
    family = split.meanings.family[split.text_queries]
    hits = {width: expected_hits(*_vectors(split, width, seed), split.txt2img, k, "t2i",
                                 split.text_queries) for width in widths}
    rows = []
    for code in [*np.unique(family), None]:
        chosen = np.ones(len(family), bool) if code is None else family == code
        rows.append({"family": "all" if code is None else FAMILIES[int(code)],
                     "captions": int(chosen.sum()),
                     **{width: 100.0 * float(hits[width][chosen].mean()) for width in widths}})
    return rows


def family_table(rows: list[dict], k: int = 1) -> str:
    """recall_by_family_and_width's rows as a Markdown table."""
    widths = [key for key in rows[0] if key not in ("family", "captions")]
    names = ["exact" if w is None else f"{w}-d" for w in widths]
    lines = ["| caption family | captions | " + " | ".join(f"t2i R@{k} {n}" for n in names) + " |",
             "|---|---|" + "---|" * len(widths)]
    lines += [f"| {r['family']} | {r['captions']:,} | " + " | ".join(f"{r[w]:.1f}" for w in widths)
              + " |" for r in rows]
    return "\n".join(lines)
