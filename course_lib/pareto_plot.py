"""The accuracy-latency (Pareto) plot: one labelled point per method against its ms per query, the
front joined, untimed references and published rows as levels; and place_labels, which labels
crowded points so that no two labels overlap."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from course_lib.studies.frontier import pareto_front


def _box_distances(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(C, M) distances from M display points (M, 2) to C boxes (C, 4: x0, y0, x1, y1)."""
    px, py = points[None, :, 0], points[None, :, 1]  # (1, M)
    dx = np.maximum(np.maximum(boxes[:, None, 0] - px, 0), px - boxes[:, None, 2])
    dy = np.maximum(np.maximum(boxes[:, None, 1] - py, 0), py - boxes[:, None, 3])
    return np.hypot(dx, dy)


def _overlaps(boxes: np.ndarray, others: np.ndarray) -> np.ndarray:
    """(C,) how many of `others` (P, 4) each candidate box (C, 4) overlaps."""
    b, o = boxes[:, None], others[None, :]  # (C, 1, 4), (1, P, 4)
    return ((b[..., 0] < o[..., 2]) & (o[..., 0] < b[..., 2])
            & (b[..., 1] < o[..., 3]) & (o[..., 1] < b[..., 3])).sum(axis=1)


_RADII = (3.5, 5, 7, 9, 12, 16, 20, 25, 31, 38, 46, 60, 80, 105, 130)  # points from the marker
_ANGLES = np.linspace(0, 2 * np.pi, 24, endpoint=False)


def _candidates(cx, cy, w, h, px_per_pt) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (C, 4) on rings of growing radius about (cx, cy), 3 x 3 alignments each; radii (C,)."""
    radius, angle = np.meshgrid(np.array(_RADII) * px_per_pt, _ANGLES, indexing="ij")
    x = cx + radius * np.cos(angle)  # (R, A) the spot
    y = cy + radius * np.sin(angle)
    slide_x, slide_y = np.meshgrid([0.0, -w / 2, -w], [0.0, -h / 2, -h], indexing="ij")
    x0 = (x[..., None, None] + slide_x).reshape(-1)
    y0 = (y[..., None, None] + slide_y).reshape(-1)
    radii = np.broadcast_to(radius[..., None, None], radius.shape + slide_x.shape).reshape(-1)
    return np.stack([x0, y0, x0 + w, y0 + h], axis=1), radii


def _place_once(order, sizes, centres, frame, px_per_pt, marker_px):
    """One greedy pass in `order`: each label takes its cheapest spot given those placed before."""
    markers = np.concatenate([centres - marker_px, centres + marker_px], axis=1)  # (M, 4)
    placed = np.zeros((0, 4))
    boxes = [None] * len(centres)
    for k in order:
        candidates, radii = _candidates(*centres[k], *sizes[k], px_per_pt)
        distances = _box_distances(centres, candidates)  # (C, M)
        own = distances[:, k]
        nearest_is_own = (own[:, None] < np.delete(distances, k, axis=1)).all(axis=1)
        inside = ((candidates[:, 0] >= frame[0]) & (candidates[:, 2] <= frame[2])
                  & (candidates[:, 1] >= frame[1]) & (candidates[:, 3] <= frame[3]))
        on_own = _overlaps(candidates, markers[k:k + 1]) > 0
        cost = np.lexsort((own, radii, ~inside, _overlaps(candidates, markers), ~nearest_is_own,
                           _overlaps(candidates, placed), on_own))
        boxes[k] = candidates[cost[0]]
        placed = np.vstack([placed, boxes[k]])
    return boxes


def _violations(boxes, centres) -> list[int]:
    """Labels that overlap another label or sit nearer another marker than their own."""
    boxes, bad = np.array(boxes), []
    for k in range(len(boxes)):
        distances = _box_distances(centres, boxes[k:k + 1])[0]
        if (_overlaps(boxes[k:k + 1], np.delete(boxes, k, axis=0))[0]
                or (np.delete(distances, k) <= distances[k]).any()):
            bad.append(k)
    return bad


def place_labels(ax, points, labels, *, fontsize: float = 7, marker_px: float = 5.0,
                 attempts: int = 24) -> list:
    """Label each point (data coordinates): no two labels overlap, each one's nearest marker is its
    own. Greedy passes over rings of candidate spots, most crowded points first, then the labels
    that broke a rule; the fewest broken rules wins. Display space: call it on the final layout."""
    fig = ax.figure
    if not hasattr(fig.canvas, "get_renderer"):  # a bare Figure (headless files): an Agg canvas
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    if not len(points):
        return []
    centres = ax.transData.transform(np.asarray(points, dtype=float))  # (M, 2) display
    sizes = []
    for label in labels:
        probe = ax.text(0, 0, label, fontsize=fontsize)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        sizes.append((extent.width, extent.height))
    frame = ax.get_window_extent(renderer).extents  # x0, y0, x1, y1
    px_per_pt = fig.dpi / 72.0
    gaps = np.hypot(*(centres[:, None, :] - centres[None, :, :]).transpose(2, 0, 1))  # (M, M)
    crowd = (gaps < 60 * px_per_pt).sum(1)
    order = list(np.argsort(-crowd, kind="stable"))
    best, rng = None, np.random.default_rng(0)  # seeded: the same figure every time
    for attempt in range(attempts):
        boxes = _place_once(order, sizes, centres, frame, px_per_pt, marker_px)
        bad = _violations(boxes, centres)
        if best is None or len(bad) < len(best[1]):
            best = (boxes, bad)
        if not bad:
            break
        rest = [k for k in order if k not in bad]
        if attempt % 2:  # every other pass shuffles the rest, so a stuck arrangement can change
            rest = list(rng.permutation(rest))
        order = list(rng.permutation(bad)) + rest  # the troubled labels choose first next time
    texts = []
    for k, (point, label, box) in enumerate(zip(points, labels, best[0], strict=True)):
        far = _box_distances(centres[k:k + 1], box[None, :])[0, 0] > 10 * px_per_pt
        anchor = ax.transData.inverted().transform((box[0], box[1]))
        leader = dict(arrowstyle="-", color="grey", lw=0.5, shrinkA=0, shrinkB=3) if far else None
        texts.append(ax.annotate(label, xy=point, xytext=anchor, textcoords="data",
                                 fontsize=fontsize, ha="left", va="bottom", arrowprops=leader))
    return texts


def _draw_pareto(rows, *, setting: str, metric: str, ax, title, colors, front: bool,
                 published=None):
    """plot_pareto without its labels: returns the points and labels still to place."""
    rows = [r for r in rows if r["setting"] == setting and r.get(metric) is not None]
    timed = [r for r in rows if r.get("ms_per_query")]
    for i, r in enumerate(timed):  # an extrapolated time hollow
        color = (colors or {}).get(r["method"], f"C{i % 10}")
        ax.scatter(r["ms_per_query"], r[metric], s=40, color=color, zorder=3,
                   facecolors=color if r.get("ms_measured", True) else "none")
    if front and timed:
        ms, accuracy = [r["ms_per_query"] for r in timed], [r[metric] for r in timed]
        on_front = [timed[i] for i in pareto_front(ms, accuracy)]
        ax.step([r["ms_per_query"] for r in on_front], [r[metric] for r in on_front], where="post",
                color="black", linewidth=1, alpha=0.6, zorder=2, label="Pareto front")
    papers = [r for r in (published or {}).get("rows", []) if r.get(metric) is not None]
    if timed:  # the axes fit the methods and published rows; a reference beyond them: at the edge
        ax.set_xscale("log")
        values = [r[metric] for r in timed] + [r[metric] for r in papers]
        low, high = min(values), max(values)
        pad = max(2.0, 0.12 * (high - low))
        ax.set_ylim(max(low - pad, -pad / 2), high + pad)  # room below a method at 0 for its label
        ms = [r["ms_per_query"] for r in timed]  # published rows: their own column at the right
        ax.set_xlim(min(ms) / 2.5, max(ms) * (400 if papers else 4))
    for r in [r for r in rows if not r.get("ms_per_query")]:  # the untimed references
        kind = "ceiling" if r["method"] == "oracle" else "reference"
        if timed and r[metric] > ax.get_ylim()[1]:  # above every method: an arrow at the top edge
            ax.annotate(f"{r['method']} {r[metric]:.1f} ({kind}) \u2191", xy=(0.99, 0.99),
                        xycoords="axes fraction", ha="right", va="top", fontsize=7, color="grey")
        else:
            ax.axhline(r[metric], color="grey", linestyle=":", linewidth=1,
                       label=f"{r['method']} ({kind})")
            ax.text(ax.get_xlim()[0] if timed else 0, r[metric], f" {r['method']}", va="bottom",
                    fontsize=8, color="grey")
    _draw_published(ax, papers, metric, published)
    ax.set_xlabel("ms per text query (median; hollow = extrapolated)")
    ax.set_ylabel(f"{metric} (%) on {setting}")
    ax.set_title(title or f"accuracy vs latency ({setting})")
    ax.grid(alpha=0.3, which="both")
    if front and timed:  # with published rows the lower right holds their column's lowest labels
        ax.legend(fontsize=7, loc="upper left" if papers else "lower right")
    return [(r["ms_per_query"], r[metric]) for r in timed], [r["method"] for r in timed]


def _draw_published(ax, papers, metric: str, published) -> None:
    """Published rows: a dashed level each, labelled at the right edge."""
    low, high = ax.get_ylim()
    previous = None
    for i, r in enumerate(sorted(papers, key=lambda r: r[metric])):
        ax.axhline(r[metric], color="tab:brown", linestyle="--", linewidth=0.8, alpha=0.6,
                   label=f"published ({published['gallery']:,}-photo gallery)" if i == 0 else None)
        close = previous is not None and (r[metric] - previous[0]) / (high - low) < 0.045
        if close and previous[1].get_va() == "bottom":  # the lower label goes under its line
            previous[1].set_va("top")
        text = ax.text(0.995, r[metric], f"{r['paper']} ({r['image_features']}) {r[metric]:.1f}",
                       transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=6.5,
                       color="tab:brown")
        previous = (r[metric], text)


def plot_pareto(rows, *, setting: str = "test", metric: str = "t2i_r1", ax=None, title=None,
                colors: dict | None = None, front: bool = True, published=None):
    """Accuracy against per-query latency of benchmark rows, one labelled point per method (log
    time axis; extrapolated times hollow). front: a step line through the Pareto front; untimed
    references are dotted levels; published: published_rows, at the right edge."""
    ax = ax if ax is not None else plt.subplots(figsize=(6.5, 4.5))[1]
    place_labels(ax, *_draw_pareto(rows, setting=setting, metric=metric, ax=ax, title=title,
                                   colors=colors, front=front, published=published))
    return ax


def plot_pareto_settings(rows, fig=None, *, settings=("test", "full"), direction: str = "t2i",
                         published=None):
    """plot_pareto for several settings side by side, each on its smallest recall cut-off.
    fig: a Figure to draw on (headless), or None; published: on the test panel."""
    panels = []
    for setting in settings:
        keys = {k for r in rows if r["setting"] == setting for k in r
                if k.startswith(f"{direction}_r")}
        metric = min(keys, key=lambda k: int(k.rsplit("_r", 1)[1]), default=f"{direction}_r1")
        panels.append({"rows": rows, "setting": setting, "metric": metric,
                       "published": published if setting == "test" else None})
    return plot_pareto_panels(panels, fig)


def plot_pareto_panels(panels: list[dict], fig=None):
    """Pareto panels ({rows, setting, metric[, title, published]}) side by side."""
    methods = list(dict.fromkeys(r["method"] for p in panels for r in p["rows"]
                                 if r.get("ms_per_query")))
    colors = {m: f"C{i}" if i < 10 else plt.cm.tab20b(i % 20) for i, m in enumerate(methods)}
    fig = fig if fig is not None else plt.figure(figsize=(6.5 * len(panels), 5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    pending = [_draw_pareto(p["rows"], setting=p["setting"], metric=p["metric"], ax=ax, front=True,
                            title=p.get("title"), colors=colors, published=p.get("published"))
               for ax, p in zip(axes, panels, strict=True)]
    fig.tight_layout()  # the layout first: labels are placed in display space
    for ax, (points, labels) in zip(axes, pending, strict=True):
        place_labels(ax, points, labels)
    return fig
