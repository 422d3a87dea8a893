"""Checker of notebook 07's exercise: the Pareto front of (ms per query, recall) points."""

import numpy as np

from course_lib.exercises.errors import ExerciseError
from course_lib.studies.frontier import pareto_front


def check_pareto_front(fn) -> None:
    """fn(ms, recall) -> indices of the front, any order, on hand-made and random cases."""
    cases = [([1.0, 10.0, 20.0, 1.0], [5.0, 50.0, 40.0, 5.0]),  # a duplicate; a slower, worse one
             ([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]),                # one point beats both others
             ([1.0, 1.0], [2.0, 3.0])]                          # equal times: the more accurate
    rng = np.random.default_rng(7)
    cases += [(rng.integers(1, 5, n).astype(float).tolist(),
               rng.integers(0, 5, n).astype(float).tolist()) for n in rng.integers(1, 10, 40)]
    for ms, recall in cases:
        got, want = fn(list(ms), list(recall)), pareto_front(ms, recall)
        if sorted(int(i) for i in got) != sorted(want):
            raise ExerciseError(f"ms={ms}, recall={recall}: expected the front {sorted(want)}, got "
                                f"{sorted(int(i) for i in got)}. A point is off the front only "
                                "when another is no slower AND no less accurate AND strictly "
                                "better in one of the two.")
    print(f"check_pareto_front: all {len(cases)} cases pass")
