"""Checker of lesson 08: the recall a random ranking reaches, the floor of every real-data row."""

import math

from .errors import ExerciseError

# (candidates, k, true items): photos for a caption (one true), captions for a photo (five)
CASES = ((100, 1, 1), (100, 10, 1), (500, 1, 5), (500, 5, 5), (500, 10, 5), (20, 30, 1),
         (20, 18, 5), (7, 0, 1))


def check_chance_recall(fn) -> None:
    """fn(n_candidates, k, n_relevant) -> R@k in percent of a uniformly random ranking."""
    for n, k, relevant in CASES:
        # the reference by counting: of the C(n, k) equally likely top-k sets, C(n - r, k) miss
        expected = 100.0 * (1.0 - math.comb(n - relevant, min(k, n)) / math.comb(n, min(k, n)))
        try:
            got = float(fn(n, k, relevant))
        except (TypeError, ValueError) as error:
            raise ExerciseError(f"chance_recall({n}, {k}, {relevant}) should return "
                                f"one number: {error}") from error
        if math.isclose(got, expected, abs_tol=1e-6):
            continue
        if math.isclose(got, expected / 100, abs_tol=1e-8):
            raise ExerciseError("your recall is a fraction; the course reports R@K in percent "
                                "(times 100)")
        if relevant > 1 and math.isclose(got, 100.0 * min(k * relevant, n) / n, abs_tol=1e-6):
            raise ExerciseError(f"with {relevant} true items, k * {relevant} / n counts a top k "
                                "that holds two of them twice; R@K asks whether at least one is "
                                "there: 1 - P(all k picks miss every one)")
        if k > n and got > 100.0 + 1e-6:
            raise ExerciseError(f"k = {k} is more than the {n} candidates: a list cannot hold more "
                                "than all of them, so R@K is 100 there")
        raise ExerciseError(f"chance_recall({n}, {k}, {relevant}): expected {expected:.4f}, got "
                            f"{got:.4f}. Draw the k picks one by one without replacement: all miss "
                            "with probability prod_i (n - r - i) / (n - i)")
    print("chance recall: correct")
