"""Free-text photo search (lesson 08's search box): a typed caption against a split's photos,
answered by fitted Rankers side by side with each one's online milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from course_lib.core.timing import measure
from course_lib.data.split import RetrievalSplit


@dataclass
class SearchResult:
    """One Ranker's answer to one typed caption."""

    method: str
    indices: np.ndarray  # (top_k,) the gallery's image indices, best first
    ms: float  # median of the timed calls, one query's online cost
    ms_p25: float
    ms_p75: float


def caption_split(gallery: RetrievalSplit, caption: str) -> RetrievalSplit:
    """The gallery's photos with `caption` as the only text (txt2img: 0, as one is needed)."""
    caption = caption.strip() if isinstance(caption, str) else caption
    if not isinstance(caption, str) or not caption:
        raise ValueError(f"type a caption to search for, e.g. 'a dog runs on the grass' (got "
                         f"{caption!r})")
    return RetrievalSplit(
        name=f"{gallery.name}[search]", captions=[caption], txt2img=np.zeros(1, dtype=np.int64),
        image_ids=gallery.image_ids, images=gallery.images, image_paths=gallery.image_paths,
        regions=gallery.regions, boxes=gallery.boxes, region_mask=gallery.region_mask,
        region_classes=gallery.region_classes, info=gallery.info)


def search_photos(rankers, gallery: RetrievalSplit, caption: str, top_k: int = 5,
                  repeats: int = 5) -> list[SearchResult]:
    """Each fitted Ranker's top_k photos of `gallery` for `caption`, with its online ms."""
    split = caption_split(gallery, caption)
    results = []
    for ranker in rankers:
        answer = ranker.query_fn(split, caption_index=0, top_k=top_k)  # offline work happens here
        timing = measure(answer, warmup=1, repeats=repeats, device="auto")  # CUDA events on a GPU
        top = np.asarray(answer(), dtype=np.int64).reshape(-1)[:top_k]  # (top_k,)
        results.append(SearchResult(ranker.name, top, timing.median_ms, timing.p25_ms,
                                    timing.p75_ms))
    return results


def show_search(rankers, gallery: RetrievalSplit, caption: str, top_k: int = 5):
    """search_photos drawn: one row of photos per Ranker, titled with its name and ms. -> Figure."""
    from course_lib.viz import show_rankings

    results = search_photos(rankers, gallery, caption, top_k)
    rows = [(f"{r.method}: {r.ms:.1f} ms (IQR {r.ms_p25:.1f}-{r.ms_p75:.1f})", r.indices, None)
            for r in results]
    return show_rankings(gallery, rows, title=f"\u201c{caption.strip()}\u201d")


def search_box(rankers, gallery: RetrievalSplit, caption: str, top_k: int = 5):
    """A text box showing show_search's photos for every caption typed; None without ipywidgets."""
    try:
        import ipywidgets as widgets
    except ImportError:
        return None
    import matplotlib.pyplot as plt

    box = widgets.Text(value=caption, description="caption:", continuous_update=False,
                       layout=widgets.Layout(width="90%"))
    out = widgets.Output()

    def update(change=None):
        out.clear_output(wait=True)
        with out:
            try:
                show_search(rankers, gallery, box.value, top_k)
                plt.show()
            except ValueError as error:  # an empty caption: say what to type
                print(error)

    box.observe(update, names="value")  # continuous_update=False: on Enter or leaving the box
    return widgets.VBox([box, out])
