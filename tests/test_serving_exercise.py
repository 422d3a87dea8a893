"""Notebook 03's lean-query exercise checker: it accepts a faster query that answers alike, and
names a different answer, a wrong shape or type, and a query that got no faster or slower."""

import time

import numpy as np
import pytest

from course_lib.exercises.errors import ExerciseError
from course_lib.exercises.serving import check_faster_query

TOP = {"a red circle": np.array([3, 1, 2]), "a blue square": np.array([0, 4, 5])}


def query_taking(ms, answer=lambda caption: TOP[caption].copy()):
    def query(caption):
        time.sleep(ms / 1e3)
        return answer(caption)
    return query


def test_a_faster_query_with_the_same_answers_passes(capsys):
    result = check_faster_query(query_taking(0.5), query_taking(4), list(TOP), rounds=8)
    assert result["gain"] > 2 and result["mine_ms"] < result["eager_ms"]
    assert "faster" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda c: TOP[c][::-1].copy(), "in another order"),
    (lambda c: np.array([7, 8, 9]), "other images"),
    (lambda c: TOP[c][:2], "returned 2 images"),
    (lambda c: TOP[c].astype(np.float32), "look like scores"),
    (lambda c: (np.zeros(3, np.float32), TOP[c]), "returned a tuple"),
    (lambda c: TOP[c][None], "shape \\(1, 3\\)"),
])
def test_wrong_answers_are_named_before_any_timing(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_faster_query(query_taking(0, answer), query_taking(0), list(TOP), rounds=2)


def test_a_slower_or_equally_fast_query_is_named():
    with pytest.raises(ExerciseError, match="slower than eager_query"):
        check_faster_query(query_taking(4), query_taking(0.5), list(TOP), rounds=6)
    with pytest.raises(ExerciseError, match="only .*x as fast"):
        check_faster_query(query_taking(3), query_taking(4), list(TOP), rounds=6, min_gain=2.5)
