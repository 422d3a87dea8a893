"""Published retrieval results on the real datasets (a paper's R@1 on the official test gallery,
with the features it used), set beside ours. Our Flickr8k `test` is 500 photos, an easier gallery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PublishedResult:
    paper: str  # who and when, as the row is labelled
    image_features: str  # what the image side reads
    text_side: str | None  # what encodes the captions; None where we do not have it
    t2i_r1: float  # text-to-image R@1 (%) on the official test gallery
    i2t_r1: float | None  # image-to-text R@1 (%); None where we do not have it


# Flickr8k's official test split: 1,000 photos, 5,000 captions
PUBLISHED = {"flickr8k": {"gallery": 1000, "rows": (
    PublishedResult("Kiros et al. 2014", "VGG", "LSTM", 12.5, 18.0),
    PublishedResult("Karpathy & Fei-Fei 2015", "R-CNN regions", "BRNN", 11.8, 16.5),
    PublishedResult("Ma et al. 2015, m-CNN", "VGG", "CNN over words", 20.3, 24.8),
    PublishedResult("Klein et al. 2015", "VGG", "Fisher vectors + CCA", 21.2, 31.0),
    PublishedResult("NAA 2019", "ResNet", None, 27.7, None),
    PublishedResult("SCAN", "detector regions", "bi-GRU", 38.3, None))}}


def published_rows(dataset: str | None) -> dict | None:
    """{"dataset", "gallery" (photos in the papers' gallery), "rows"} of a dataset, or None."""
    if (entry := PUBLISHED.get(dataset or "")) is None:
        return None
    return {"dataset": dataset, "gallery": entry["gallery"],
            "rows": [asdict(r) for r in entry["rows"]]}


def published_markdown(published: dict, our_gallery: int) -> str:
    """The published rows as a Markdown table, under a line that names the gallery difference."""
    lines = [f"**Published {published['dataset']} results** (R@1 in %, on the official test "
             f"gallery of {published['gallery']:,} photos; ours: {our_gallery:,}, so "
             f"{published['gallery'] / our_gallery:.3g}x the distractors there)", "",
             "| paper | image features | text side | i2t R@1 | t2i R@1 |", "|---|---|---|---|---|"]
    for r in published["rows"]:
        i2t = "–" if r["i2t_r1"] is None else f"{r['i2t_r1']:.1f}"
        lines.append(f"| {r['paper']} | {r['image_features']} | {r['text_side'] or '–'} | {i2t} | "
                     f"{r['t2i_r1']:.1f} |")
    return "\n".join(lines)
