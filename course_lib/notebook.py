"""What every notebook repeats, written once: the setup cell, gallery tiling for timing, the
measured-vs-extrapolated latency plot, the recall table, and verdicts that respect noise and chance.

    device = setup(seed=SEED, cpu_threads=1)        # versions, device, seeds, thread counts
    big = tile_gallery(full, 123_287)               # a RetrievalSplit of n images, originals last
    plot_latency({"cross_encoder": rows, ...})      # latency_vs_gallery rows; hollow = extrapolated
    print(recall_table({"VSE++": m1, "SCAN": m2}))  # retrieval_metrics dicts side by side
    print(compare_recalls("t2i R@1", "SCAN", 47.2, "VSE++", 7.0, n=5000, chance=0.1))
    line, reached = recovery_verdict("rerank@20", 19.5, "cross-encoder", 20.0, n=5000, target=95)
    print(compare_rates("false negatives", "mined", 12.0, 2000, "random", 3.0, 2000))
    print(compare_ar("pre-training?", "PT", m_a, "no PT", m_b, n_images=1000, n_texts=5000))
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from course_lib.colab import use_course_files
from course_lib.core import settings


def setup(seed: int = 0, cpu_threads: int | None = None, show: bool = True) -> torch.device:
    """The versions-and-device cell: print what every result is measured with, seed everything,
    (cpu_threads) cap torch's and FAISS's CPU threads; -> the device models should use. On Colab it
    first finds or fetches the course's files the notebook's paths lead to (course_lib.colab)."""
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
    """A gallery of n images from `split`: its first n, or all of them tiled up to n. The copies
    come first and the originals last, so every caption stays with an original image and caption 0
    is the same query whatever n (a repeated image costs a query what a new one would)."""
    if n < 1:
        raise ValueError(f"a gallery needs at least one image, got n={n}")
    copies = np.arange(max(n - split.n_images, 0)) % split.n_images
    originals = np.arange(min(n, split.n_images))
    return split.subset(np.r_[copies, originals], name=name or f"{split.name} tiled to {n:,}")


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
            ax.loglog([r["n"] for r in estimated], [r["ms_per_query"] for r in estimated], "o",
                      mfc="none", color=color)
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
    """Print `reason` and make every later cell of the running notebook a no-op: a lesson whose data
    are absent (lesson 08 without real photos) then runs top to bottom, under nbmake too, and says
    why it did nothing. Outside IPython it only prints (a script or test running the cell alone)."""
    print(reason)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    shell.input_transformers_cleanup.append(lambda lines: ["pass\n"])  # the cells run after this


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
    """Whether a recall over n queries is within noise (recall_noise at chance) of chance."""
    return recall <= chance + recall_noise(chance, n)


def compare_recalls(question: str, a_label: str, a: float, b_label: str, b: float, n: int,
                    chance: float | None = None) -> str:
    """One line: recall a against recall b (in %, over the same n queries) and a verdict. A gap
    counts only beyond twice the standard error of the difference (rough; conservative, as both come
    from the same queries); both within noise of chance: nothing can be told, whatever the gap."""
    at_chance = chance is not None and near_chance(a, n, chance) and near_chance(b, n, chance)
    noise = math.hypot(recall_noise(a, n), recall_noise(b, n))
    return _gap_line(question, a_label, a, b_label, b, noise,
                     f"both within noise of chance, {chance:.1f}" if at_chance else None)


def _gap_line(question: str, a_label: str, a: float, b_label: str, b: float, noise: float,
              at_chance: str | None, unit: str = "") -> str:
    """The line compare_recalls and compare_ar print: a vs b, the gap against its noise, verdict."""
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
    """How much of a reference recall `ref` a recall `a` recovers (both in %, over the same n
    queries), against a target share (in %), e.g. re-ranking's R@1 against the cross-encoder's.
    -> (line, reached): reached None when nothing can be told at these sizes (ref is 0, or within
    noise of chance, counting the noise at chance or at ref, whichever is larger: a share of a
    chance-level number means nothing), else whether a is at least target% of ref; the line gives
    the share's ± (twice a's standard error, over ref) and whether a shortfall is within it."""
    share = 100.0 * a / ref if ref > 0 else float("nan")
    head = f"{a_label} {a:.1f} vs {ref_label} {ref:.1f}"
    at_chance = chance is not None and (near_chance(ref, n, chance)
                                        or ref - chance <= recall_noise(ref, n))
    if ref <= 0 or at_chance:
        why = (f"{ref_label} is not clearly above chance, {chance:.1f}" if ref > 0
               else f"{ref_label} is 0") + "; no share of it means anything"
        return f"{head}: too small to tell at these sizes ({why})", None
    goal = target / 100.0 * ref
    noise = recall_noise(a, n)
    recovers = f"{head}: recovers {share:.0f}% (±{100 * noise / ref:.0f})"
    if a >= goal:
        return f"{recovers}, at least the {target:g}% target", True
    close = "within noise of it" if goal - a <= noise else "clearly short"
    return f"{recovers}, short of the {target:g}% target ({close})", False


def check_verdict(met: bool, values=(), *, n: int | None = None, chance: float | None = None,
                  measured: bool = True) -> str:
    """The word a lesson's check prints: "met" / "not met", or "too small to tell at these sizes
    (why)" when the numbers it rests on cannot carry it: every recall in `values` (in %, over n
    queries) within noise of chance, a ratio or share of numbers all at 0, or a time that was
    extrapolated rather than measured. Every computed verdict of the lessons goes through here."""
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
    """One line: rate a (in %, over n_a trials) against rate b (in %, over n_b trials) and a verdict
    from a two-proportion test (pooled rate, gap beyond twice its standard error); no event in
    either, or a gap within noise: "too small to tell at these sizes", not a ratio of a few counts.
    For b from chance (a random draw), a from a method: false negatives, mined vs random."""
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
    """One line: the AR (mean of i2t and t2i R@k over ks) of two retrieval_metrics dicts over the
    same n_images image and n_texts text queries (5 captions per image), and a verdict as in
    compare_recalls. AR's noise: the mean of its recalls' (conservative: the same queries); both
    within noise of a random ranking's AR: nothing can be told at these sizes."""
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
    chance_ar, chance_noise = ar(chance), noise(chance)
    a_ar, b_ar = ar(a), ar(b)
    at_chance = a_ar <= chance_ar + chance_noise and b_ar <= chance_ar + chance_noise
    return _gap_line(question, a_label, a_ar, b_label, b_ar, math.hypot(noise(a), noise(b)),
                     f"both within noise of chance, AR {chance_ar:.1f}" if at_chance else None,
                     unit=" AR")


__all__ = ["check_verdict", "setup", "skip_remaining_cells", "tile_gallery", "plot_latency",
           "recall_table", "chance_recall", "recall_noise", "near_chance", "compare_recalls",
           "recovery_verdict", "compare_rates", "compare_ar"]


# test t2i R@1 the course asks of every dual encoder (VSE++, LightningDOT, U-BERT's stage 1, HiVLP,
# Fast): a 40-line one's (docs/findings.md, "Dual encoders trained to what one vector can do")
DUAL_ENCODER_TARGET = 25.0


def curve_summary(label: str, history, metric: str = "t2i_r1", target: float | None = None,
                  n_queries: int = 1000) -> str:
    """One line on a learning curve (a History with val_/train_ evaluations and cpu_seconds, as
    every dual encoder's Method records): where it ended, train[:n] against val, and whether val was
    still rising over the last interval (beyond twice its binomial standard error): would more
    training pay? target: the recall the course asks of it (README's table), met or not.
    n_queries: the fewer queries of its two directions (its galleries' images): the noise."""
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
