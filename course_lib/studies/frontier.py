"""The capstone's arithmetic (notebook 07): the accuracy-latency Pareto front, ms per query
extended to galleries of millions, and the papers' headline speed-ups next to ours."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from course_lib.core.timing import extrapolate, fit_linear_cost


def pareto_front(ms, recall) -> list[int]:
    """Indices (by increasing ms) of the points no other dominates (lower ms, higher recall)."""
    ms, recall = np.asarray(ms, dtype=np.float64), np.asarray(recall, dtype=np.float64)  # (P,)
    if ms.shape != recall.shape or ms.ndim != 1:
        raise ValueError(f"ms and recall must be 1-D and of equal length, got {ms.shape} and "
                         f"{recall.shape}")
    order = np.lexsort((-recall, ms))  # by ms, the most accurate first among equal times
    front, best, best_ms = [], -np.inf, None
    for i in order:
        if recall[i] > best:
            front.append(int(i))
            best, best_ms = recall[i], ms[i]
        elif recall[i] == best and ms[i] == best_ms:  # an exact duplicate of a front point
            front.append(int(i))
    return front


def extend_latency(points: list[dict], sizes) -> list[dict]:
    """One method's ms per query at every size in `sizes`, its points {"n", "ms_per_query",
    "measured"} kept: other sizes get a + b*n fitted to the measured points (or all, with fewer
    than two measured sizes), floored at the largest measured time, measured=False."""
    measured = sorted((p for p in points if p["measured"]), key=lambda p: p["n"])
    if not measured:
        raise ValueError("no measured point to extrapolate from")
    rows = {int(p["n"]): {"n": int(p["n"]), "ms_per_query": float(p["ms_per_query"]),
                          "measured": bool(p["measured"])} for p in points}
    floor = measured[-1]["ms_per_query"]
    fit_to = measured if len({p["n"] for p in measured}) >= 2 else list(points)
    fit = (fit_linear_cost([p["n"] for p in fit_to], [p["ms_per_query"] for p in fit_to])
           if len({p["n"] for p in fit_to}) >= 2 else (floor, 0.0))
    for n in sorted({int(n) for n in sizes} - set(rows)):
        ms = max(float(extrapolate(fit, n)), floor)
        rows[n] = {"n": n, "ms_per_query": ms, "measured": False}
    return [rows[n] for n in sorted(rows)]


def compose_latency(points: list[dict], search: list[dict], sizes) -> list[dict]:
    """A method whose cost grows with the gallery only through a search (a dual encoder, or a
    re-ranker behind one): its measured points, then ms(n) = ms(n0) + search(n) - search(n0),
    n0 its largest measured gallery, measured=False."""
    measured = sorted((p for p in points if p["measured"]), key=lambda p: p["n"])
    if not measured:
        raise ValueError("no measured point to start from")
    at = {int(r["n"]): float(r["ms_per_query"]) for r in search}
    rows = {int(p["n"]): {"n": int(p["n"]), "ms_per_query": float(p["ms_per_query"]),
                          "measured": True} for p in measured}
    n0, ms0 = int(measured[-1]["n"]), float(measured[-1]["ms_per_query"])
    for n in sorted({int(n) for n in sizes} - set(rows)):
        if n0 not in at or n not in at:
            raise ValueError(f"the search was not timed at n={n0:,} and n={n:,}; time it at "
                             f"{sorted({n0, n})}")
        rows[n] = {"n": n, "ms_per_query": ms0 + at[n] - at[n0], "measured": False}
    return [rows[n] for n in sorted(rows)]


@dataclass(frozen=True)
class PaperSpeedup:
    """One headline speed-up as a paper reports it: `fast` against `slow` at n_images."""
    paper: str
    table: str
    setting: str  # dataset and what was timed
    n_images: int
    fast: str  # the paper's method
    slow: str  # what it is compared with
    speedup: float  # slow time / fast time
    ours: tuple[str, str]  # (our fast method, our slow method): the course's stand-ins


_LD, _UB = "LightningDOT (Sun et al., 2021)", "U-BERT"
_HV, _FS = "HiVLP (Chen et al., 2022)", "Fast & Slow (Miech et al., 2021)"
_LD_T3 = "Table 3 (speed-up w.r.t. UNITER-base)"
_HV_T4 = "Table 4 (speed-up over UNITER-base)"
_FS_T4 = "Table 4 (query time, one V100: Slow 4 s / 19 s; K=10 0.12 s; K=50 0.60 s)"
_UB_T1 = ("Table 1 (text->image, whole COCO 1K test set, one V100: Cross 4832 s, two-stage 102 s, "
          "U-BERT 31 s)")
_UB_T8 = "Table 8 (COCO 5K, one V100: Cross 34 h, U-BERT 2.5 min)"
_UNITER, _CROSS = "UNITER-base", "Cross (12 layers)"  # the papers' slow references
_LD_1K, _LD_5K = (_LD, _LD_T3, "Flickr30k test", 1_000), (_LD, _LD_T3, "COCO test", 5_000)
_UB_1K, _CE = (_UB, _UB_T1, "COCO 1K, text->image", 1_000), "cross_encoder"

PAPER_SPEEDUPS: tuple[PaperSpeedup, ...] = (
    PaperSpeedup(*_LD_1K, "SCAN", _UNITER, 1.8, ("scan", _CE)),
    PaperSpeedup(*_LD_1K, "LightningDOT", _UNITER, 639, ("lightningdot", _CE)),
    PaperSpeedup(*_LD_1K, "LightningDOT + re-ranker", _UNITER, 46, ("lightningdot+rerank@20", _CE)),
    PaperSpeedup(*_LD_5K, "SCAN", _UNITER, 1.9, ("scan", _CE)),
    PaperSpeedup(*_LD_5K, "LightningDOT", _UNITER, 1_927, ("lightningdot", _CE)),
    PaperSpeedup(*_LD_5K, "LightningDOT + re-ranker", _UNITER, 95, ("lightningdot+rerank@20", _CE)),
    PaperSpeedup(_LD, _LD_T3, "Flickr30k full", 31_014, "LightningDOT", _UNITER, 6_591,
                 ("lightningdot", _CE)),
    PaperSpeedup(_LD, _LD_T3, "COCO full", 123_287, "LightningDOT", _UNITER, 23_869,
                 ("lightningdot", _CE)),
    PaperSpeedup(*_UB_1K, "U-BERT (K=20, 3 cross layers)", _CROSS, 4832 / 31, ("ubert@20", _CE)),
    PaperSpeedup(*_UB_1K, "Embed + Cross@20 (two-stage)", _CROSS, 4832 / 102,
                 ("ubert-embed+cross_encoder@20", _CE)),
    PaperSpeedup(_UB, _UB_T8, "COCO 5K", 5_000, "U-BERT", _CROSS, 34 * 3600 / 150,
                 ("ubert@20", _CE)),
    PaperSpeedup(_HV, _HV_T4, "Flickr30k test", 1_000, "HiVLP", _UNITER, 1_427, ("hivlp", _CE)),
    PaperSpeedup(_HV, _HV_T4, "COCO test", 5_000, "HiVLP", _UNITER, 6_426, ("hivlp", _CE)),
    PaperSpeedup(_HV, _HV_T4, "COCO full", 123_287, "HiVLP", _UNITER, 120_649, ("hivlp", _CE)),
    PaperSpeedup(_FS, _FS_T4, "Flickr 1k images", 1_000, "Fast & Slow K=10", "Slow", 4 / 0.12,
                 ("fast_slow@10", "slow")),
    PaperSpeedup(_FS, _FS_T4, "Flickr 1k images", 1_000, "Fast & Slow K=50", "Slow", 4 / 0.60,
                 ("fast_slow@50", "slow")),
    PaperSpeedup(_FS, _FS_T4, "COCO 5k images", 5_000, "Fast & Slow K=10", "Slow", 19 / 0.12,
                 ("fast_slow@10", "slow")),
    PaperSpeedup(_FS, _FS_T4, "COCO 5k images", 5_000, "Fast & Slow K=50", "Slow", 19 / 0.60,
                 ("fast_slow@50", "slow")),
)


def latency_by_method(results: dict) -> dict[str, list[dict]]:
    """Every ms-per-query point of results.json by method, by increasing n: {method: [{"n",
    "ms_per_query", "measured"}, ...]}; of two at a size, a measured one wins."""
    points = [(p["method"], p["n"], p["ms_per_query"], p["measured"])
              for p in results.get("latency", [])]
    points += [(r["method"], r["n_images"], r["ms_per_query"], r.get("ms_measured", True))
               for r in results.get("rows", []) if r.get("ms_per_query")]
    curves: dict[str, dict[int, dict]] = {}
    for method, n, ms, measured in points:
        old = curves.setdefault(method, {}).get(int(n))
        if old is None or (measured and not old["measured"]):
            curves[method][int(n)] = {"n": int(n), "ms_per_query": float(ms),
                                      "measured": bool(measured)}
    return {m: [rows[n] for n in sorted(rows)] for m, rows in curves.items()}


def rows_at_gallery(results: dict, latency: dict[str, list[dict]], n: int, setting: str = "full",
                    metric: str = "t2i_r5") -> list[dict]:
    """plot_pareto rows: each method's `metric` in `setting` with its ms per query at gallery size
    n from `latency` (method -> extend_latency rows); methods without a time at n left out."""
    rows = []
    for r in results.get("rows", []):
        if r["setting"] != setting or r.get(metric) is None:
            continue
        at = next((p for p in latency.get(r["method"], []) if p["n"] == n), None)
        row = {"method": r["method"], "setting": f"{n:,} items", metric: r[metric]}
        if r.get("ms_per_query") is None:  # a reference row (the oracle): untimed at every size
            rows.append({**row, "ms_per_query": None})
        elif at is not None:
            rows.append({**row, "ms_per_query": at["ms_per_query"],
                         "ms_measured": bool(at["measured"])})
    return rows


def speedup_rows(results: dict, papers=PAPER_SPEEDUPS) -> list[dict]:
    """Each paper speed-up beside ours at the same gallery size (our times extended to n when not
    timed: "ours_estimated"); "ours_speedup" None where results.json lacks a method."""
    curves = latency_by_method(results)
    rows = []
    for p in papers:
        row = {"paper": p.paper, "table": p.table, "setting": f"{p.setting}, {p.n_images:,} images",
               "theirs": f"{p.fast} vs {p.slow}", "paper_speedup": p.speedup,
               "ours": f"{p.ours[0]} vs {p.ours[1]}", "ours_speedup": None, "ours_estimated": None}
        fast, slow = (curves.get(name) for name in p.ours)
        if fast and slow:
            f, s = (next(r for r in extend_latency(c, [p.n_images]) if r["n"] == p.n_images)
                    for c in (fast, slow))
            row["ours_speedup"] = s["ms_per_query"] / f["ms_per_query"]
            row["ours_estimated"] = not (f["measured"] and s["measured"])
        rows.append(row)
    return rows


def speedup_markdown(rows: list[dict]) -> str:
    """The side-by-side table as Markdown; * = ours uses an extrapolated time."""
    lines = ["| paper, table | setting | theirs | paper | ours | ours |",
             "|---|---|---|---:|---|---:|"]
    for r in rows:
        ours = ("–" if r["ours_speedup"] is None
                else _times(r["ours_speedup"]) + ("*" if r["ours_estimated"] else ""))
        lines.append(f"| {r['paper']}, {r['table'].split(' (')[0]} | {r['setting']} | "
                     f"{r['theirs']} | {_times(r['paper_speedup'])} | {r['ours']} | {ours} |")
    return "\n".join(lines)


def _times(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.3g}x"
