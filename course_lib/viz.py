"""The figures the course draws again and again: scenes with captions, detector boxes, twins,
rankings, learning curves, timings (the Pareto plot: pareto_plot.py; diagrams: diagrams.py)."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure


def _image(split, index: int) -> np.ndarray:
    if split.images is not None:
        return split.images[index]
    if split.image_paths is not None:
        from PIL import Image

        return np.asarray(Image.open(split.image_paths[index]).convert("RGB"))
    raise ValueError(f"split {split.name!r} holds no pixels to draw (no images and no image_paths)")


def _captioned(ax, split, i: int, captions, title: str, fontsize: float) -> None:
    """Image i with `title` above it and the captions (indices) below it."""
    ax.imshow(_image(split, i), interpolation="nearest")
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    lines = [textwrap.shorten(split.captions[t], 64) for t in captions]
    ax.text(0.0, -0.04, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=fontsize)


def show_scenes(split, indices, *, n_captions: int = 5, cols: int = 4, width: float = 3.2,
                title=None):
    """A grid of images, each above its captions (at most n_captions of them)."""
    indices = list(indices)
    img2txt = split.img2txt()
    rows = (len(indices) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, squeeze=False,
                             figsize=(cols * width, rows * (width + 0.28 * n_captions)))
    for ax in axes.flat[len(indices):]:  # the grid's last row may have spare axes
        ax.axis("off")
    for ax, i in zip(axes.flat, indices, strict=False):
        _captioned(ax, split, i, img2txt[i][:n_captions], split.image_ids[i], 6.5)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_boxes(split, index: int, *, ax=None, labels=None):
    """One image with its detector boxes drawn over it; labels: one string per region slot."""
    image = _image(split, index)
    h, w = image.shape[:2]
    ax = ax if ax is not None else plt.subplots(figsize=(4, 4))[1]
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
    fig, axes = plt.subplots(len(pairs), 2, squeeze=False,
                             figsize=(2 * width + 2.5, len(pairs) * (width + 0.6)))
    for row, pair in zip(axes, pairs, strict=True):
        for ax, i, kind in zip(row, pair, ("scene ", "twin "), strict=True):
            _captioned(ax, split, i, img2txt[i][:n_captions], kind + split.image_ids[i], 7)
    fig.tight_layout()
    return fig


def _draw_ranked(axes, split, ranked, true_image=None, ids: bool = True) -> bool:
    """One ranking in axes, the true image framed red (LightningDOT Fig. 4); True if absent."""
    for ax in axes[len(ranked):]:  # the spare axes
        ax.axis("off")
    for rank, (ax, i) in enumerate(zip(axes, ranked, strict=False), start=1):
        ax.imshow(_image(split, i), interpolation="nearest")
        ax.set(xticks=[], yticks=[])
        hit = true_image is not None and i == int(true_image)
        for spine in ax.spines.values():  # the ground truth in a red frame, as the paper draws it
            spine.set_edgecolor("red" if hit else "lightgrey")
            spine.set_linewidth(4 if hit else 0.5)
        title = f"{rank}." + (f" {split.image_ids[i]}" if ids else "") + (" (true)" if hit else "")
        ax.set_title(title, fontsize=8, color="red" if hit else "black")
    return true_image is not None and int(true_image) not in ranked


def show_retrieval(split, query_text: str, ranked_image_indices, true_image=None, *, cols: int = 5,
                   width: float = 2.0):
    """The top-ranked images of one text query (image indices, best first), the true one framed."""
    ranked = [int(i) for i in np.asarray(ranked_image_indices).reshape(-1)]
    rows = max(1, (len(ranked) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * (width + 0.35) + 0.5),
                             squeeze=False)
    missing = _draw_ranked(list(axes.flat), split, ranked, true_image)
    fig.suptitle(textwrap.fill(f'"{query_text}"', 90)
                 + ("\n(true image not in this list)" if missing else ""), fontsize=9)
    fig.tight_layout()
    return fig


def show_rankings(split, rankings, *, width: float = 2.0, title=None):
    """Several rankings, one row each: (row title, image indices best first, true image or None)."""
    rankings = [(label, [int(i) for i in np.asarray(ranked).reshape(-1)], true)
                for label, ranked, true in rankings]
    cols = max(len(ranked) for _, ranked, _ in rankings)
    row_height = width + 0.6  # an image, its rank above it and the row's title above that (inches)
    height = len(rankings) * row_height + (0.5 if title else 0.1)
    fig, axes = plt.subplots(len(rankings), cols, figsize=(cols * width, height), squeeze=False)
    for row, (label, ranked, true_image) in zip(axes, rankings, strict=True):
        missing = _draw_ranked(row, split, ranked, true_image, ids=False)
        row[0].annotate(textwrap.shorten(label, 12 * cols * width)
                        + (" (true image not in this list)" if missing else ""),
                        xy=(0, 1), xycoords="axes fraction", xytext=(0, 15), fontsize=9,
                        textcoords="offset points", va="bottom", annotation_clip=False)
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.15 / height)
    # fixed margins, not tight_layout: a row title runs over the row's other images
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, wspace=0.05, hspace=0.55 / width,
                        top=1 - ((0.5 if title else 0.1) + 0.55) / height)
    return fig


def plot_learning_curve(histories: dict, *, metric: str = "t2i_r1", ax=None, title=None):
    """Recall against training CPU-seconds of {label: History} (evaluate_on=
    learning_curve_splits(bench)): val solid, train[:n] dashed in the same colour."""
    ax = ax if ax is not None else plt.subplots(figsize=(6, 3.5))[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4  # more colours than runs
    for color, (label, history) in zip(colors, histories.items(), strict=False):
        rows = [r for r in history.rows(eval=True) if f"val_{metric}" in r]
        if not rows:
            raise ValueError(f"run {label!r} has no evaluation rows with val_{metric}: train it "
                             "with evaluate_on=learning_curve_splits(bench) and an eval_every")
        x = [r["cpu_seconds"] for r in rows]
        ax.plot(x, [r[f"val_{metric}"] for r in rows], "o-", color=color, label=f"{label}: val")
        ax.plot(x, [r[f"train_{metric}"] for r in rows], "s--", color=color, alpha=0.6,
                label=f"{label}: train[:n]")
    ax.set_xlabel("training CPU-seconds")
    ax.set_ylabel(metric.replace("_r", " R@").replace("t2i", "text→image")
                  .replace("i2t", "image→text"))
    ax.set_ylim(bottom=0)
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_training_curves(curves: dict, fig=None, *, cols: int = 4):
    """One panel per model of results.json's "curves": val solid, train[:n] dashed, best ringed."""
    names = list(curves)
    if not names:
        raise ValueError("no curves to draw: the results hold no model with a learning curve")
    rows = -(-len(names) // cols)
    fig = fig or Figure(figsize=(3.4 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names, strict=False):  # the spare axes are hidden below
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
    """Box plot of the per-call times (ms) of {label: TimingResult}, on a linear axis from 0."""
    ax = ax if ax is not None else plt.subplots(figsize=(6, 3.5))[1]
    labels = list(results)
    ax.boxplot([results[k].times_ms for k in labels], showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel("ms per call")
    ax.set_ylim(bottom=0)  # a linear axis from 0, so that heights compare as ratios
    for x, k in enumerate(labels, start=1):
        median = results[k].median_ms
        ax.annotate(f"{median:.3g} ms", (x, median), textcoords="offset points", xytext=(14, 0),
                    va="center", fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return ax
