"""Plots the course draws again and again: scene grids with captions, detector boxes,
counterfactual twins, the ranked images of one query, timing distributions and the
accuracy-latency (Pareto) plot."""

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


def show_retrieval(split, query_text: str, ranked_image_indices, true_image=None, *, cols: int = 5,
                   width: float = 2.0):
    """The top-ranked images of one text query in rank order, the true image framed in red
    (LightningDOT Fig. 4). ranked_image_indices: the split's image indices, best first."""
    ranked = [int(i) for i in np.asarray(ranked_image_indices).reshape(-1)]
    rows = max(1, (len(ranked) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * (width + 0.35) + 0.5), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for rank, (ax, i) in enumerate(zip(axes.flat, ranked), start=1):
        ax.axis("on")
        ax.imshow(_image(split, i), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        hit = true_image is not None and i == int(true_image)
        for spine in ax.spines.values():  # the ground truth in a red rectangle, as the paper draws it
            spine.set_edgecolor("red" if hit else "lightgrey")
            spine.set_linewidth(4 if hit else 0.5)
        ax.set_title(f"{rank}. {split.image_ids[i]}" + (" (true)" if hit else ""), fontsize=8,
                     color="red" if hit else "black")
    missing = true_image is not None and int(true_image) not in ranked
    fig.suptitle(textwrap.fill(f'"{query_text}"', 90) + ("\n(true image not in this list)" if missing else ""),
                 fontsize=9)
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


def plot_pareto(rows, *, setting: str = "test", metric: str = "t2i_r1", ax=None, title=None,
                colors: dict | None = None, front: bool = True):
    """Accuracy against per-query latency, one labelled point per method (log time axis).

    `rows` are benchmark result rows (dicts with method, setting, ms_per_query and the metric); a
    row whose time was extrapolated (ms_measured False) is drawn hollow, as in every course plot.
    front: join the methods no other one beats (faster and at least as accurate) with a step line
    (course_lib.studies.frontier.pareto_front). An untimed row (the oracle) is a horizontal ceiling.
    colors: method -> colour, to keep one colour per method across panels."""
    from course_lib.studies.frontier import pareto_front

    rows = [r for r in rows if r["setting"] == setting and r.get(metric) is not None]
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.5))
    timed = [r for r in rows if r.get("ms_per_query")]
    for i, r in enumerate(timed):
        measured = r.get("ms_measured", True)
        color = (colors or {}).get(r["method"], f"C{i % 10}")
        ax.scatter(r["ms_per_query"], r[metric], s=40, color=color, facecolors=color if measured else "none",
                   zorder=3)
        ax.annotate(r["method"], (r["ms_per_query"], r[metric]), textcoords="offset points",
                    xytext=(5, 4 if i % 2 else -9), fontsize=7)
    if front and timed:
        on_front = [timed[i] for i in pareto_front([r["ms_per_query"] for r in timed], [r[metric] for r in timed])]
        ax.step([r["ms_per_query"] for r in on_front], [r[metric] for r in on_front], where="post", color="black",
                linewidth=1, alpha=0.6, zorder=2, label="Pareto front")
    for r in rows:
        if not r.get("ms_per_query"):  # untimed references (the oracle ceiling) as a horizontal line
            kind = "ceiling" if r["method"] == "oracle" else "reference"
            ax.axhline(r[metric], color="grey", linestyle=":", linewidth=1, label=f"{r['method']} ({kind})")
            ax.text(ax.get_xlim()[0] if timed else 0, r[metric], f" {r['method']}", va="bottom",
                    fontsize=8, color="grey")
    if timed:
        ax.set_xscale("log")
    ax.set_xlabel("ms per text query (median; hollow = extrapolated)")
    ax.set_ylabel(f"{metric} (%) on {setting}")
    ax.set_title(title or f"accuracy vs latency ({setting})")
    ax.grid(alpha=0.3, which="both")
    if front and timed:
        ax.legend(fontsize=7, loc="best")
    return ax


def plot_pareto_settings(rows, fig=None, *, settings=("test", "full"), direction: str = "t2i"):
    """plot_pareto for several settings side by side, one colour per method in every panel, each
    panel on its setting's smallest recall cut-off (the benchmark's test has R@1, full starts at R@5).
    fig: a matplotlib Figure to draw on (a headless Figure for files); None = a new pyplot one."""
    methods = list(dict.fromkeys(r["method"] for r in rows if r.get("ms_per_query")))
    colors = {m: f"C{i}" if i < 10 else plt.cm.tab20b(i % 20) for i, m in enumerate(methods)}
    if fig is None:
        fig = plt.figure(figsize=(6.5 * len(settings), 5))
    axes = fig.subplots(1, len(settings), squeeze=False)[0]
    for ax, setting in zip(axes, settings):
        keys = {k for r in rows if r["setting"] == setting for k in r if k.startswith(f"{direction}_r")}
        metric = min(keys, key=lambda k: int(k.rsplit("_r", 1)[1]), default=f"{direction}_r1")
        plot_pareto(rows, setting=setting, metric=metric, ax=ax, colors=colors)
    fig.tight_layout()
    return fig
