"""Checker of notebook 03's lean-query exercise: the learner's query must answer as the eager one
and be measurably faster, the two timed in alternation (their ratio counts, not the ms)."""

from functools import partial

import numpy as np

from course_lib.core.timing import measure

from .errors import ExerciseError

ROUNDS = 60  # alternating timed calls of each function
MIN_GAIN = 1.05  # the learner's query must be at least this many times faster than the eager one


def _top_k(got, label: str, caption: str) -> np.ndarray:
    """The indices a query function returned as a 1-D int array, or an ExerciseError saying why."""
    if isinstance(got, tuple):
        raise ExerciseError(f"{label} returned a tuple for {caption!r}: retrieval.search gives "
                            "(scores, indices); return the indices of the one query, "
                            "search(...)[1][0]")
    array = np.asarray(got.detach().cpu() if hasattr(got, "detach") else got)
    if array.ndim != 1:
        raise ExerciseError(f"{label} returned shape {array.shape} for {caption!r}: return the "
                            "(k,) indices of the one query (search gives (1, k); take row 0)")
    if not np.issubdtype(array.dtype, np.integer):
        raise ExerciseError(f"{label} returned {array.dtype} values for {caption!r}: those look "
                            "like scores; return the image indices")
    return array


def check_faster_query(my_query, eager_query, captions, *, rounds: int = ROUNDS,
                       min_gain: float = MIN_GAIN, label: str = "my_query") -> dict:
    """my_query and eager_query(caption) -> the top k indices (k,), best first; my_query must
    answer alike and be min_gain times faster. -> {"eager_ms", "mine_ms", "gain"} (medians)"""
    captions = list(captions)
    if not captions:
        raise ValueError("check_faster_query needs some captions to query")
    for caption in captions:
        expected = _top_k(eager_query(caption), "eager_query", caption)
        got = _top_k(my_query(caption), label, caption)
        if len(got) != len(expected):
            raise ExerciseError(f"{label} returned {len(got)} images for {caption!r}, eager_query "
                                f"{len(expected)}: search for the same k")
        if set(got.tolist()) != set(expected.tolist()):
            raise ExerciseError(f"{label} returns other images for {caption!r}: {got.tolist()} "
                                f"instead of {expected.tolist()}. Is the caption tokenised the "
                                "same way ([CLS] ... [SEP], the same max_length), encoded by the "
                                "same model in eval mode, and searched in the same index?")
        if not np.array_equal(got, expected):
            raise ExerciseError(f"{label} returns the right images for {caption!r} in another "
                                f"order ({got.tolist()} instead of {expected.tolist()}): keep "
                                "search's order, best first")
    times = {"eager": [], "mine": []}
    for r in range(rounds):  # alternate, so that a machine slowing down mid-run slows both alike
        caption = captions[r % len(captions)]
        for name, fn in (("eager", eager_query), ("mine", my_query)):
            times[name].append(measure(partial(fn, caption), warmup=1 if r == 0 else 0,
                                       repeats=1).median_ms)
    eager_ms, mine_ms = (float(np.median(times[name])) for name in ("eager", "mine"))
    gain = eager_ms / mine_ms
    if gain < 1:
        raise ExerciseError(f"{label} is slower than eager_query ({mine_ms:.3f} vs {eager_ms:.3f} "
                            "ms per query): something that should happen once happens on every "
                            "call. Build the tokenizer, the index or the traced encoder outside "
                            "the function and only use it inside")
    if gain < min_gain:
        raise ExerciseError(f"{label} answers right but is only {gain:.2f}x as fast as eager_query "
                            f"({mine_ms:.3f} vs {eager_ms:.3f} ms per query; {min_gain}x wanted): "
                            "the overhead you removed costs little here. The profile above says "
                            "which stage costs most")
    print(f"{label}: the same top {len(expected)} as eager_query on {len(captions)} captions; "
          f"{mine_ms:.3f} ms vs {eager_ms:.3f} ms per query (medians of {rounds} alternating "
          f"calls): {gain:.1f}x faster")
    return {"eager_ms": eager_ms, "mine_ms": mine_ms, "gain": gain}
