"""Timing done right: device-correct benchmarks, latency vs gallery size, and speedup tables.
GPU work is asynchronous: `time.perf_counter` around a CUDA call measures only the launch, so
`measure` times CUDA with events and a synchronisation, after untimed warm-up calls.
`latency_vs_gallery` fits t(n) = a + b*n and extrapolates sizes too slow to measure, as
LightningDOT estimates its starred numbers; `speedup_table` turns that into its Table 3."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from course_lib.core.frozen_states import FROZEN_STATES
from course_lib.core.settings import CourseNote, get_device


@dataclass
class TimingResult:
    """Per-call times of one benchmark, in milliseconds."""

    median_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int
    device: str
    times_ms: list[float] = field(repr=False)

    @classmethod
    def from_times(cls, times_ms: Sequence[float], device: str) -> TimingResult:
        times = np.asarray(times_ms, dtype=np.float64)  # (repeats,)
        return cls(
            median_ms=float(np.median(times)), mean_ms=float(times.mean()),
            std_ms=float(times.std(ddof=1)) if len(times) > 1 else 0.0,
            min_ms=float(times.min()), max_ms=float(times.max()),
            p10_ms=float(np.percentile(times, 10)), p90_ms=float(np.percentile(times, 90)),
            repeats=len(times), device=device, times_ms=times.tolist())

    @property
    def p25_ms(self) -> float:
        return float(np.percentile(self.times_ms, 25))

    @property
    def p75_ms(self) -> float:
        return float(np.percentile(self.times_ms, 75))

    def __str__(self) -> str:
        return (f"{_fmt(self.median_ms)} ms median (p10 {_fmt(self.p10_ms)}, "
                f"p90 {_fmt(self.p90_ms)}; {self.repeats} runs on {self.device})")


def _fmt(ms: float) -> str:
    """Three significant digits, without switching to exponent notation for long times."""
    return f"{ms:.0f}" if abs(ms) >= 1000 else f"{ms:.3g}"


def _resolve_device(device) -> torch.device:
    """None -> CPU clock; "auto" -> settings.get_device(); else the device given."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return get_device() if device else torch.device("cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"cannot time device type {device.type!r}; use 'cpu', 'cuda' or 'mps'")
    backend = {"cuda": torch.cuda, "mps": torch.backends.mps}.get(device.type)
    if backend is not None and not backend.is_available():
        raise ValueError(f"device {device} was asked for but {device.type.upper()} is not "
                         "available; use device=None (CPU clock) or 'auto'")
    return device


def measure(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 20,
              device=None) -> TimingResult:
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed calls, one at a time.
    device: None times with the CPU clock, which still synchronises CUDA if this process has used
    it; "cuda" with CUDA events per call; "mps" synchronises MPS around the CPU clock; "auto"
    picks `settings.get_device()`. Pass device="cuda" (or "auto") when `fn` launches GPU work."""
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not callable(fn):
        raise TypeError("fn must be a callable taking no arguments, e.g. lambda: model(x)")
    device = _resolve_device(device)
    with _timed(device):
        for _ in range(warmup):
            fn()
        clock = _call_clock(device)
        times_ms = [clock(fn) for _ in range(repeats)]
    return TimingResult.from_times(times_ms, str(device))


@contextlib.contextmanager
def _timed(device: torch.device):
    """The clock's context: a CUDA device made current, and the frozen-states memo paused, so each
    timed call pays for every caption it reads, as a new query would."""
    cuda = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with FROZEN_STATES.paused(), cuda:
        yield


def _call_clock(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """clock(fn): one call's milliseconds on `device`'s clock; fn's result is kept in clock.last."""
    if device.type == "cuda":
        torch.cuda.synchronize()  # warm-up work must not leak into the first timing

        def clock(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            clock.last = fn()
            end.record()
            torch.cuda.synchronize()  # wait for fn's kernels, so end has happened
            return start.elapsed_time(end)

        return clock
    sync = (torch.mps.synchronize if device.type == "mps" else torch.cuda.synchronize
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def clock(fn) -> float:
        if sync:
            sync()
        start = time.perf_counter()
        clock.last = fn()
        if sync:
            sync()
        return (time.perf_counter() - start) * 1e3

    return clock


@dataclass
class StageProfile:
    """Where one query's time goes (ms). glue = the whole query's median - the stages' summed
    medians: the Python between the stages (slightly negative is noise)."""

    stages: list[dict]  # [{"stage", "median_ms", "p25_ms", "p75_ms"}]
    total: TimingResult
    glue_ms: float

    def table(self) -> str:
        """Markdown: a row per stage, then the glue and the total, each with its share."""
        total = self.total.median_ms
        rows = [(s["stage"], s["median_ms"], f"{_fmt(s['p25_ms'])}–{_fmt(s['p75_ms'])}")
                for s in self.stages]
        rows += [("Python glue", self.glue_ms, "–"),
                 ("whole query", total, f"{_fmt(self.total.p25_ms)}–{_fmt(self.total.p75_ms)}")]
        lines = ["| stage | median ms | IQR ms | share |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {_fmt(ms)} | {iqr} | {100 * ms / total:.0f}% |"
                  for name, ms, iqr in rows]
        return "\n".join(lines)


def profile_stages(stages, *, query_fn: Callable[[], object] | None = None, warmup: int = 10,
                   repeats: int = 200, device=None) -> StageProfile:
    """Time a query stage by stage: `stages` is [(name, fn), ...], the first fn taking None, each
    next the previous one's output (serving.TextQueryPath.stages). Each repeat times every stage,
    then query_fn() whole (default: the chain), so a machine slowing mid-run slows both alike."""
    if not stages or not all(isinstance(s, tuple) and len(s) == 2 and callable(s[1])
                             for s in stages):
        raise TypeError("stages must be a non-empty list of (name, fn) pairs")
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"need integers warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")

    def chain():
        x = None
        for _, fn in stages:
            x = fn(x)
        return x

    query_fn = query_fn or chain
    device = _resolve_device(device)
    per_stage, whole = [[] for _ in stages], []
    with _timed(device):
        for _ in range(warmup):
            chain()
            query_fn()
        clock = _call_clock(device)
        for _ in range(repeats):
            clock.last = None
            for times, (_, fn) in zip(per_stage, stages, strict=True):
                times.append(clock(partial(fn, clock.last)))
            whole.append(clock(query_fn))
    results = [TimingResult.from_times(times, str(device)) for times in per_stage]
    rows = [{"stage": name, "median_ms": r.median_ms, "p25_ms": r.p25_ms, "p75_ms": r.p75_ms}
            for (name, _), r in zip(stages, results, strict=True)]
    total = TimingResult.from_times(whole, str(device))
    return StageProfile(rows, total, total.median_ms - sum(r["median_ms"] for r in rows))


def fit_linear_cost(ns: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t(n) = a + b*n; returns (a = intercept_ms, b = slope_ms_per_item)."""
    ns, ms = np.asarray(ns, dtype=np.float64), np.asarray(ms, dtype=np.float64)  # (P,) each
    if ns.shape != ms.shape or ns.ndim != 1:
        raise ValueError(f"ns and ms must be 1-D and of equal length, got {ns.shape}, {ms.shape}")
    if len(np.unique(ns)) < 2:
        raise ValueError("fitting a + b*n needs at least two different sizes n: measure more")
    if not (np.isfinite(ns).all() and np.isfinite(ms).all()):
        raise ValueError("ns and ms must be finite numbers")
    design = np.stack([np.ones_like(ns), ns], axis=1)  # (P, 2)
    (intercept, slope), *_ = np.linalg.lstsq(design, ms, rcond=None)
    return float(intercept), float(slope)


def extrapolate(fit: tuple[float, float], n):
    """The fitted cost a + b*n in ms (n may be a number or an array)."""
    intercept, slope = fit
    value = intercept + slope * np.asarray(n, dtype=np.float64)
    return float(value) if value.ndim == 0 else value


_SPREAD = ("p10_ms", "p90_ms", "p25_ms", "p75_ms")  # latency_vs_gallery's percentiles, per query


def latency_vs_gallery(make_fn: Callable[[int], Callable[[], object]], sizes: Sequence[int], *,
                       warmup: int = 3, repeats: int = 20, per: int = 1, device=None,
                       max_measured: int | None = None) -> list[dict]:
    """Milliseconds per query by gallery size: make_fn(n) answers `per` queries on a gallery of n.
    Sizes above `max_measured` are extrapolated from t(n) = a + b*n (percentiles None), never below
    the largest measured time (a noisy fit can slope down)."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be positive gallery sizes, got {sizes}")
    if not isinstance(per, int) or per < 1:
        raise ValueError(f"per (queries one call answers) must be an integer >= 1, got {per!r}")
    timed = [n for n in sizes if max_measured is None or n <= max_measured]
    estimate = [n for n in sizes if n not in timed]
    if estimate and len(timed) < 2:
        raise ValueError(f"extrapolating to {estimate} needs two measured sizes <= max_measured="
                         f"{max_measured}, got {timed}; add smaller sizes or raise max_measured")
    rows = []
    for n in timed:
        # make_fn(n) is let go on return: a large gallery goes before the next one is built
        result = measure(make_fn(n), warmup=warmup, repeats=repeats, device=device)
        rows.append({"n": n, "ms_per_query": result.median_ms / per, "measured": True,
                     **{q: getattr(result, q) / per for q in _SPREAD}})
    if estimate:
        fit = fit_linear_cost([r["n"] for r in rows], [r["ms_per_query"] for r in rows])
        if fit[1] < 0:
            warnings.warn(f"the fitted cost falls with gallery size (slope {fit[1]:.3g} ms/item): "
                          "the measured sizes are too small or too noisy to extrapolate from",
                          CourseNote, stacklevel=2)
        floor = rows[-1]["ms_per_query"]  # the largest measured gallery
        rows += [{"n": n, "ms_per_query": max(float(extrapolate(fit, n)), floor),
                  "measured": False, **dict.fromkeys(_SPREAD)} for n in estimate]
    return rows


def speedup_table(rows_by_method: dict[str, list[dict]], reference: str) -> list[dict]:
    """One row per (n, method) from {method: `latency_vs_gallery` rows}: speedup = reference ms /
    method ms, speedup_estimated when either time is extrapolated. The reference needs every n."""
    if reference not in rows_by_method:
        raise ValueError(f"reference {reference!r} is not among the methods {list(rows_by_method)}")
    by_n = {m: {row["n"]: row for row in rows} for m, rows in rows_by_method.items()}
    sizes = sorted({n for rows in by_n.values() for n in rows})
    missing = [n for n in sizes if n not in by_n[reference]]
    if missing:
        raise ValueError(f"the reference {reference!r} has no time for n = {missing}; measure "
                         "or extrapolate it at every size the other methods have")
    table = []
    for n in sizes:
        ref = by_n[reference][n]
        for method, rows in by_n.items():
            if n not in rows:
                continue
            row, ms = rows[n], rows[n]["ms_per_query"]
            if ms <= 0:
                raise ValueError(f"{method} has a non-positive time {ms} ms at n={n}")
            table.append({"n": n, "method": method, "ms_per_query": ms,
                          "measured": row["measured"], "speedup": ref["ms_per_query"] / ms,
                          "speedup_estimated": not (row["measured"] and ref["measured"])})
    return table


def format_speedup_table(table: list[dict]) -> str:
    """Markdown table: one line per gallery size, "ms (speedup x)" per method; * = estimated."""
    def cell(row: dict | None) -> str:
        if row is None:
            return "–"
        return (f"{_fmt(row['ms_per_query'])}{'' if row['measured'] else '*'} "
                f"({row['speedup']:,.1f}×{'*' if row['speedup_estimated'] else ''})")

    methods = list(dict.fromkeys(row["method"] for row in table))
    cells = {(row["n"], row["method"]): row for row in table}
    lines = ["| n | " + " | ".join(f"{m}: ms (speedup)" for m in methods) + " |",
             "|---:|" + "---:|" * len(methods)]
    for n in sorted({row["n"] for row in table}):
        lines.append(f"| {n:,} | " + " | ".join(cell(cells.get((n, m))) for m in methods) + " |")
    lines.append("\n\\* estimated from the linear cost fit t(n) = a + b·n on the measured sizes")
    return "\n".join(lines)
