"""Tests for course_lib.core.timing (CPU; the CUDA path runs only where a GPU is present)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from course_lib.core.timing import (
    TimingResult,
    extrapolate,
    fit_linear_cost,
    format_speedup_table,
    latency_vs_gallery,
    measure,
    speedup_table,
)


# ------------------------------------------------------------------------------------------ measure
def test_measure_of_a_sleep():
    result = measure(lambda: time.sleep(0.01), warmup=1, repeats=5)
    assert 9 <= result.median_ms <= 30
    assert result.device == "cpu" and result.repeats == 5 and len(result.times_ms) == 5


def test_warmup_calls_are_not_timed():
    calls = []

    def slow_then_fast():
        calls.append(1)
        time.sleep(0.05 if len(calls) <= 2 else 0.001)

    result = measure(slow_then_fast, warmup=2, repeats=5)
    assert len(calls) == 7  # 2 warm-up + 5 timed
    assert result.median_ms < 20 and result.max_ms < 45  # none of the 50 ms calls was timed


@pytest.mark.parametrize("warmup,repeats", [(0, 1), (3, 4)])
def test_number_of_calls(warmup, repeats):
    calls = []
    result = measure(lambda: calls.append(1), warmup=warmup, repeats=repeats)
    assert len(calls) == warmup + repeats and result.repeats == repeats
    assert len(result.times_ms) == repeats and result.std_ms >= 0


def test_timing_result_statistics_and_str():
    result = TimingResult.from_times([5.0, 1.0, 3.0, 2.0, 4.0], "cpu")
    # sorted 1..5: median 3, mean 3, sample std sqrt(10/4) = 1.5811, p10 = 1 + 0.4*1 = 1.4,
    # p90 = 4 + 0.6*1 = 4.6 (linear interpolation between order statistics)
    assert (result.median_ms, result.mean_ms, result.min_ms, result.max_ms) == (3.0, 3.0, 1.0, 5.0)
    assert result.std_ms == pytest.approx(1.5811388)
    assert result.p10_ms == pytest.approx(1.4) and result.p90_ms == pytest.approx(4.6)
    assert str(result) == "3 ms median (p10 1.4, p90 4.6; 5 runs on cpu)"
    slow = TimingResult.from_times([1234.5], "cuda:0")
    assert str(slow) == "1234 ms median (p10 1234, p90 1234; 1 runs on cuda:0)"
    assert slow.std_ms == 0.0


def test_measure_auto_device_is_settings_choice(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert measure(lambda: None, warmup=0, repeats=2, device="auto").device == "cpu"


@pytest.mark.parametrize("kwargs,message", [
    ({"warmup": -1}, "warmup must be"),
    ({"repeats": 0}, "repeats must be"),
    ({"repeats": 2.5}, "repeats must be"),
])
def test_measure_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure(lambda: None, **kwargs)


def test_measure_rejects_non_callables_and_missing_devices():
    with pytest.raises(TypeError, match="callable"):
        measure(42)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            measure(lambda: None, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_cuda_events():
    x = torch.randn(2048, 2048, device="cuda")
    result = measure(lambda: x @ x, warmup=2, repeats=5, device="cuda")
    assert result.device.startswith("cuda") and result.median_ms > 0
    sleepy = measure(lambda: time.sleep(0.01), warmup=0, repeats=3, device="cuda")
    assert 9 <= sleepy.median_ms <= 30  # CPU time inside fn is counted too


# -------------------------------------------------------------------------------------- linear cost
def test_fit_linear_cost_recovers_known_line():
    ns = [10, 100, 1000, 5000, 123456]
    ms = [0.5 + 0.002 * n for n in ns]
    intercept, slope = fit_linear_cost(ns, ms)
    assert intercept == pytest.approx(0.5, rel=1e-9) and slope == pytest.approx(0.002, rel=1e-9)
    assert extrapolate((intercept, slope), 1_000_000) == pytest.approx(2000.5)
    assert extrapolate((1.0, 2.0), [0, 1, 10]).tolist() == [1.0, 3.0, 21.0]


@pytest.mark.parametrize("ns,ms,message", [
    ([5, 5, 5], [1, 2, 3], "two different sizes"),
    ([1, 2], [1], "equal length"),
    ([1, 2], [1, float("nan")], "finite"),
])
def test_fit_linear_cost_errors(ns, ms, message):
    with pytest.raises(ValueError, match=message):
        fit_linear_cost(ns, ms)


def sleep_gallery(ms_per_item: float):
    """make_fn for latency_vs_gallery whose cost is linear in n: one sleep per call."""
    return lambda n: (lambda: time.sleep(ms_per_item * n / 1e3))


def test_latency_vs_gallery_measures_and_extrapolates():
    # 2 us per item: 2 / 6 / 10 ms per call; per=2 queries per call halves the per-query time.
    rows = latency_vs_gallery(sleep_gallery(0.002), [5000, 1000, 3000, 50000], warmup=1,
                              repeats=5, per=2, max_measured=5000)
    assert [r["n"] for r in rows] == [1000, 3000, 5000, 50000]
    assert [r["measured"] for r in rows] == [True, True, True, False]
    for row, expected in zip(rows[:3], [1.0, 3.0, 5.0], strict=True):
        assert expected <= row["ms_per_query"] <= expected + 3
        assert row["p10_ms"] <= row["ms_per_query"] <= row["p90_ms"]
    assert rows[3]["p10_ms"] is None and rows[3]["p90_ms"] is None
    assert rows[3]["ms_per_query"] == pytest.approx(50.0, rel=0.3)  # true cost 100 ms / 2


def test_latency_vs_gallery_all_measured_and_errors():
    rows = latency_vs_gallery(sleep_gallery(0.0), [1, 2], warmup=0, repeats=1)
    assert all(r["measured"] for r in rows)
    with pytest.raises(ValueError, match="two measured sizes"):
        latency_vs_gallery(sleep_gallery(0.0), [1, 100], warmup=0, repeats=1, max_measured=10)
    with pytest.raises(ValueError, match="positive gallery sizes"):
        latency_vs_gallery(sleep_gallery(0.0), [0, 10], warmup=0, repeats=1)
    with pytest.raises(ValueError, match="per"):
        latency_vs_gallery(sleep_gallery(0.0), [1, 2], warmup=0, repeats=1, per=0)


def test_latency_vs_gallery_warns_when_cost_falls():
    def make_fn(n):
        return lambda: time.sleep(0.008 if n == 1 else 0.001)

    with pytest.warns(UserWarning, match="falls with gallery size"):
        rows = latency_vs_gallery(make_fn, [1, 2, 100], warmup=0, repeats=3, max_measured=2)
    # a falling fit would extrapolate to a negative time at n = 100 (it did): the floor is the
    # time measured at the largest gallery
    assert rows[-1]["ms_per_query"] == rows[1]["ms_per_query"] > 0


# ----------------------------------------------------------------------------------- speedup tables
def _rows(*entries):
    return [{"n": n, "ms_per_query": ms, "measured": measured,
             "p10_ms": ms if measured else None, "p90_ms": ms if measured else None}
            for n, ms, measured in entries]


def test_speedup_table_by_hand():
    rows_by_method = {
        "cross": _rows((1000, 10.0, True), (100000, 1000.0, False)),
        "dual": _rows((1000, 0.5, True), (100000, 0.7, True)),
        "rerank": _rows((1000, 2.0, True)),
    }
    table = speedup_table(rows_by_method, reference="cross")
    cell = {(r["n"], r["method"]): r for r in table}
    # n = 1000: 10 / 0.5 = 20x and 10 / 2 = 5x, all measured.
    assert cell[1000, "dual"]["speedup"] == pytest.approx(20.0)
    assert cell[1000, "rerank"]["speedup"] == pytest.approx(5.0)
    assert cell[1000, "cross"]["speedup"] == 1.0 and not cell[1000, "dual"]["speedup_estimated"]
    # n = 100000: the reference is extrapolated, so 1000 / 0.7 = 1428.57x is starred.
    assert cell[100000, "dual"]["speedup"] == pytest.approx(1428.5714, rel=1e-6)
    assert cell[100000, "dual"]["measured"] and cell[100000, "dual"]["speedup_estimated"]
    assert (100000, "rerank") not in cell

    text = format_speedup_table(table)
    lines = text.splitlines()
    assert lines[0] == "| n | cross: ms (speedup) | dual: ms (speedup) | rerank: ms (speedup) |"
    assert lines[2] == "| 1,000 | 10 (1.0×) | 0.5 (20.0×) | 2 (5.0×) |"
    assert lines[3] == "| 100,000 | 1000* (1.0×*) | 0.7 (1,428.6×*) | – |"
    assert re.search(r"\\\* estimated", text)


def test_speedup_table_errors():
    good = _rows((10, 1.0, True))
    with pytest.raises(ValueError, match="not among the methods"):
        speedup_table({"a": good}, reference="b")
    with pytest.raises(ValueError, match=r"no time for n = \[20\]"):
        speedup_table({"ref": good, "b": _rows((20, 1.0, True))}, reference="ref")
    with pytest.raises(ValueError, match="non-positive"):
        speedup_table({"ref": good, "b": _rows((10, 0.0, True))}, reference="ref")


def test_quartiles_and_latency_rows_carry_the_spread():
    result = TimingResult.from_times([1.0, 2.0, 3.0, 4.0, 100.0], "cpu")
    assert (result.p25_ms, result.median_ms, result.p75_ms) == (2.0, 3.0, 4.0)
    rows = latency_vs_gallery(lambda n: (lambda: None), [10, 20, 40], warmup=0, repeats=5,
                              max_measured=20)
    assert all(r["p25_ms"] <= r["ms_per_query"] <= r["p75_ms"] for r in rows if r["measured"])
    # extrapolated: no spread to report
    assert rows[-1]["p25_ms"] is None and rows[-1]["p75_ms"] is None


def test_course_notes_read_as_one_plain_line(monkeypatch, capsys):
    import warnings

    from course_lib.core.settings import CourseNote, plain_course_notes

    passed_on = []
    # Python's display
    monkeypatch.setattr(warnings, "showwarning", lambda *args: passed_on.append(args[1]))
    plain_course_notes()
    for _ in range(2):  # what warnings.warn hands to the display, as a notebook shows it
        warnings.showwarning(CourseNote("the timings are noisy"), CourseNote,
                             "/x/course_lib/core/timing.py", 191)
    warnings.showwarning(RuntimeWarning("something else"), RuntimeWarning, "/x/elsewhere.py", 7)
    err = capsys.readouterr().err
    # once, no file path
    assert err.count("note: the timings are noisy") == 1 and "timing.py" not in err
    assert passed_on == [RuntimeWarning]  # other warnings keep Python's own display
