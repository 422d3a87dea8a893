"""One query's profile (timing.profile_stages) against hand-made stages that sleep known times, the
roofline arithmetic (core.roofline), and the batched-throughput study on a small gallery."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from course_lib.core.roofline import (
    count_flops,
    count_operators,
    gflops,
    matmul_gflops,
    roofline_ms,
)
from course_lib.core.timing import profile_stages
from course_lib.studies.query_throughput import (
    encode_throughput,
    end_to_end,
    format_throughput,
    throughput,
)


def _sleep(ms: float, value):
    time.sleep(ms / 1e3)
    return value


def test_profile_splits_known_stage_times_and_the_glue():
    seen = []
    stages = [("tokenise", lambda _: _sleep(4, "ids")),
              ("forward", lambda x: seen.append(x) or _sleep(1, "vector")),
              ("search", lambda x: seen.append(x) or _sleep(2, "top k"))]

    def query():  # the stages, plus 3 ms of "glue" that no stage holds
        x = None
        for _, fn in stages:
            x = fn(x)
        return _sleep(3, x)

    profile = profile_stages(stages, query_fn=query, warmup=1, repeats=15)
    medians = {row["stage"]: row["median_ms"] for row in profile.stages}
    assert list(medians) == ["tokenise", "forward", "search"]
    # sleep(t) takes t plus a scheduling delay (up to a few ms on a busy machine), never less
    for name, ms in (("tokenise", 4), ("forward", 1), ("search", 2)):
        assert ms <= medians[name] < ms + 3, (name, medians[name])
    assert medians["tokenise"] > medians["search"] > medians["forward"]
    assert 7 + 3 <= profile.total.median_ms < 10 + 6
    assert 1.5 < profile.glue_ms < 3 + 4
    assert seen[:2] == ["ids", "vector"]  # each stage got the one before's output
    for row in profile.stages:
        assert row["p25_ms"] <= row["median_ms"] <= row["p75_ms"]
    table = profile.table()
    assert "| tokenise |" in table and "Python glue" in table and "whole query" in table


def test_profile_without_query_fn_times_the_chain_itself():
    profile = profile_stages([("a", lambda _: _sleep(1, 1)), ("b", lambda x: x + 1)],
                             warmup=0, repeats=5)
    assert profile.total.median_ms >= 1 and abs(profile.glue_ms) < 1  # only the chaining: no sleep
    with pytest.raises(TypeError, match="stages"):
        profile_stages([lambda _: 1])
    with pytest.raises(ValueError, match="repeats"):
        profile_stages([("a", lambda _: 1)], repeats=0)


def test_flops_of_a_linear_layer_and_an_attention_are_counted():
    layer = nn.Linear(8, 5)
    x = torch.randn(3, 8)
    assert count_flops(lambda: layer(x)) == 2 * 3 * 8 * 5
    q = torch.randn(1, 2, 6, 4)  # (B, heads, L, d)
    flops = count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert flops == 2 * (2 * 2 * 6 * 6 * 4)  # Q K^T and A V, each 2 B h L L d


def test_operators_are_counted_one_per_dispatch():
    x = torch.randn(3, 4)
    assert count_operators(lambda: x + 1) == 1
    assert count_operators(lambda: (x + 1).mul(2).sum()) == 3
    assert count_operators(lambda: None) == 0


def test_matmul_rate_and_roofline():
    before = torch.get_num_threads()
    rate = matmul_gflops(size=128, threads=1, repeats=5)
    assert torch.get_num_threads() == before
    assert 0.1 < rate < 1e4  # GFLOP/s of one core: anything from an old laptop to a server
    assert roofline_ms(2e9, 2.0) == pytest.approx(1000.0)
    assert roofline_ms(2e6, gflops(2e6, 0.5)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        roofline_ms(1.0, 0.0)


def test_throughput_rows_and_their_limits():
    g = np.random.default_rng(0)
    images = g.standard_normal((300, 16)).astype(np.float32)
    queries = g.standard_normal((20, 16)).astype(np.float32)
    rows = throughput(images, queries, sizes=(300, 1_000), batches=(1, 32), progress=False)
    assert [(r["n"], r["kind"], r["batch"]) for r in rows] == [
        (n, kind, b) for n in (300, 1_000) for kind in ("flat", "hnsw") for b in (1, 32)]
    for r in rows:
        assert r["qps"] == pytest.approx(r["batch"] / r["ms_per_batch"] * 1e3)
        assert (r["gemm_qps"] is not None) == (r["kind"] == "flat")
    encoded = encode_throughput(lambda texts: [len(t) for t in texts], ["a", "bb"], batches=(1, 32))
    assert [r["batch"] for r in encoded] == [1, 32]
    total = end_to_end(rows, {r["batch"]: r["qps"] for r in encoded})
    for r in total:
        assert r["total_qps"] < min(r["qps"], r["encode_qps"])  # encoding and search add up
    table = format_throughput(total)
    assert table.count("\n") == 1 + 4 and "| 1,000 | hnsw |" in table
