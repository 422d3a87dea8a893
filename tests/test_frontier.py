"""course_lib.studies.frontier: the Pareto front against a naive dominance loop, the latency
extension on a hand-worked case, and the papers' speed-up table's shape and arithmetic."""

import itertools

import numpy as np
import pytest

from course_lib.exercises.frontier import check_pareto_front
from course_lib.studies import frontier


def naive_front(ms, recall) -> set[int]:
    """O(n^2): i is on the front unless some j is no slower, no less accurate, and better in one."""
    dominated = set()
    for i, j in itertools.permutations(range(len(ms)), 2):
        if ms[j] <= ms[i] and recall[j] >= recall[i] and (ms[j] < ms[i] or recall[j] > recall[i]):
            dominated.add(i)
    return set(range(len(ms))) - dominated


def test_pareto_front_equals_the_naive_dominance_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        # few distinct values, so ties in time, in recall and exact duplicates all occur
        ms = rng.integers(1, 5, size=n).astype(float)
        recall = rng.integers(0, 5, size=n).astype(float)
        front = frontier.pareto_front(ms, recall)
        assert set(front) == naive_front(ms, recall), (ms, recall)
        assert len(front) == len(set(front))
        assert list(ms[front]) == sorted(ms[front])  # by increasing time


def test_pareto_front_hand_worked():
    #        fast+bad  slow+good  slower+worse  duplicate of the first
    ms = [1.0, 10.0, 20.0, 1.0]
    recall = [5.0, 50.0, 40.0, 5.0]
    assert sorted(frontier.pareto_front(ms, recall)) == [0, 1, 3]
    with pytest.raises(ValueError):
        frontier.pareto_front([1.0, 2.0], [1.0])


def test_extend_latency_hand_worked():
    # measured 2 ms at 1k and 4 ms at 3k: a = 1 ms, b = 1 ms per 1k items; the 5k
    # estimate is kept, not fitted to
    points = [{"n": 1000, "ms_per_query": 2.0, "measured": True},
              {"n": 3000, "ms_per_query": 4.0, "measured": True},
              {"n": 5000, "ms_per_query": 99.0, "measured": False}]
    rows = frontier.extend_latency(points, [1000, 10_000, 1_000_000])
    assert [r["n"] for r in rows] == [1000, 3000, 5000, 10_000, 1_000_000]
    assert [r["measured"] for r in rows] == [True, True, False, False, False]
    assert rows[3]["ms_per_query"] == pytest.approx(11.0)
    assert rows[4]["ms_per_query"] == pytest.approx(1001.0)
    # one measured size: the benchmark's extrapolated points join the fit (10 ms at 100,
    # 100 ms at 1k: 0.1 ms/item)
    few = [{"n": 100, "ms_per_query": 10.0, "measured": True},
           {"n": 1000, "ms_per_query": 100.0, "measured": False}]
    assert frontier.extend_latency(few, [10_000])[-1]["ms_per_query"] == pytest.approx(1000.0)
    # a falling fit is floored at the largest measured time
    falling = [{"n": 1000, "ms_per_query": 3.0, "measured": True},
               {"n": 2000, "ms_per_query": 2.0, "measured": True}]
    assert frontier.extend_latency(falling, [10_000])[-1]["ms_per_query"] == 2.0
    # one measured point: flat, and marked as an estimate
    one = frontier.extend_latency([{"n": 100, "ms_per_query": 0.5, "measured": True}], [1e6])
    assert one[-1] == {"n": 1_000_000, "ms_per_query": 0.5, "measured": False}
    with pytest.raises(ValueError, match="no measured"):
        frontier.extend_latency([{"n": 1, "ms_per_query": 1.0, "measured": False}], [10])


def test_paper_speedups_name_their_source_and_match_the_tables():
    assert len(frontier.PAPER_SPEEDUPS) >= 4
    papers = {p.paper.split(" (")[0] for p in frontier.PAPER_SPEEDUPS}
    assert papers == {"LightningDOT", "U-BERT", "HiVLP", "Fast & Slow"}
    for p in frontier.PAPER_SPEEDUPS:
        assert p.table.startswith("Table ") and p.setting and p.n_images >= 1000 and p.speedup > 1
        assert len(p.ours) == 2
    by = {(p.paper.split(" (")[0], p.fast, p.n_images): p.speedup for p in frontier.PAPER_SPEEDUPS}
    assert by[("LightningDOT", "LightningDOT", 1000)] == 639  # Table 3, as printed
    # 4832 s / 31 s
    assert by[("U-BERT", "U-BERT (K=20, 3 cross layers)", 1000)] == pytest.approx(155.9, abs=0.1)
    # 19 s / 0.12 s
    assert by[("Fast & Slow", "Fast & Slow K=10", 5000)] == pytest.approx(158.3, abs=0.1)


def test_speedup_rows_from_results_json_latency():
    results = {"latency": [
        {"method": "cross_encoder", "n": 1000, "ms_per_query": 100.0, "measured": True},
        {"method": "cross_encoder", "n": 2000, "ms_per_query": 200.0, "measured": True},
        {"method": "lightningdot", "n": 1000, "ms_per_query": 2.0, "measured": True},
        {"method": "lightningdot", "n": 5000, "ms_per_query": 2.5, "measured": True}]}
    paper = frontier.PaperSpeedup("LightningDOT", "Table 3", "COCO", 5000, "LD", "UNITER", 1927.0,
                                  ("lightningdot", "cross_encoder"))
    missing = frontier.PaperSpeedup("X", "Table 1", "Y", 1000, "a", "b", 2.0,
                                    ("hivlp", "cross_encoder"))
    rows = frontier.speedup_rows(results, [paper, missing])
    # the cross-encoder extended: 0 + 0.1 * 5000
    assert rows[0]["ours_speedup"] == pytest.approx(500.0 / 2.5)
    assert rows[0]["ours_estimated"] is True
    assert rows[1]["ours_speedup"] is None
    table = frontier.speedup_markdown(rows)
    assert "| 1,927x |" in table and "200x*" in table and "| – |" in table


def test_compose_latency_hand_worked():
    # measured 3 ms at 1k and 4 ms at 5k; the search costs 0.5 ms at 5k and
    # 20.5 ms at 1M: 4 + 20 = 24 ms
    points = [{"n": 1000, "ms_per_query": 3.0, "measured": True},
              {"n": 5000, "ms_per_query": 4.0, "measured": True}]
    search = [{"n": 1000, "ms_per_query": 0.1}, {"n": 5000, "ms_per_query": 0.5},
              {"n": 1_000_000, "ms_per_query": 20.5}]
    rows = frontier.compose_latency(points, search, [1000, 1_000_000])
    assert rows == [{"n": 1000, "ms_per_query": 3.0, "measured": True},
                    {"n": 5000, "ms_per_query": 4.0, "measured": True},
                    {"n": 1_000_000, "ms_per_query": pytest.approx(24.0), "measured": False}]
    with pytest.raises(ValueError, match="not timed"):
        frontier.compose_latency(points, search[:1], [100_000])


def test_check_pareto_front_passes_the_naive_loop_and_catches_a_wrong_answer(capsys):
    check_pareto_front(lambda ms, recall: sorted(naive_front(ms, recall)))
    assert "pass" in capsys.readouterr().out
    from course_lib.exercises.errors import ExerciseError

    def ties_not_beaten(ms, recall):  # forgets that a tie in time is beaten
        return [i for i in range(len(ms))
                if not any(ms[j] < ms[i] and recall[j] >= recall[i] for j in range(len(ms)))]

    with pytest.raises(ExerciseError, match="expected the front"):
        check_pareto_front(ties_not_beaten)


def test_latency_by_method_merges_the_latency_table_and_the_rows():
    results = {"latency": [{"method": "a", "n": 1000, "ms_per_query": 1.5, "measured": False},
                           {"method": "a", "n": 5000, "ms_per_query": 3.0, "measured": False}],
               "rows": [{"method": "a", "setting": "test", "n_images": 1000, "ms_per_query": 1.0,
                         "ms_measured": True},
                        {"method": "a", "setting": "full", "n_images": 800, "ms_per_query": 0.9,
                         "ms_measured": True},
                        {"method": "oracle", "setting": "test", "n_images": 1000,
                         "ms_per_query": None}]}
    assert frontier.latency_by_method(results) == {"a": [
        {"n": 800, "ms_per_query": 0.9, "measured": True},
        # the row's measured time beats the estimate
        {"n": 1000, "ms_per_query": 1.0, "measured": True},
        {"n": 5000, "ms_per_query": 3.0, "measured": False}]}


def test_rows_at_gallery_pair_full_recalls_with_times_at_that_size():
    results = {"rows": [{"method": "oracle", "setting": "full", "t2i_r5": 70.0,
                         "ms_per_query": None},
                        {"method": "dot", "setting": "full", "t2i_r5": 20.0, "ms_per_query": 1.0},
                        {"method": "pairs", "setting": "full", "t2i_r5": 30.0,
                         "ms_per_query": 50.0},
                        {"method": "dot", "setting": "test", "t2i_r1": 9.0, "ms_per_query": 0.9},
                        {"method": "untimed-here", "setting": "full", "t2i_r5": 5.0,
                         "ms_per_query": 2.0}]}
    latency = {"dot": [{"n": 10**6, "ms_per_query": 4.0, "measured": True}],
               "pairs": [{"n": 10**6, "ms_per_query": 4000.0, "measured": False}]}
    rows = frontier.rows_at_gallery(results, latency, 10**6)
    assert [(r["method"], r["t2i_r5"], r["ms_per_query"], r.get("ms_measured")) for r in rows] == [
        ("oracle", 70.0, None, None), ("dot", 20.0, 4.0, True), ("pairs", 30.0, 4000.0, False)]
    assert {r["setting"] for r in rows} == {"1,000,000 items"}
