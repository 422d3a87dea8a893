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


def _hinge_loop(scores, margin, max_violation):
    # independent answer: explicit loops over the batch
    B = scores.shape[0]
    total = 0.0
    for i in range(B):
        text_costs = [max(0.0, margin + float(scores[i, j]) - float(scores[i, i])) for j in range(B) if j != i]
        image_costs = [max(0.0, margin + float(scores[j, i]) - float(scores[i, i])) for j in range(B) if j != i]
        if max_violation:
            total += max(text_costs) + max(image_costs)
        else:
            total += sum(text_costs) + sum(image_costs)
    return total


def test_hinge_checker_accepts_a_loop_and_names_mistakes(capsys):
    from course_lib.exercises import check_hinge_loss

    check_hinge_loss(_hinge_loop)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="averaged"):
        check_hinge_loss(lambda s, m, mv: _hinge_loop(s, m, mv) / s.shape[0])

    def with_diagonal(s, m, mv):
        return _hinge_loop(s, m, mv) + (0 if mv else 2 * s.shape[0] * m)

    with pytest.raises(ExerciseError, match="diagonal"):
        check_hinge_loss(with_diagonal)

    def rows_only(s, m, mv):
        B = s.shape[0]
        costs = [[max(0.0, m + float(s[i, j]) - float(s[i, i])) for j in range(B) if j != i] for i in range(B)]
        return sum(max(c) if mv else sum(c) for c in costs)

    with pytest.raises(ExerciseError, match="one direction"):
        check_hinge_loss(rows_only)


def _attention_loop(query, context, lam):
    # independent answer: per pair and per query item, SCAN's steps written out
    import torch

    out = torch.zeros_like(query)
    for p in range(query.shape[0]):
        attn = context[p] @ query[p].T  # (Lc, Lq)
        attn = torch.where(attn > 0, attn, 0.1 * attn)
        attn = attn / (attn.pow(2).sum(1, keepdim=True).sqrt() + 1e-8)
        for q in range(query.shape[1]):
            w = torch.exp(lam * attn[:, q])
            out[p, q] = (w / w.sum()) @ context[p]
    return out


def test_attention_checker_accepts_a_loop_and_names_mistakes(capsys):
    import torch

    from course_lib.exercises import check_func_attention

    check_func_attention(_attention_loop)
    assert "correct" in capsys.readouterr().out

    def context_norm(q, c, lam):
        attn = torch.nn.functional.leaky_relu(torch.bmm(c, q.transpose(1, 2)), 0.1)
        attn = attn / (attn.norm(dim=1, keepdim=True) + 1e-8)
        return torch.bmm(torch.softmax(lam * attn, dim=1).transpose(1, 2), c)

    with pytest.raises(ExerciseError, match="context axis"):
        check_func_attention(context_norm)
    with pytest.raises(ExerciseError, match="lambda_softmax is missing"):
        check_func_attention(lambda q, c, lam: _attention_loop(q, c, 1.0))
    with pytest.raises(ExerciseError, match="shape|\\(P, Lq, D\\)"):
        check_func_attention(lambda q, c, lam: c)


def test_attention_checker_names_the_softmax_axis_and_the_missing_clip():
    import torch

    from course_lib.exercises import check_func_attention

    def no_clip(q, c, lam):
        attn = torch.bmm(c, q.transpose(1, 2))
        attn = attn / (attn.norm(dim=2, keepdim=True) + 1e-8)
        return torch.bmm(torch.softmax(lam * attn, dim=1).transpose(1, 2), c)

    def softmax_over_queries(q, c, lam):
        attn = torch.nn.functional.leaky_relu(torch.bmm(c, q.transpose(1, 2)), 0.1)
        attn = attn / (attn.norm(dim=2, keepdim=True) + 1e-8)
        return torch.bmm(torch.softmax(lam * attn, dim=2).transpose(1, 2), c)

    with pytest.raises(ExerciseError, match="LeakyReLU"):
        check_func_attention(no_clip)
    with pytest.raises(ExerciseError, match="query axis"):
        check_func_attention(softmax_over_queries)
