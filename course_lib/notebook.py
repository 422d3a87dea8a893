"""What every notebook repeats, written once: the setup cell, gallery tiling for timing, the
measured-vs-extrapolated latency plot, the recall table, and verdicts that respect noise and chance.

    device = setup(seed=SEED, cpu_threads=1)        # versions, device, seeds, thread counts
    big = tile_gallery(full, 123_287)               # a RetrievalSplit of n images, the originals last
    plot_latency({"cross_encoder": rows, ...})      # latency_vs_gallery rows; hollow = extrapolated
    print(recall_table({"VSE++": m1, "SCAN": m2}))  # retrieval_metrics dicts side by side
    print(compare_recalls("t2i R@1", "SCAN", 47.2, "VSE++", 7.0, n=5000, chance=0.1))
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from course_lib.settings import describe_environment, get_device, seed_everything


def setup(seed: int = 0, cpu_threads: int | None = None, show: bool = True) -> torch.device:
    """The versions-and-device cell: print what every result is measured with, seed everything, and
    (cpu_threads) cap torch's and FAISS's CPU threads. Returns the device models should use."""
    if cpu_threads:
        import faiss

        torch.set_num_threads(cpu_threads)
        faiss.omp_set_num_threads(cpu_threads)
    if show:
        for key, value in describe_environment().items():
            print(f"{key:>13}: {value}")
    seed_everything(seed)
    return get_device()


def tile_gallery(split, n: int, name: str | None = None):
    """A gallery of n images from `split`: its first n, or all of them tiled up to n. The copies come
    first and the originals last, so every caption stays with an original image and caption 0 is the
    same query whatever n (a repeated image costs a query what a new one would)."""
    if n < 1:
        raise ValueError(f"a gallery needs at least one image, got n={n}")
    copies = np.arange(max(n - split.n_images, 0)) % split.n_images
    originals = np.arange(min(n, split.n_images))
    return split.subset(np.r_[copies, originals], name=name or f"{split.name} tiled to {n:,}")


def tile_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (N, ...) repeated along its first axis until it has n rows: (n, ...)."""
    if len(x) == 0:
        raise ValueError("cannot tile an empty tensor")
    return x.repeat(-(-n // len(x)), *[1] * (x.dim() - 1))[:n]


def plot_latency(curves: dict, *, ax=None, colors: dict | None = None, styles: dict | None = None,
                 title: str = "one query (hollow = extrapolated)"):
    """ms per query against gallery size on log-log axes, one line per curve: curves maps a label
    to latency_vs_gallery rows. Measured points are filled and joined; extrapolated ones hollow and
    unjoined, so an estimate never looks like a measurement."""
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(6.5, 4.2))[1]
    for i, (label, rows) in enumerate(curves.items()):
        color = (colors or {}).get(label, f"C{i}")
        measured = [r for r in rows if r["measured"]]
        estimated = [r for r in rows if not r["measured"]]
        ax.loglog([r["n"] for r in measured], [r["ms_per_query"] for r in measured],
                  "o" + (styles or {}).get(label, "-"), color=color, label=str(label))
        if estimated:
            ax.loglog([r["n"] for r in estimated], [r["ms_per_query"] for r in estimated], "o", mfc="none",
                      color=color)
    ax.set_xlabel("gallery size N (images)")
    ax.set_ylabel("ms per query (median)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def recall_table(results: dict, ks=None, directions=("i2t", "t2i")) -> str:
    """A fixed-width table of retrieval_metrics dicts, one row per label: R@k per direction and AR.
    ks: the cut-offs to show (default: those the first dict holds). Missing values print as "–"."""
    first = next(iter(results.values()))
    if ks is None:
        ks = sorted({int(m.group(1)) for key in first if (m := re.fullmatch(r"(?:i2t|t2i)_r(\d+)", key))})
    columns = [f"{d}_r{k}" for d in directions for k in ks]
    width = max(len(str(label)) for label in results) + 2
    lines = [" " * width + "".join(f"{c.replace('_r', ' R@'):>10}" for c in columns) + f"{'AR':>8}"]
    for label, metrics in results.items():
        cells = [metrics.get(c) for c in columns]
        ar = metrics.get("ar", np.mean(cells) if None not in cells else None)
        lines.append(f"{str(label):>{width}}" + "".join("         –" if v is None else f"{v:10.1f}" for v in cells)
                     + ("       –" if ar is None else f"{ar:8.1f}"))
    return "\n".join(lines)


def chance_recall(n_candidates: int, k: int = 1, n_relevant: int = 1) -> float:
    """R@k (%) of a random ranking: the chance that at least one of n_relevant true items is among
    the top k of n_candidates (t2i: 1 true image; i2t: the image's 5 captions)."""
    k = min(k, n_candidates)
    miss = 1.0
    for i in range(k):  # all k picks miss the true items: prod (N - r - i) / (N - i)
        miss *= max(n_candidates - n_relevant - i, 0) / (n_candidates - i)
    return 100.0 * (1.0 - miss)


def recall_noise(recall: float, n: int) -> float:
    """Twice the binomial standard error (points) of a recall in % measured over n queries."""
    return 2.0 * math.sqrt(max(recall * (100.0 - recall), 0.0) / max(n, 1))


def near_chance(recall: float, n: int, chance: float) -> bool:
    """True when a recall over n queries is within noise (recall_noise at chance) of a random ranking."""
    return recall <= chance + recall_noise(chance, n)


def compare_recalls(question: str, a_label: str, a: float, b_label: str, b: float, n: int,
                    chance: float | None = None) -> str:
    """One line: recall a against recall b (in %, each over the same n queries), and a verdict. A gap
    counts only beyond twice the standard error of the difference (rough, and conservative since
    both come from the same queries); when both recalls are within noise of chance, nothing can be
    told at these sizes, whatever the gap."""
    noise = math.hypot(recall_noise(a, n), recall_noise(b, n))
    gap = a - b
    if chance is not None and near_chance(a, n, chance) and near_chance(b, n, chance):
        verdict = f"too small to tell at these sizes (both within noise of chance, {chance:.1f})"
    elif abs(gap) <= noise:
        verdict = "no clear difference"
    else:
        verdict = f"{a_label} higher" if gap > 0 else f"{b_label} higher"
    return (f"{question}: {a_label} {a:.1f} vs {b_label} {b:.1f} ({gap:+.1f}, "
            f"{'beyond' if abs(gap) > noise else 'within'} ±{noise:.1f}): {verdict}")


__all__ = ["setup", "tile_gallery", "tile_rows", "plot_latency", "recall_table", "chance_recall", "recall_noise",
           "near_chance", "compare_recalls"]
