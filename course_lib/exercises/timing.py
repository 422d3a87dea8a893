"""Checker of the timing exercises (lessons 00-03): a time depends on the machine, so it checks
the shape of the latency rows (as core.timing.latency_vs_gallery's) and a search's top k."""

import math

import torch

from .errors import ExerciseError


def check_latency_rows(rows, sizes, measured_up_to=None, label: str = "your rows") -> None:
    """rows: [{"n", "ms_per_query", "measured"}] per size, measured up to `measured_up_to`."""
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise ExerciseError(f"{label}: expected a list of dicts (what latency_vs_gallery returns), "
                            f"got {type(rows).__name__}")
    wanted, got = sorted({int(n) for n in sizes}), [r.get("n") for r in rows]
    if got != wanted:
        raise ExerciseError(f"{label}: expected one row per gallery size {wanted}, in that order, "
                            f"got sizes {got}: pass every size (the measured and the extrapolated "
                            "ones) to latency_vs_gallery")
    for r in rows:
        ms = r.get("ms_per_query")
        if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ExerciseError(f"{label}: N = {r['n']:,} has ms_per_query {ms!r}; a time must be "
                                "a positive number")
        should = measured_up_to is None or r["n"] <= measured_up_to
        if bool(r.get("measured")) != should:
            raise ExerciseError(f"{label}: N = {r['n']:,} was "
                                f"{'measured' if r.get('measured') else 'extrapolated'}, but the "
                                f"exercise measures galleries up to {measured_up_to:,} and "
                                "extrapolates the rest: pass max_measured")
    measured = [r for r in rows if r["measured"]]
    for r in rows:
        if not r["measured"] and measured and r["ms_per_query"] < measured[-1]["ms_per_query"]:
            raise ExerciseError(f"{label}: the extrapolated N = {r['n']:,} costs less than the "
                                "largest measured gallery; a bigger gallery cannot be cheaper "
                                "(use latency_vs_gallery's estimate)")
    print(f"{label}: {len(measured)} measured and {len(rows) - len(measured)} extrapolated gallery "
          "sizes, in the right shape")


def check_top_k(got, expected, label: str = "your search") -> None:
    """A timed search's indices against the true top k (the same set, best first up to ties)."""
    got, expected = (torch.as_tensor(x).reshape(-1).cpu() for x in (got, expected))
    if len(got) != len(expected):
        raise ExerciseError(f"{label}: returned {len(got)} indices, expected the top "
                            f"{len(expected)}")
    if set(got.tolist()) != set(expected.tolist()):
        raise ExerciseError(f"{label}: returned {sorted(got.tolist())}, but the top "
                            f"{len(expected)} are {sorted(expected.tolist())}: is it searching "
                            "the first n items, with the right query?")
    print(f"{label}: returns the true top {len(expected)}")
