"""What every notebook repeats, written once: the setup cell, gallery tiling for timing, the
latency plot, the recall table, and verdicts that respect noise and chance."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from course_lib.colab import use_course_files
from course_lib.core import settings


def setup(seed: int = 0, cpu_threads: int | None = None, show: bool = True) -> torch.device:
    """The versions-and-device cell (on Colab, after finding the course's files): the device."""
    course = use_course_files()
    if cpu_threads:
        import faiss

        torch.set_num_threads(cpu_threads)
        faiss.omp_set_num_threads(cpu_threads)
    settings.plain_course_notes()  # a noisy timing reads "note: ...", not a UserWarning with a path
    if show:
        for key, value in settings.describe_environment().items():
            print(f"{key:>13}: {value}")
        if course is not None:
            print(f"{'course files':>13}: {course} (working in {Path.cwd()})")
    settings.seed_everything(seed)
    return settings.get_device()


def tile_gallery(split, n: int, name: str | None = None):
    """A gallery of n images: the split's first n, or copies of them followed by the originals, so
    every caption stays with an original image and caption 0 is the same query whatever n."""
    if n < 1:
        raise ValueError(f"a gallery needs at least one image, got n={n}")
    copies = np.arange(max(n - split.n_images, 0)) % split.n_images
    originals = np.arange(min(n, split.n_images))
    return split.subset(np.r_[copies, originals], name=name or f"{split.name} tiled to {n:,}")


def plot_latency(curves: dict, *, ax=None, colors: dict | None = None, styles: dict | None = None,
                 title: str = "one query (hollow = extrapolated)"):
    """ms per query against gallery size on log-log axes, curves: label -> latency_vs_gallery rows;
    extrapolated points hollow and unjoined, so an estimate never looks like a measurement."""
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(6.5, 4.2))[1]
    for i, (label, rows) in enumerate(curves.items()):
        color = (colors or {}).get(label, f"C{i}")
        measured = [r for r in rows if r["measured"]]
        estimated = [r for r in rows if not r["measured"]]
        ax.loglog([r["n"] for r in measured], [r["ms_per_query"] for r in measured],
                  "o" + (styles or {}).get(label, "-"), color=color, label=str(label))
        if estimated:
            ax.loglog([r["n"] for r in estimated], [r["ms_per_query"] for r in estimated], "o",
                      mfc="none", color=color)
    ax.set_xlabel("gallery size N (images)")
    ax.set_ylabel("ms per query (median)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def recall_table(results: dict, ks=None, directions=("i2t", "t2i")) -> str:
    """A fixed-width table of retrieval_metrics dicts, one row per label: R@k per direction, AR."""
    first = next(iter(results.values()))
    if ks is None:
        ks = sorted({int(m.group(1)) for key in first
                     if (m := re.fullmatch(r"(?:i2t|t2i)_r(\d+)", key))})
    columns = [f"{d}_r{k}" for d in directions for k in ks]
    width = max(len(str(label)) for label in results) + 2
    lines = [" " * width + "".join(f"{c.replace('_r', ' R@'):>10}" for c in columns) + f"{'AR':>8}"]
    for label, metrics in results.items():
        cells = [metrics.get(c) for c in columns]
        ar = metrics.get("ar", np.mean(cells) if None not in cells else None)
        lines.append(f"{str(label):>{width}}"
                     + "".join("         –" if v is None else f"{v:10.1f}" for v in cells)
                     + ("       –" if ar is None else f"{ar:8.1f}"))
    return "\n".join(lines)


def skip_remaining_cells(reason: str) -> None:
    """Print `reason` and make every later cell of the running notebook (if any) a no-op."""
    print(reason)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:  # the cells run after this
        shell.input_transformers_cleanup.append(lambda lines: ["pass\n"])


def chance_recall(n_candidates: int, k: int = 1, n_relevant: int = 1) -> float:
    """R@k (%) of a random ranking: P(one of n_relevant true items in the top k of n_candidates)."""
    # all k picks miss the true items: prod over i < k of (N - r - i) / (N - i)
    miss = math.prod(max(n_candidates - n_relevant - i, 0) / (n_candidates - i)
                     for i in range(min(k, n_candidates)))
    return 100.0 * (1.0 - miss)


def recall_noise(recall: float, n: int) -> float:
    """Twice the binomial standard error (points) of a recall in % measured over n queries."""
    return 2.0 * math.sqrt(max(recall * (100.0 - recall), 0.0) / max(n, 1))


def near_chance(recall: float, n: int, chance: float) -> bool:
    """Whether a recall over n queries is within noise (recall_noise at chance) of chance."""
    return recall <= chance + recall_noise(chance, n)


def compare_recalls(question: str, a_label: str, a: float, b_label: str, b: float, n: int,
                    chance: float | None = None) -> str:
    """One line: recall a against b (in %, over the same n queries) and a verdict; a gap counts
    only beyond twice its standard error, and not at all when both are within noise of chance."""
    at_chance = chance is not None and near_chance(a, n, chance) and near_chance(b, n, chance)
    noise = math.hypot(recall_noise(a, n), recall_noise(b, n))
    return _gap_line(question, a_label, a, b_label, b, noise,
                     f"both within noise of chance, {chance:.1f}" if at_chance else None)


def _gap_line(question: str, a_label: str, a: float, b_label: str, b: float, noise: float,
              at_chance: str | None, unit: str = "") -> str:
    gap = a - b
    if at_chance:
        verdict = f"too small to tell at these sizes ({at_chance})"
    elif abs(gap) <= noise:
        verdict = "no clear difference"
    else:
        verdict = f"{a_label} higher" if gap > 0 else f"{b_label} higher"
    return (f"{question}: {a_label} {a:.1f} vs {b_label} {b:.1f}{unit} ({gap:+.1f}, "
            f"{'beyond' if abs(gap) > noise else 'within'} ±{noise:.1f}): {verdict}")


def recovery_verdict(a_label: str, a: float, ref_label: str, ref: float, n: int,
                     target: float = 95.0, chance: float | None = None) -> tuple[str, bool | None]:
    """How much of a reference recall `ref` a recall `a` recovers (in %, over the same n queries),
    against a target share. -> (line, reached): reached None when ref is 0 or within noise of
    chance (a share of a chance-level number means nothing), else whether a >= target% of ref."""
    head = f"{a_label} {a:.1f} vs {ref_label} {ref:.1f}"
    at_chance = chance is not None and (near_chance(ref, n, chance)
                                        or ref - chance <= recall_noise(ref, n))
    if ref <= 0 or at_chance:
        why = (f"{ref_label} is not clearly above chance, {chance:.1f}" if ref > 0
               else f"{ref_label} is 0") + "; no share of it means anything"
        return f"{head}: too small to tell at these sizes ({why})", None
    goal, noise = target / 100.0 * ref, recall_noise(a, n)
    recovers = f"{head}: recovers {100.0 * a / ref:.0f}% (±{100 * noise / ref:.0f})"
    if a >= goal:
        return f"{recovers}, at least the {target:g}% target", True
    close = "within noise of it" if goal - a <= noise else "clearly short"
    return f"{recovers}, short of the {target:g}% target ({close})", False


def check_verdict(met: bool, values=(), *, n: int | None = None, chance: float | None = None,
                  measured: bool = True) -> str:
    """The word a lesson's check prints: "met" / "not met", or "too small to tell at these sizes
    (why)" when every recall in `values` is within noise of chance, all are 0, or the times were
    extrapolated."""
    values = [float(v) for v in values]
    if not measured:
        return "too small to tell at these sizes (its times are extrapolated, not measured)"
    if values and all(v == 0 for v in values):
        return "too small to tell at these sizes (every number it compares is 0)"
    if (values and chance is not None and n is not None
            and all(near_chance(v, n, chance) for v in values)):
        return f"too small to tell at these sizes (all within noise of chance, {chance:.2f})"
    return "met" if met else "not met"


def compare_rates(question: str, a_label: str, a: float, n_a: int, b_label: str, b: float,
                  n_b: int) -> str:
    """One line: rate a (%, of n_a trials) against b (of n_b), a two-proportion test's verdict."""
    pooled = (a * n_a + b * n_b) / max(n_a + n_b, 1)
    noise = 2.0 * math.sqrt(max(pooled * (100.0 - pooled), 0.0)
                            * (1.0 / max(n_a, 1) + 1.0 / max(n_b, 1)))
    gap = a - b
    ratio = f", {a / b:.1f}x" if b > 0 else ""
    head = f"{question}: {a_label} {a:.2f}% vs {b_label} {b:.2f}% ({gap:+.2f}{ratio}"
    if pooled <= 0:
        return f"{head}): too small to tell at these sizes (no event in either)"
    if abs(gap) <= noise:
        return f"{head}, within ±{noise:.2f}): too small to tell at these sizes"
    return f"{head}, beyond ±{noise:.2f}): {a_label if gap > 0 else b_label} higher"


def compare_ar(question: str, a_label: str, a: dict, b_label: str, b: dict, n_images: int,
               n_texts: int, ks=(1, 5, 10)) -> str:
    """One line: the AR of two retrieval_metrics dicts and a verdict, as compare_recalls."""
    n = {"i2t": n_images, "t2i": n_texts}
    relevant = {"i2t": max(n_texts // max(n_images, 1), 1), "t2i": 1}
    candidates = {"i2t": n_texts, "t2i": n_images}

    def ar(m):
        return float(np.mean([m[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks]))

    def noise(m):
        return float(np.mean([recall_noise(m[f"{d}_r{k}"], n[d])
                              for d in ("i2t", "t2i") for k in ks]))

    chance = {f"{d}_r{k}": chance_recall(candidates[d], k, relevant[d])
              for d in ("i2t", "t2i") for k in ks}
    a_ar, b_ar, chance_ar = ar(a), ar(b), ar(chance)
    at_chance = max(a_ar, b_ar) <= chance_ar + noise(chance)
    return _gap_line(question, a_label, a_ar, b_label, b_ar, math.hypot(noise(a), noise(b)),
                     f"both within noise of chance, AR {chance_ar:.1f}" if at_chance else None,
                     unit=" AR")


# test t2i R@1 the course asks of every dual encoder (docs/findings.md)
DUAL_ENCODER_TARGET = 25.0


def curve_summary(label: str, history, metric: str = "t2i_r1", target: float | None = None,
                  n_queries: int = 1000) -> str:
    """One line on a learning curve (a History with val_/train_ evaluations): where it ended, and
    whether val was still rising beyond noise over the last interval (would more training pay?).
    n_queries: the fewer queries of its two directions, for the noise."""
    rows = [r for r in history.rows(eval=True) if f"val_{metric}" in r]
    if not rows:
        raise ValueError(f"{label}: its history has no val_{metric} evaluations; train it through "
                         "its Method (which records the curve) or with "
                         "evaluate_on=learning_curve_splits(bench)")
    last = rows[-1]
    val, train, name = last[f"val_{metric}"], last[f"train_{metric}"], metric.replace("_r", " R@")
    line = (f"{label}: after {last['step']:,} steps ({last['cpu_seconds']:,.0f} CPU-s of training) "
            f"{name} val {val:.1f}, train[:n] {train:.1f}")
    if len(rows) >= 2:
        before = rows[-2][f"val_{metric}"]
        rising = val - before > recall_noise(max(val, before), n_queries)
        line += (f"; val {before:.1f} -> {val:.1f} over the last interval: "
                 + ("still rising, more training would pay" if rising else "flat within noise"))
    if target is not None:
        line += f"; the target {target:g}: " + ("met" if val >= target
                                                else f"missed by {target - val:.1f}")
    return line
