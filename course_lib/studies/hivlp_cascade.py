"""HiVLP's time analysis (§3.4): the similarity work of one query, flat search at the last level's
width against the coarse-to-fine cascade, on galleries of any size (core.tiling.tile_rows grows
them). Notebook 05 runs it on galleries of up to 10^7 items."""

from __future__ import annotations

from course_lib.core.timing import measure
from course_lib.methods.hivlp.search import SURVIVORS, coarse_to_fine, flat_search


def similarity_times(gallery_levels, query_levels, survivors=SURVIVORS, top_k: int = 10,
                     repeats: int = 10, warmup: int = 2) -> dict:
    """Flat search at the last level's width against coarse_to_fine, for one query (query_levels[l]
    (1, d_l)); "overlap": the share of the flat top_k the cascade returns."""
    flat = measure(lambda: flat_search(gallery_levels[-1], query_levels[-1], top_k),
                   warmup=warmup, repeats=repeats)
    cascade = measure(lambda: coarse_to_fine(gallery_levels, query_levels, survivors, top_k),
                      warmup=warmup, repeats=repeats)
    same = set(flat_search(gallery_levels[-1], query_levels[-1], top_k)[0][0].tolist())
    got = set(coarse_to_fine(gallery_levels, query_levels, survivors, top_k)[0][0].tolist())
    return {"n": len(gallery_levels[0]), "flat_ms": flat.median_ms, "cascade_ms": cascade.median_ms,
            "speedup": flat.median_ms / cascade.median_ms,
            "overlap": len(same & got) / max(len(same), 1)}
