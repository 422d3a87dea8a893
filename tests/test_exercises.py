"""The exercise checkers accept right answers and name the usual mistakes in wrong ones."""

import numpy as np
import pytest

from course_lib.exercises import ExerciseError, check_i2t_ranks, check_t2i_ranks


def t2i_loop(sims, txt2img):
    # independent answer: one text at a time, count images scoring strictly above the true one
    return np.array([sum(sims[i, t] > sims[txt2img[t], t] for i in range(sims.shape[0]))
                     for t in range(sims.shape[1])])


def i2t_loop(sims, txt2img):
    ranks = []
    for i in range(sims.shape[0]):
        own = [t for t in range(sims.shape[1]) if txt2img[t] == i]
        ranks.append(min(sum(sims[i, u] > sims[i, t] for u in range(sims.shape[1])) for t in own))
    return np.array(ranks)


def test_correct_answers_pass(capsys):
    check_t2i_ranks(t2i_loop)
    check_i2t_ranks(i2t_loop)
    assert "correct" in capsys.readouterr().out


def test_one_based_ranks_are_named():
    with pytest.raises(ExerciseError, match="1-based"):
        check_t2i_ranks(lambda s, t: t2i_loop(s, t) + 1)
    with pytest.raises(ExerciseError, match="1-based"):
        check_i2t_ranks(lambda s, t: i2t_loop(s, t) + 1)


def test_wrong_axis_and_pessimistic_ties_are_named():
    with pytest.raises(ExerciseError, match="column"):
        check_t2i_ranks(lambda s, t: i2t_loop(s, t))
    pessimistic = lambda s, t: np.array([sum(s[i, j] >= s[t[j], j] for i in range(s.shape[0])) - 1  # noqa: E731
                                         for j in range(s.shape[1])])
    with pytest.raises(ExerciseError, match="strictly higher"):
        check_t2i_ranks(pessimistic)


def test_first_caption_only_is_named():
    def first_only(sims, txt2img):
        return np.array([(sims[i] > sims[i, np.flatnonzero(txt2img == i)[0]]).sum() for i in range(len(sims))])

    with pytest.raises(ExerciseError, match="first caption"):
        check_i2t_ranks(first_only)
