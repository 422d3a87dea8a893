"""Evaluating one method on one split, as both benchmarks do: its recalls from its top-K rankings,
its ms per text query, and the results row that holds both."""

from __future__ import annotations

import numpy as np

from course_lib.core.metrics import ranks_from_top_k, recall_at_k
from course_lib.core.timing import latency_vs_gallery
from course_lib.methods.queries import ground_truth

MIN_SAMPLED_QUERIES = (100, 10)  # (default, smoke): fewer sampled queries are too noisy to compare


def evaluate(method, split, ks, smoke: bool = False, seed: int = 0, every_pair: bool = False,
             pair_cap: int | None = None) -> tuple[dict, str]:
    """(recalls, how measured) per direction: every query, or a fixed random sample where the
    method's eval_pairs budget runs out (every_pair lifts it, pair_cap caps it); recalls None
    where the budget allows fewer than MIN_SAMPLED_QUERIES."""
    metrics, how = {}, []
    for direction in ("t2i", "i2t"):
        queries = split.text_queries if direction == "t2i" else split.image_queries
        per_query = method.pairs_per_query(split, direction)
        budget = method.eval_pairs[1 if smoke else 0]
        limit = getattr(method, "every_pair_limit", None)
        if every_pair and (limit is None or per_query * len(queries) <= limit):
            budget = None
        if pair_cap is not None:
            budget = pair_cap if budget is None else min(budget, pair_cap)
        if budget is not None and per_query * len(queries) > budget:
            n = max(1, budget // max(per_query, 1))
            fewest = MIN_SAMPLED_QUERIES[1 if smoke else 0]
            if n < fewest:
                metrics |= {f"{direction}_r{k}": None for k in ks}
                how.append(f"{direction} not measured: its budget allows {n} sampled queries, "
                           f"fewer than {fewest}")
                continue
            rng = np.random.default_rng([seed, 0 if direction == "t2i" else 1])
            queries = np.sort(rng.choice(queries, size=n, replace=False))
            how.append(f"{direction} on {n} sampled queries ({n * per_query:,} pairs)")
        else:
            how.append(f"{direction} on all {len(queries)} queries")
        indices, scores = method.rank(split, direction, max(ks), queries)  # (Q, K) each
        ranks = ranks_from_top_k(scores, ground_truth(split, direction, queries, indices))
        metrics |= {f"{direction}_r{k}": v for k, v in recall_at_k(ranks, ks).items()}
    return metrics, "; ".join(how)


class Galleries:
    """The first n images of a split, made once, so a cascade finds its first stage's cache."""

    def __init__(self):
        self.made = {}  # (id(split), n) -> (split, the subset)

    def __call__(self, split, n: int):
        if n >= split.n_images:
            return split
        key = (id(split), n)
        if key not in self.made:  # the split is held in the entry, so its id is not reused
            self.made[key] = (split, split.subset(range(n)))
        return self.made[key][1]


def query_latency(method, gallery, sizes, smoke: bool, repeats: int, galleries=None) -> list[dict]:
    """ms per text query against the first n images of `gallery`, extrapolated past timed_sizes."""
    galleries = galleries or Galleries()
    measured = method.timed_sizes[1 if smoke else 0]
    most = min(gallery.n_images, max(sizes) if measured is None else max(measured))
    if max(sizes) <= most:  # every size is timed: nothing to fit a line to
        points = sorted(set(sizes))
    else:  # enough points for a linear fit
        measured = measured or (max(1, most // 4), max(2, most // 2), most)
        points = sorted({n for n in measured if n <= most} | set(sizes))
    return latency_vs_gallery(lambda n: method.query_fn(galleries(gallery, n)), points, warmup=2,
                              repeats=repeats, max_measured=most)


def results_row(name, setting, split, metrics, ks, ms_per_query, notes, ms_measured=True,
                ms_spread=(None, None)) -> dict:
    """One row of results.json: sizes, recalls at `ks` and their mean (AR), ms per text query."""
    keys = [f"{d}_r{k}" for d in ("i2t", "t2i") for k in ks]
    recalls = [None if metrics[key] is None else round(float(metrics[key]), 2) for key in keys]
    ms, p25, p75 = (None if v is None else round(float(v), 4) for v in (ms_per_query, *ms_spread))
    return {"method": name, "setting": setting, "n_images": split.n_images,
            "n_texts": split.n_texts, "n_text_queries": split.n_text_queries,
            "n_image_queries": split.n_image_queries, **dict(zip(keys, recalls, strict=True)),
            "ar": None if None in recalls else round(float(np.mean(recalls)), 2),
            "ms_per_query": ms, "ms_p25": p25, "ms_p75": p75, "ms_measured": bool(ms_measured),
            "notes": notes}
