"""Plots the course draws again and again: scene grids with captions, detector boxes,
counterfactual twins, the ranked images of one query or of several, timing distributions, learning curves, the
accuracy-latency (Pareto) plot, and one boxes-and-arrows diagram per family of methods (draw_method)."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np


def _image(split, index: int) -> np.ndarray:
    if split.images is not None:
        return split.images[index]
    if split.image_paths is not None:
        from PIL import Image

        return np.asarray(Image.open(split.image_paths[index]).convert("RGB"))
    raise ValueError(f"split {split.name!r} holds no pixels to draw (no images and no image_paths)")


def show_scenes(split, indices, *, n_captions: int = 5, cols: int = 4, width: float = 3.2, title=None):
    """A grid of images, each above its captions (at most n_captions of them)."""
    indices = list(indices)
    img2txt = split.img2txt()
    rows = (len(indices) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * (width + 0.28 * n_captions)),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, indices):
        ax.imshow(_image(split, i), interpolation="nearest")
        lines = [textwrap.shorten(split.captions[t], 64) for t in img2txt[i][:n_captions]]
        ax.set_title(split.image_ids[i], fontsize=9)
        ax.text(0.0, -0.04, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=6.5)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_boxes(split, index: int, *, ax=None, labels=None):
    """One image with its detector boxes (UNITER's normalised x1, y1, x2, y2) drawn over it.

    labels: one string per region slot, written on a dark background at the box's top edge (at its
    bottom edge for boxes in the top rows), left-aligned for boxes in the left half and right-aligned
    in the right half, so that no label runs off the image."""
    image = _image(split, index)
    h, w = image.shape[:2]
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    ax.imshow(image, interpolation="nearest")
    mask = split.region_mask[index]
    for r in np.flatnonzero(mask):
        x1, y1, x2, y2 = split.boxes[index, r, :4]
        # pixel edges: a box [x1, x2] in normalised units covers pixels x1*w .. x2*w
        ax.add_patch(plt.Rectangle((x1 * w - 0.5, y1 * h - 0.5), (x2 - x1) * w, (y2 - y1) * h,
                                   fill=False, edgecolor="white", linewidth=1.2, linestyle="--"))
        if labels is not None and labels[r]:
            right = (x1 + x2) / 2 > 0.5  # anchor the text on the side of the box nearer the middle
            top = y1 * h >= 0.15 * h     # room above the box; otherwise write it under the box
            ax.text((x2 * w - 0.5) if right else (x1 * w - 0.5), (y1 * h - 1) if top else (y2 * h),
                    labels[r], color="white", fontsize=7, ha="right" if right else "left",
                    va="bottom" if top else "top",
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="black", alpha=0.6, linewidth=0))
    ax.set_title(f"{split.image_ids[index]}: {int(mask.sum())} regions", fontsize=9)
    ax.axis("off")
    return ax


def show_twins(split, pairs, *, n_captions: int = 2, width: float = 3.0):
    """Counterfactual twins side by side, each with captions true of it and false of its twin."""
    pairs = list(pairs)
    img2txt = split.img2txt()
    fig, axes = plt.subplots(len(pairs), 2, figsize=(2 * width + 2.5, len(pairs) * (width + 0.6)),
                             squeeze=False)
    for row, (a, b) in enumerate(pairs):
        for col, i in enumerate((a, b)):
            ax = axes[row, col]
            ax.imshow(_image(split, i), interpolation="nearest")
            ax.axis("off")
            lines = [textwrap.shorten(split.captions[t], 64) for t in img2txt[i][:n_captions]]
            ax.set_title(("scene " if col == 0 else "twin ") + split.image_ids[i], fontsize=9)
            ax.text(0.0, -0.04, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=7)
    fig.tight_layout()
    return fig


def _draw_ranked(axes, split, ranked, true_image=None, ids: bool = True) -> None:
    """One ranking into a row of axes, in rank order, the true image framed in red (LightningDOT Fig. 4).
    ids: title each image with its id after its rank (else the rank alone)."""
    for ax in axes:
        ax.axis("off")
    for rank, (ax, i) in enumerate(zip(axes, ranked), start=1):
        ax.axis("on")
        ax.imshow(_image(split, i), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        hit = true_image is not None and i == int(true_image)
        for spine in ax.spines.values():  # the ground truth in a red rectangle, as the paper draws it
            spine.set_edgecolor("red" if hit else "lightgrey")
            spine.set_linewidth(4 if hit else 0.5)
        ax.set_title(f"{rank}." + (f" {split.image_ids[i]}" if ids else "") + (" (true)" if hit else ""),
                     fontsize=8, color="red" if hit else "black")


def show_retrieval(split, query_text: str, ranked_image_indices, true_image=None, *, cols: int = 5,
                   width: float = 2.0):
    """The top-ranked images of one text query in rank order, the true image framed in red
    (LightningDOT Fig. 4). ranked_image_indices: the split's image indices, best first."""
    ranked = [int(i) for i in np.asarray(ranked_image_indices).reshape(-1)]
    rows = max(1, (len(ranked) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * (width + 0.35) + 0.5), squeeze=False)
    _draw_ranked(list(axes.flat), split, ranked, true_image)
    missing = true_image is not None and int(true_image) not in ranked
    fig.suptitle(textwrap.fill(f'"{query_text}"', 90) + ("\n(true image not in this list)" if missing else ""),
                 fontsize=9)
    fig.tight_layout()
    return fig


def show_rankings(split, rankings, *, width: float = 2.0, title=None):
    """Several rankings of the split's images, one row each (queries, or methods answering one query).
    rankings: (row title, ranked image indices best first, true image index or None) per row; a row
    whose true image is not in its list says so. Each image is titled with its rank alone."""
    rankings = [(label, [int(i) for i in np.asarray(ranked).reshape(-1)], true) for label, ranked, true in rankings]
    cols = max(len(ranked) for _, ranked, _ in rankings)
    row_height = width + 0.6  # an image, its rank above it and the row's title above that (inches)
    height = len(rankings) * row_height + (0.5 if title else 0.1)
    fig, axes = plt.subplots(len(rankings), cols, figsize=(cols * width, height), squeeze=False)
    for row, (label, ranked, true_image) in zip(axes, rankings):
        _draw_ranked(row, split, ranked, true_image, ids=False)
        missing = true_image is not None and int(true_image) not in ranked
        row[0].annotate(textwrap.shorten(label, 12 * cols * width) + (" (true image not in this list)" if missing else ""),
                        xy=(0, 1), xycoords="axes fraction", xytext=(0, 15), textcoords="offset points",
                        fontsize=9, va="bottom", annotation_clip=False)
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.15 / height)
    # fixed margins, not tight_layout: a row title runs over the row's other images
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - ((0.5 if title else 0.1) + 0.55) / height,
                        wspace=0.05, hspace=0.55 / width)
    return fig


def plot_learning_curve(histories: dict, *, metric: str = "t2i_r1", ax=None, title=None):
    """Recall against training CPU-seconds for one or more runs: {label: History}.

    Each run's evaluation rows (course_lib.core.train.History) must hold "cpu_seconds" and the
    metric under "val_" and "train_" (evaluate_on=learning_curve_splits(bench)). Val is drawn solid,
    train[:n] dashed in the same colour: where the two coincide the model has not yet fitted what it
    trains on; a gap that widens while val flattens is overfitting; a val curve still rising at its
    last point says more training would pay."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for color, (label, history) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, histories.items()):
        rows = [r for r in history.rows(eval=True) if f"val_{metric}" in r]
        if not rows:
            raise ValueError(f"run {label!r} has no evaluation rows with val_{metric}: train it with "
                             "evaluate_on=learning_curve_splits(bench) and an eval_every")
        x = [r["cpu_seconds"] for r in rows]
        ax.plot(x, [r[f"val_{metric}"] for r in rows], "o-", color=color, label=f"{label}: val")
        ax.plot(x, [r[f"train_{metric}"] for r in rows], "s--", color=color, alpha=0.6,
                label=f"{label}: train[:n]")
    ax.set_xlabel("training CPU-seconds")
    ax.set_ylabel(metric.replace("_r", " R@").replace("t2i", "text→image").replace("i2t", "image→text"))
    ax.set_ylim(bottom=0)
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_training_curves(curves: dict, fig=None, *, cols: int = 4):
    """One panel per trained model of a results.json's "curves" ({name: {"step", "val_r1", "train_r1"}}):
    t2i R@1 on val (solid) and on train[:n] (dashed) against the training step, the best val point
    ringed. What the sizes of a real-data run are read from: a val curve that peaks and sinks while
    train[:n] climbs is overfitting (keep the peak), one still rising at its last point wants more steps."""
    from matplotlib.figure import Figure

    names = list(curves)
    if not names:
        raise ValueError("no curves to draw: the results hold no model with a learning curve")
    rows = -(-len(names) // cols)
    fig = fig or Figure(figsize=(3.4 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        c = curves[name]
        ax.plot(c["step"], c["val_r1"], "o-", ms=3, label="val")
        if any(v is not None for v in c.get("train_r1", [])):
            ax.plot(c["step"], c["train_r1"], "s--", ms=3, alpha=0.6, label="train[:n]")
        best = max(range(len(c["val_r1"])), key=lambda i: c["val_r1"][i])
        ax.plot([c["step"][best]], [c["val_r1"][best]], "o", ms=9, mfc="none", color="k")
        ax.set_title(name, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.supxlabel("training step", fontsize=9)
    fig.supylabel("t2i R@1 (%)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_timings(results: dict, *, ax=None, title="per-call time"):
    """Box plot of the per-call times (ms) of several TimingResults, keyed by label, on a linear axis
    from 0 (so that one box twice as high took twice as long), each median written beside its box."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(results)
    ax.boxplot([results[k].times_ms for k in labels], showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel("ms per call")
    ax.set_ylim(bottom=0)  # a linear axis from 0, so that heights compare as ratios
    for x, k in enumerate(labels, start=1):
        median = results[k].median_ms
        ax.annotate(f"{median:.3g} ms", (x, median), textcoords="offset points", xytext=(14, 0), va="center",
                    fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return ax


def _box_distances(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(C, M) distance from each of M display points (M, 2) to each of C boxes (C, 4: x0, y0, x1, y1)."""
    dx = np.maximum(np.maximum(boxes[:, None, 0] - points[None, :, 0], 0), points[None, :, 0] - boxes[:, None, 2])
    dy = np.maximum(np.maximum(boxes[:, None, 1] - points[None, :, 1], 0), points[None, :, 1] - boxes[:, None, 3])
    return np.hypot(dx, dy)


def _overlaps(boxes: np.ndarray, others: np.ndarray) -> np.ndarray:
    """(C,) how many of `others` (P, 4) each candidate box (C, 4) overlaps."""
    if len(others) == 0:
        return np.zeros(len(boxes), dtype=int)
    return ((boxes[:, None, 0] < others[None, :, 2]) & (others[None, :, 0] < boxes[:, None, 2])
            & (boxes[:, None, 1] < others[None, :, 3]) & (others[None, :, 1] < boxes[:, None, 3])).sum(axis=1)


_RADII = (3.5, 5, 7, 9, 12, 16, 20, 25, 31, 38, 46, 60, 80, 105, 130)  # points from the marker, nearest first
_ANGLES = np.linspace(0, 2 * np.pi, 24, endpoint=False)


def _candidates(cx, cy, w, h, px_per_pt) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (C, 4) around (cx, cy) on rings of growing radius, each slid to 3 x 3 alignments, and their radii (C,)."""
    radius, angle = np.meshgrid(np.array(_RADII) * px_per_pt, _ANGLES, indexing="ij")
    x = cx + radius * np.cos(angle)  # (R, A) the spot
    y = cy + radius * np.sin(angle)
    slide_x, slide_y = np.meshgrid([0.0, -w / 2, -w], [0.0, -h / 2, -h], indexing="ij")
    x0 = (x[..., None, None] + slide_x).reshape(-1)
    y0 = (y[..., None, None] + slide_y).reshape(-1)
    radii = np.broadcast_to(radius[..., None, None], radius.shape + slide_x.shape).reshape(-1)
    return np.stack([x0, y0, x0 + w, y0 + h], axis=1), radii


def _place_once(order, sizes, centres, frame, px_per_pt, marker_px):
    """One greedy pass in `order`: each label takes its cheapest candidate given those placed before."""
    markers = np.concatenate([centres - marker_px, centres + marker_px], axis=1)  # (M, 4)
    placed = np.zeros((0, 4))
    boxes = [None] * len(centres)
    for k in order:
        candidates, radii = _candidates(*centres[k], *sizes[k], px_per_pt)
        distances = _box_distances(centres, candidates)  # (C, M)
        own = distances[:, k]
        others = np.delete(distances, k, axis=1)
        nearest_is_own = (own[:, None] < others).all(axis=1) if others.size else np.ones(len(own), bool)
        inside = ((candidates[:, 0] >= frame[0]) & (candidates[:, 2] <= frame[2]) & (candidates[:, 1] >= frame[1])
                  & (candidates[:, 3] <= frame[3]))
        on_own = _overlaps(candidates, markers[k:k + 1]) > 0
        cost = np.lexsort((own, radii, ~inside, _overlaps(candidates, markers), ~nearest_is_own,
                           _overlaps(candidates, placed), on_own))
        boxes[k] = candidates[cost[0]]
        placed = np.vstack([placed, boxes[k]])
    return boxes


def _violations(boxes, centres) -> list[int]:
    """Labels that overlap another label or sit nearer another marker than their own."""
    boxes = np.array(boxes)
    bad = set()
    for k in range(len(boxes)):
        if _overlaps(boxes[k:k + 1], np.delete(boxes, k, axis=0))[0]:
            bad.add(k)
        distances = _box_distances(centres, boxes[k:k + 1])[0]
        if (np.delete(distances, k) <= distances[k]).any():
            bad.add(k)
    return sorted(bad)


def place_labels(ax, points, labels, *, fontsize: float = 7, marker_px: float = 5.0, attempts: int = 24) -> list:
    """Label each point (data coordinates) so that no two labels overlap and each label's nearest
    marker is its own point's (no label sits on a neighbour), covering no marker where it can.

    Each label takes the cheapest of rings of candidate spots around its point, moving outwards;
    a label set away from its point gets a thin leader line. The most crowded points choose first;
    if some label still breaks a rule, the pass is repeated with those labels first (and the rest
    reshuffled every other time), and the arrangement with the fewest broken rules is kept. Call it once the axes' limits and the figure's
    layout are final: it works in display space. Returns the Text objects, in `points` order."""
    fig = ax.figure
    if not hasattr(fig.canvas, "get_renderer"):  # a bare Figure (headless files): give it an Agg canvas
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
    window = ax.get_window_extent(renderer)
    frame = (window.x0, window.y0, window.x1, window.y1)
    px_per_pt = fig.dpi / 72.0
    crowd = (np.hypot(*(centres[:, None, :] - centres[None, :, :]).transpose(2, 0, 1)) < 60 * px_per_pt).sum(1)
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
    boxes = best[0]
    texts = []
    for k, (point, label) in enumerate(zip(points, labels)):
        box = boxes[k]
        far = _box_distances(centres[k:k + 1], box[None, :])[0, 0] > 10 * px_per_pt
        anchor = ax.transData.inverted().transform((box[0], box[1]))
        texts.append(ax.annotate(label, xy=point, xytext=anchor, textcoords="data", fontsize=fontsize, ha="left",
                                 va="bottom", arrowprops=dict(arrowstyle="-", color="grey", lw=0.5, shrinkA=0,
                                                              shrinkB=3) if far else None))
    return texts


def _draw_pareto(rows, *, setting: str, metric: str, ax, title, colors, front: bool, published=None):
    """plot_pareto without its labels: returns the (point, label) pairs still to place."""
    from course_lib.studies.frontier import pareto_front

    rows = [r for r in rows if r["setting"] == setting and r.get(metric) is not None]
    timed = [r for r in rows if r.get("ms_per_query")]
    for i, r in enumerate(timed):
        measured = r.get("ms_measured", True)
        color = (colors or {}).get(r["method"], f"C{i % 10}")
        ax.scatter(r["ms_per_query"], r[metric], s=40, color=color, facecolors=color if measured else "none",
                   zorder=3)
    if front and timed:
        on_front = [timed[i] for i in pareto_front([r["ms_per_query"] for r in timed], [r[metric] for r in timed])]
        ax.step([r["ms_per_query"] for r in on_front], [r[metric] for r in on_front], where="post", color="black",
                linewidth=1, alpha=0.6, zorder=2, label="Pareto front")
    papers = [r for r in (published or {}).get("rows", []) if r.get(metric) is not None]
    if timed:  # the axes fit the methods and the published rows; a reference beyond them is marked at the edge
        ax.set_xscale("log")
        values = [r[metric] for r in timed] + [r[metric] for r in papers]
        low, high = min(values), max(values)
        pad = max(2.0, 0.12 * (high - low))
        ax.set_ylim(max(low - pad, -pad / 2), high + pad)  # room below a method at 0 for its label
        ms = [r["ms_per_query"] for r in timed]
        ax.set_xlim(min(ms) / 2.5, max(ms) * (400 if papers else 4))  # published rows: a column of their own
    for r in rows:
        if r.get("ms_per_query"):
            continue
        kind = "ceiling" if r["method"] == "oracle" else "reference"
        top = ax.get_ylim()[1]
        if timed and r[metric] > top:  # above every method: an arrow at the top edge says where it is
            ax.annotate(f"{r['method']} {r[metric]:.1f} ({kind}) \u2191", xy=(0.99, 0.99), xycoords="axes fraction",
                        ha="right", va="top", fontsize=7, color="grey")
        else:
            ax.axhline(r[metric], color="grey", linestyle=":", linewidth=1, label=f"{r['method']} ({kind})")
            ax.text(ax.get_xlim()[0] if timed else 0, r[metric], f" {r['method']}", va="bottom",
                    fontsize=8, color="grey")
    _draw_published(ax, papers, metric, published)
    ax.set_xlabel("ms per text query (median; hollow = extrapolated)")
    ax.set_ylabel(f"{metric} (%) on {setting}")
    ax.set_title(title or f"accuracy vs latency ({setting})")
    ax.grid(alpha=0.3, which="both")
    if front and timed:  # with published rows the lower right holds their column's lowest labels
        ax.legend(fontsize=7, loc="upper left" if papers else "lower right")
    return [((r["ms_per_query"], r[metric]), r["method"]) for r in timed]


def _draw_published(ax, papers, metric: str, published) -> None:
    """Published rows (untimed, on their own gallery): a dashed level each, labelled at the right edge,
    in the column the x-axis leaves free for them; of two levels too close for two lines of text, the
    lower is labelled under its line."""
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
    """Accuracy against per-query latency, one labelled point per method (log time axis).

    `rows` are benchmark result rows (dicts with method, setting, ms_per_query and the metric); a
    row whose time was extrapolated (ms_measured False) is drawn hollow, as in every course plot.
    front: join the methods no other one beats (faster and at least as accurate) with a step line
    (course_lib.studies.frontier.pareto_front). The axes fit the methods; an untimed reference row
    (the oracle ceiling, the bag of objects) is a dotted line, or an arrow at the top edge when it
    lies above every method. Labels never overlap (place_labels).
    colors: method -> colour, to keep one colour per method across panels. published: a dataset's
    published rows (course_lib.published.published_rows), untimed, marked at the right edge."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.5))
    pending = _draw_pareto(rows, setting=setting, metric=metric, ax=ax, title=title, colors=colors, front=front,
                           published=published)
    place_labels(ax, [p for p, _ in pending], [label for _, label in pending])
    return ax


def plot_pareto_settings(rows, fig=None, *, settings=("test", "full"), direction: str = "t2i", published=None):
    """plot_pareto for several settings side by side, one colour per method in every panel, each
    panel on its setting's smallest recall cut-off (the benchmark's test has R@1, full starts at R@5).
    fig: a matplotlib Figure to draw on (a headless Figure for files); None = a new pyplot one.
    published: course_lib.published.published_rows, marked on the test panel (R@1, its own gallery)."""
    panels = []
    for setting in settings:
        keys = {k for r in rows if r["setting"] == setting for k in r if k.startswith(f"{direction}_r")}
        metric = min(keys, key=lambda k: int(k.rsplit("_r", 1)[1]), default=f"{direction}_r1")
        panels.append({"rows": rows, "setting": setting, "metric": metric,
                       "published": published if setting == "test" else None})
    return plot_pareto_panels(panels, fig)


def plot_pareto_panels(panels: list[dict], fig=None):
    """Pareto panels side by side: each a dict of rows, setting, metric, an optional title and published rows; one
    colour per method in every panel; labels placed once the layout is final.
    fig: a matplotlib Figure to draw on (a headless Figure for files); None = a new pyplot one."""
    methods = list(dict.fromkeys(r["method"] for p in panels for r in p["rows"] if r.get("ms_per_query")))
    colors = {m: f"C{i}" if i < 10 else plt.cm.tab20b(i % 20) for i, m in enumerate(methods)}
    if fig is None:
        fig = plt.figure(figsize=(6.5 * len(panels), 5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    pending = [_draw_pareto(p["rows"], setting=p["setting"], metric=p["metric"], ax=ax, title=p.get("title"),
                            colors=colors, front=True, published=p.get("published")) for ax, p in zip(axes, panels)]
    fig.tight_layout()  # the layout first: labels are placed in display space
    for ax, items in zip(axes, pending):
        place_labels(ax, [p for p, _ in items], [label for _, label in items])
    return fig




# ----------------------------------------------------------------------------- method diagrams
# One drawing helper (draw_diagram) and one small spec per family (DIAGRAMS). A spec: a title, boxes
# {key: (label, x, y, kind)} with centres in a unit grid, and arrows (from, to, label or "").

_KIND_COLOURS = {"image": "#dbe9f6", "text": "#fde2c8", "model": "#e4e4e4", "score": "#d9f0d3",
                 "index": "#efe1f5"}
_BOX_W, _BOX_H = 2.3, 0.72  # a box's size in grid units

DIAGRAMS = {
    "dual_encoder": {
        "title": "A dual encoder (VSE++): each side encoded alone, compared by one dot product",
        "boxes": {"image": ("image\n(regions or pixels)", 0, 1, "image"),
                  "f": ("image encoder f", 2.8, 1, "model"),
                  "v": ("image vector f(x)\n(computed offline)", 5.6, 1, "image"),
                  "caption": ("caption", 0, 0, "text"),
                  "g": ("text encoder g", 2.8, 0, "model"),
                  "u": ("text vector g(y)\n(one per query)", 5.6, 0, "text"),
                  "score": ("score = f(x) · g(y):\nunit vectors, a cosine", 8.4, 0.5, "score")},
        "arrows": [("image", "f", ""), ("f", "v", ""), ("caption", "g", ""), ("g", "u", ""),
                   ("v", "score", ""), ("u", "score", "")],
    },
    "cross_encoder": {
        "title": "A single-stream cross-encoder (UNITER-style): one transformer reads caption and image together",
        "boxes": {"caption": ("caption words", 0, 1, "text"),
                  "image": ("image regions", 0, 0, "image"),
                  "sequence": ("one sequence\n[CLS] words [SEP] regions", 2.8, 0.5, "model"),
                  "transformer": ("transformer:\nevery word attends\nto every region", 5.6, 0.5, "model"),
                  "score": ("[CLS] output → score,\none pass per pair", 8.4, 0.5, "score")},
        "arrows": [("caption", "sequence", ""), ("image", "sequence", ""), ("sequence", "transformer", ""),
                   ("transformer", "score", "")],
    },
    "retrieve_rerank": {
        "title": "Retrieve, then re-rank (LightningDOT): an index narrows N images to M, a cross-encoder orders them",
        # the re-ranker reads each candidate pair itself; its score alone orders the M
        # (TwoStageMethod: the two scores are not fused)
        "boxes": {"gallery": ("gallery: N images", 0, 1, "image"),
                  "vectors": ("image vectors\n(offline)", 2.8, 1, "image"),
                  "query": ("query caption", 0, 0, "text"),
                  "encoder": ("text encoder\n([CLS] vector)", 2.8, 0, "model"),
                  "index": ("FAISS index search:\ntop M of N", 5.6, 0.5, "index"),
                  "rerank": ("cross-encoder re-scores\nthe M pairs (caption +\n"
                             "regions), one pass each", 8.4, 0.5, "model"),
                  "ranking": ("final ranking: the M\nby the cross-encoder's\nscore alone", 11.2,
                              0.5, "score")},
        "arrows": [("gallery", "vectors", ""), ("vectors", "index", ""), ("query", "encoder", ""),
                   ("encoder", "index", ""), ("index", "rerank", ""), ("rerank", "ranking", "")],
    },
    "ubert": {
        "title": "U-BERT: an intra-modal part to index, plus an inter-modal residual to re-rank",
        # BERT_cross reads the token states the tower pass caches (UBERTStates), not the raw
        # inputs: the gallery's are computed offline, so stage 2 runs only L_c layers a candidate
        "boxes": {"image": ("gallery: image regions", 0, 2.4, "image"),
                  "img_tower": ("BERT_img (intra-modal):\noffline, once per image", 2.8, 2.4,
                                "model"),
                  "img_states": ("cached per image: I_intra\n+ tokens for BERT_cross", 5.6, 2.4,
                                 "image"),
                  "caption": ("query caption", 0, 0, "text"),
                  "txt_tower": ("BERT_txt (intra-modal):\nonline, once per query", 2.8, 0, "model"),
                  "txt_states": ("the query's T_intra\n+ tokens for BERT_cross", 5.6, 0, "text"),
                  "s1": ("stage 1, indexed:\ns1 = cos(I_intra, T_intra),\nall N → top K", 5.6, 1.2,
                         "index"),
                  "cross": ("light BERT_cross (L_c layers)\nreads the K pairs' cached\ntokens → "
                            "I_inter, T_inter", 8.4, 1.2, "model"),
                  "s2": ("stage 2 re-orders the K by\ns2 = cos(α·I_intra + I_inter,\n"
                         "α·T_intra + T_inter)", 11.2, 1.2, "score")},
        "arrows": [("image", "img_tower", ""), ("img_tower", "img_states", ""),
                   ("caption", "txt_tower", ""), ("txt_tower", "txt_states", ""),
                   ("img_states", "s1", ""), ("txt_states", "s1", ""), ("s1", "cross", "top K"),
                   ("img_states", "cross", ""), ("txt_states", "cross", ""), ("cross", "s2", "")],
    },
    "hivlp": {
        "title": "HiVLP: early outputs of growing width, searched coarse to fine",
        # each level's EOL reads a block of the tower (the same or a deeper one for a later level),
        # not the level before it: one tower pass gives every level
        "boxes": {"image": ("image tower, offline: one\npass per image, its blocks\n"
                            "feed the levels' EOLs", 0, 1.1, "image"),
                  "text": ("text tower, online: one\npass per query, its blocks\n"
                           "feed the levels' EOLs", 11.2, 1.1, "text"),
                  "v1": ("image level 1:\nEOL_1 → narrow d_1", 2.8, 2.2, "image"),
                  "v2": ("image level 2:\nEOL_2 → wider d_2", 2.8, 1.1, "image"),
                  "v3": ("image level 3: EOL_3 of\nthe last block → widest d_3", 2.8, 0, "image"),
                  "t1": ("text level 1:\nEOL_1 → narrow d_1", 8.4, 2.2, "text"),
                  "t2": ("text level 2:\nEOL_2 → wider d_2", 8.4, 1.1, "text"),
                  "t3": ("text level 3: EOL_3 of\nthe last block → widest d_3", 8.4, 0, "text"),
                  "c1": ("level 1: S¹ at width d_1\nscores all N, keeps N2", 5.6, 2.2, "index"),
                  "c2": ("level 2: S² at d_2 re-scores\nthe N2, keeps N3", 5.6, 1.1, "score"),
                  "c3": ("level 3: S³ at d_3 orders\nthe N3 (final ranking)", 5.6, 0, "score")},
        "arrows": [("image", "v1", ""), ("image", "v2", ""), ("image", "v3", ""),
                   ("text", "t1", ""), ("text", "t2", ""), ("text", "t3", ""),
                   ("v1", "c1", ""), ("t1", "c1", ""), ("v2", "c2", ""), ("t2", "c2", ""),
                   ("v3", "c3", ""), ("t3", "c3", ""), ("c1", "c2", ""), ("c2", "c3", "")],
    },
    "fast_slow": {
        "title": "Thinking Fast and Slow: a captioning likelihood teaches a dual encoder, then re-ranks its top K",
        # h is a summed log-likelihood (forward + backward decoders): eq. 9 adds β·f·g to it
        "boxes": {"slow": ("Slow: h(x, y), the caption's\nlog-likelihood given the image\n"
                           "(forward + backward)", 2.8, 1.4, "model"),
                  "fast": ("Fast: dual encoder f(x) · g(y),\nthe gallery's f(x) offline", 2.8, 0,
                           "model"),
                  "query": ("query caption", 0, 0, "text"),
                  "top": ("Fast's top K\nof N images", 5.6, 0, "index"),
                  "rescore": ("Slow re-scores the K from\ncached image keys / values:\n"
                              "h(x, y) + β · f(x) · g(y)", 8.7, 0, "score")},
        "arrows": [("slow", "fast", "distillation\n(training)"), ("query", "fast", ""), ("fast", "top", ""),
                   ("top", "rescore", ""), ("slow", "rescore", "")],
    },
}


def draw_diagram(spec: dict, ax=None):
    """Boxes and arrows of one diagram spec (see DIAGRAMS): each box a rounded patch with its label
    (gid "box:KEY"), each arrow an annotation from one box's centre to the other's, clipped at their
    edges (gid "arrow:FROM->TO"). Returns the axes."""
    from matplotlib.patches import FancyBboxPatch

    boxes = spec["boxes"]
    xs = [x for _, x, _, _ in boxes.values()]
    ys = [y for _, _, y, _ in boxes.values()]
    if ax is None:
        width, height = max(xs) - min(xs) + _BOX_W + 0.6, max(ys) - min(ys) + _BOX_H + 0.9
        _, ax = plt.subplots(figsize=(1.05 * width, 1.05 * height))
    patches = {}
    for key, (label, x, y, kind) in boxes.items():
        patch = FancyBboxPatch((x - _BOX_W / 2, y - _BOX_H / 2), _BOX_W, _BOX_H, boxstyle="round,pad=0.02",
                               facecolor=_KIND_COLOURS[kind], edgecolor="dimgrey", linewidth=1, gid=f"box:{key}")
        ax.add_patch(patch)
        ax.text(x, y, label, ha="center", va="center", fontsize=8, gid=f"label:{key}")
        patches[key] = patch
    for start, end, label in spec["arrows"]:
        (_, x0, y0, _), (_, x1, y1, _) = boxes[start], boxes[end]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), gid=f"arrow:{start}->{end}",
                    arrowprops=dict(arrowstyle="-|>", color="black", lw=1, patchA=patches[start],
                                    patchB=patches[end], shrinkA=2, shrinkB=2))
        if label:  # beside a vertical arrow, above any other
            upright = abs(x1 - x0) < abs(y1 - y0)
            ax.text((x0 + x1) / 2 + (0.1 if upright else 0), (y0 + y1) / 2 + (0 if upright else 0.1), label,
                    ha="left" if upright else "center", va="center" if upright else "bottom", fontsize=7,
                    color="dimgrey", gid=f"arrow-label:{start}->{end}")
    ax.set_xlim(min(xs) - _BOX_W / 2 - 0.3, max(xs) + _BOX_W / 2 + 0.3)
    ax.set_ylim(min(ys) - _BOX_H / 2 - 0.3, max(ys) + _BOX_H / 2 + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(textwrap.fill(spec["title"], 100), fontsize=10)
    return ax


def draw_method(name: str, ax=None):
    """The diagram of one family of methods: a key of DIAGRAMS ("dual_encoder", "cross_encoder",
    "retrieve_rerank", "ubert", "hivlp", "fast_slow"). Returns the axes."""
    if name not in DIAGRAMS:
        raise KeyError(f"no diagram {name!r}; choose from {sorted(DIAGRAMS)}")
    return draw_diagram(DIAGRAMS[name], ax=ax)
