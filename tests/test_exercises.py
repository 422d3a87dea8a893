"""The exercise checkers accept right answers and name the usual mistakes in wrong ones."""

import numpy as np
import pytest

from course_lib.exercises.errors import ExerciseError
from course_lib.exercises.ranking import check_i2t_ranks, check_t2i_ranks


def t2i_loop(sims, txt2img):
    # independent answer: one text at a time, count the other images scoring at least as high
    return np.array([sum(sims[i, t] >= sims[txt2img[t], t] for i in range(sims.shape[0])
                         if i != txt2img[t])
                     for t in range(sims.shape[1])])


def i2t_loop(sims, txt2img):
    ranks = []
    for i in range(sims.shape[0]):
        own = [t for t in range(sims.shape[1]) if txt2img[t] == i]
        ranks.append(min(sum(sims[i, u] >= sims[i, t] for u in range(sims.shape[1])
                             if txt2img[u] != i)
                         for t in own))
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


def test_wrong_axis_optimistic_ties_and_counting_the_truth_are_named():
    with pytest.raises(ExerciseError, match="column"):
        check_t2i_ranks(lambda s, t: i2t_loop(s, t))
    optimistic = lambda s, t: np.array([sum(s[i, j] > s[t[j], j] for i in range(s.shape[0]))  # noqa: E731
                                        for j in range(s.shape[1])])
    with pytest.raises(ExerciseError, match="strictly higher"):
        check_t2i_ranks(optimistic)
    with_self = lambda s, t: np.array([sum(s[i, j] >= s[t[j], j] for i in range(s.shape[0]))  # noqa: E731
                                       for j in range(s.shape[1])])
    with pytest.raises(ExerciseError, match="true image itself"):
        check_t2i_ranks(with_self)


def test_first_caption_only_is_named():
    def first_only(sims, txt2img):
        own = [np.flatnonzero(txt2img == i)[0] for i in range(len(sims))]
        return np.array([((sims[i] >= sims[i, own[i]]) & (txt2img != i)).sum()
                         for i in range(len(sims))])

    with pytest.raises(ExerciseError, match="first caption"):
        check_i2t_ranks(first_only)


def _hinge_loop(scores, margin, max_violation):
    # independent answer: explicit loops over the batch
    B = scores.shape[0]
    total = 0.0
    for i in range(B):
        text_costs = [max(0.0, margin + float(scores[i, j]) - float(scores[i, i]))
                      for j in range(B) if j != i]
        image_costs = [max(0.0, margin + float(scores[j, i]) - float(scores[i, i]))
                       for j in range(B) if j != i]
        if max_violation:
            total += max(text_costs) + max(image_costs)
        else:
            total += sum(text_costs) + sum(image_costs)
    return total


def test_hinge_checker_accepts_a_loop_and_names_mistakes(capsys):
    from course_lib.exercises.ranking import check_hinge_loss

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
        costs = [[max(0.0, m + float(s[i, j]) - float(s[i, i])) for j in range(B) if j != i]
                 for i in range(B)]
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

    from course_lib.exercises.attention import check_func_attention

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

    from course_lib.exercises.attention import check_func_attention

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


# ----------------------------------------------------------------------------------- lesson 03: CMR

def _cmr_loop(scores):
    # independent answer: per image a softmax over the texts, per text one over the images
    import torch

    B = scores.shape[0]
    text_retrieval = sum(torch.logsumexp(scores[i], 0) - scores[i, i] for i in range(B)) / B
    image_retrieval = sum(torch.logsumexp(scores[:, j], 0) - scores[j, j] for j in range(B)) / B
    return (text_retrieval + image_retrieval) / 2


def test_cmr_checker_accepts_the_library_and_a_loop(capsys):
    from course_lib.core.losses import contrastive_loss
    from course_lib.exercises.pretraining import check_cmr_loss

    check_cmr_loss(contrastive_loss)
    check_cmr_loss(_cmr_loop)
    assert capsys.readouterr().out.count("correct") == 2


def test_cmr_checker_names_the_usual_mistakes():
    import torch
    import torch.nn.functional as F

    from course_lib.exercises.pretraining import check_cmr_loss

    def rows_only(s):
        return F.cross_entropy(s, torch.arange(len(s)))

    def columns_only(s):
        return F.cross_entropy(s.t(), torch.arange(len(s)))

    with pytest.raises(ExerciseError, match="only the image->text direction"):
        check_cmr_loss(rows_only)
    with pytest.raises(ExerciseError, match="only the text->image direction"):
        check_cmr_loss(columns_only)
    with pytest.raises(ExerciseError, match="did not halve"):
        check_cmr_loss(lambda s: rows_only(s) + columns_only(s))
    with pytest.raises(ExerciseError, match="summed over the batch"):
        check_cmr_loss(lambda s: _cmr_loop(s) * len(s))
    with pytest.raises(ExerciseError, match="no gradient"):
        check_cmr_loss(lambda s: torch.tensor(_cmr_loop(s).item()))
    with pytest.raises(ExerciseError, match="one number"):
        check_cmr_loss(lambda s: (torch.logsumexp(s, 1) - s.diagonal()))

    def without_positive(s):
        negatives = s.masked_fill(torch.eye(len(s), dtype=torch.bool), float("-inf"))
        return (-s.diagonal() + (torch.logsumexp(negatives, 1)
                                 + torch.logsumexp(negatives, 0)) / 2).mean()

    with pytest.raises(ExerciseError, match="denominator"):
        check_cmr_loss(without_positive)


# ------------------------------------------------------------------------------- lesson 03: masking

def _mask_loop(input_ids, attention_mask, vocab_size, mask_prob, generator):
    # independent answer: caption by caption, word by word, one uniform draw per decision
    import torch

    from course_lib.core.tokens import CLS_ID, MASK_ID, PAD_ID, SEP_ID

    masked, labels = input_ids.clone(), torch.full_like(input_ids, -100)
    for b in range(len(input_ids)):
        words = [t for t in range(input_ids.shape[1]) if attention_mask[b, t]
                 and int(input_ids[b, t]) not in (CLS_ID, SEP_ID, PAD_ID)]
        picks = [t for t in words if float(torch.rand(1, generator=generator)) < mask_prob]
        if words and not picks:
            picks = [words[int(torch.randint(len(words), (1,), generator=generator))]]
        for t in picks:
            labels[b, t] = input_ids[b, t]
            action = float(torch.rand(1, generator=generator))
            if action < 0.8:
                masked[b, t] = MASK_ID
            elif action < 0.9:
                masked[b, t] = int(torch.randint(5, vocab_size, (1,), generator=generator))
    return masked, labels


def test_mask_checker_accepts_the_library_and_a_loop(capsys):
    from course_lib.core.losses import mask_tokens
    from course_lib.exercises.pretraining import check_mask_tokens

    check_mask_tokens(mask_tokens)
    check_mask_tokens(_mask_loop)
    assert capsys.readouterr().out.count("correct") == 2


def _variant(*, specials=False, all_mask=False, labels_everywhere=False, force_one=True,
             own_rng=False, in_place=False, random_from_all=False):
    """The library's masking with one thing done wrong, as a learner might."""
    import torch

    from course_lib.core.tokens import CLS_ID, MASK_ID, PAD_ID, SEP_ID

    def fn(input_ids, attention_mask, vocab_size, mask_prob, generator):
        generator = None if own_rng else generator
        real = attention_mask.bool()
        if not specials:
            real &= (input_ids != CLS_ID) & (input_ids != SEP_ID) & (input_ids != PAD_ID)
        picked = real & (torch.rand(input_ids.shape, generator=generator) < mask_prob)
        none = real.any(1) & ~picked.any(1)
        if force_one and none.any():
            noise = torch.rand(input_ids.shape, generator=generator).masked_fill(~real, -1.0)
            picked[none, noise.argmax(1)[none]] = True
        labels = input_ids.clone() if labels_everywhere else torch.where(picked, input_ids, -100)
        action = torch.rand(input_ids.shape, generator=generator)
        masked = input_ids if in_place else input_ids.clone()
        low = 0 if random_from_all else 5
        words = torch.randint(low, vocab_size, input_ids.shape, generator=generator)
        swap = picked & (action >= 0.8) & (action < 0.9)
        masked[swap] = words[swap]
        masked[picked & ((action < 0.8) | all_mask)] = MASK_ID
        return masked, labels

    return fn


@pytest.mark.parametrize("switch, message", [
    ("specials", r"\[CLS\] was picked"),
    ("all_mask", "80% \\[MASK\\], 10% a random word"),
    ("labels_everywhere", "IGNORE"),
    ("force_one", "at least one per caption"),
    ("own_rng", "same seed"),
    ("in_place", "in place"),
    ("random_from_all", "special tokens"),
])
def test_mask_checker_names_the_usual_mistakes(switch, message):
    from course_lib.exercises.pretraining import check_mask_tokens

    kwargs = {switch: switch != "force_one"} if switch != "force_one" else {"force_one": False}
    with pytest.raises(ExerciseError, match=message):
        check_mask_tokens(_variant(**kwargs))


# -------------------------------------------------------------------------------- lesson 04: eq. 15

def _eq15_loop(image_intra, text_intra, image_inter, text_inter, alpha=0.5):
    # independent answer: pair by pair, the cosine written out
    import torch

    out = []
    for p in range(image_intra.shape[0]):
        i = alpha * image_intra[p] + image_inter[p]
        t = alpha * text_intra[p] + text_inter[p]
        out.append(torch.dot(i, t) / (i.norm() * t.norm()))
    return torch.stack(out)


def test_eq15_checker_accepts_the_library_and_a_loop(capsys):
    from course_lib.exercises.ubert import check_enhanced_similarity
    from course_lib.methods.ubert.model import enhanced_similarity

    check_enhanced_similarity(enhanced_similarity)
    check_enhanced_similarity(_eq15_loop)
    assert capsys.readouterr().out.count("correct") == 2


def test_eq15_checker_names_the_usual_mistakes():
    import torch
    import torch.nn.functional as F

    from course_lib.exercises.ubert import check_enhanced_similarity

    def dot(ii, ti, ie, te, alpha=0.5):
        return ((alpha * ii + ie) * (alpha * ti + te)).sum(-1)

    def alpha_on_inter(ii, ti, ie, te, alpha=0.5):
        return F.cosine_similarity(ii + alpha * ie, ti + alpha * te, dim=-1)

    def matrix(ii, ti, ie, te, alpha=0.5):
        return F.normalize(alpha * ii + ie, dim=-1) @ F.normalize(alpha * ti + te, dim=-1).T

    def renormalised(ii, ti, ie, te, alpha=0.5):
        return _eq15_loop(*(F.normalize(v, dim=-1) for v in (ii, ti, ie, te)), alpha=alpha)

    def two_cosines(ii, ti, ie, te, alpha=0.5):
        return alpha * F.cosine_similarity(ii, ti, dim=-1) + F.cosine_similarity(ie, te, dim=-1)

    def column(ii, ti, ie, te, alpha=0.5):
        return _eq15_loop(ii, ti, ie, te, alpha)[:, None]

    def s1_only(ii, ti, ie, te, alpha=0.5):
        return F.cosine_similarity(ii, ti, dim=-1)

    for fn, message in ((dot, "dot product of the two sums"),
                        (alpha_on_inter, "alpha multiplies the inter"),
                        (matrix, r"\(6, 6\) matrix"),
                        (renormalised, "normalised the four inputs again"),
                        (two_cosines, "added two cosines"), (column, "expected shape")):
        with pytest.raises(ExerciseError, match=message):
            check_enhanced_similarity(fn)
    with pytest.raises(ExerciseError, match="this is s1"):
        check_enhanced_similarity(s1_only)
    assert torch.is_tensor(_eq15_loop(*(torch.ones(2, 3),) * 4))


# ------------------------------------------------------------------------------- lesson 04: stage 2

@pytest.fixture(scope="module")
def ubert_pair():
    """A tiny untrained U-BERT in train mode (dropout on: the checker must switch it off) and one
    query's states against K = 7 candidates with padded regions and tokens."""
    import torch

    from course_lib.methods.ubert.model import UBERT, UBERTConfig

    torch.manual_seed(0)
    config = UBERTConfig(hidden=16, tower_layers=1, cross_layers=2, heads=2, dropout=0.3,
                         cross_towers="none")
    model = UBERT(region_dim=8, vocab_size=30, config=config).train()
    K, M, L, H = 7, 5, 6, config.hidden
    g = torch.Generator().manual_seed(1)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, H, generator=g), dim=-1)  # noqa: E731
    region_mask = torch.ones(K, M, dtype=torch.bool)
    region_mask[::2, -2:] = False  # padded regions in every other candidate
    text_mask = torch.tensor([[True] * 4 + [False] * 2])  # a caption of 4 tokens padded to 6
    query = (torch.randn(1, L, H, generator=g), text_mask, unit(1))
    gallery = (torch.randn(K, M, H, generator=g), region_mask, unit(K))
    return model, query, gallery


def _one_by_one(model, query, gallery):
    # independent answer: one candidate at a time, through eq. 10-15 by the model's parts
    import torch

    from course_lib.methods.ubert.model import enhanced_similarity

    scores = []
    for k in range(gallery[2].shape[0]):
        candidate = [s[k:k + 1] for s in gallery]
        image_inter, text_inter = model.inter(candidate[0], candidate[1], query[0], query[1])
        scores.append(enhanced_similarity(candidate[2], query[2], image_inter, text_inter,
                                          model.config.alpha))
    return torch.cat(scores)


def test_rerank_checker_accepts_a_loop_and_the_batched_scorer(ubert_pair, capsys):
    from course_lib.exercises.ubert import check_rerank_one_by_one
    from course_lib.methods.ubert.model import rescore_candidates

    model, query, gallery = ubert_pair
    check_rerank_one_by_one(_one_by_one, model, query, gallery)
    check_rerank_one_by_one(rescore_candidates, model, query, gallery)
    assert capsys.readouterr().out.count("correct") == 2
    assert model.training  # its mode is restored


def test_rerank_checker_names_the_usual_mistakes(ubert_pair):
    import torch

    from course_lib.exercises.ubert import check_rerank_one_by_one

    model, query, gallery = ubert_pair
    cases = [
        (lambda m, q, g: _one_by_one(m, q, g).sort(descending=True).values, "another order"),
        (lambda m, q, g: torch.cat([m.s2([s[0:1] for s in g], q)] * g[2].shape[0]),
         "candidate 0's"),
        (lambda m, q, g: g[2] @ q[2][0], "stage-1 scores s1"),
        (lambda m, q, g: list(_one_by_one(m, q, g)), "torch.cat"),
        (lambda m, q, g: _one_by_one(m, q, g)[:, None], r"expected shape \(7,\)"),
        (lambda m, q, g: torch.cat([m.s2([s[k] for s in g], q) for k in range(g[2].shape[0])]),
         "a batch of one"),
        (lambda m, q, g: _one_by_one(m, q, g) + 1e-3, "differ from rescore_candidates"),
    ]
    for fn, message in cases:
        with pytest.raises(ExerciseError, match=message):
            check_rerank_one_by_one(fn, model, query, gallery)


# ------------------------------------------------------------------------------- lesson 06: h(x, y)
def _h_loop(forward_logits, backward_logits, input_ids, reversed_ids, attention_mask):
    """h one caption and one position at a time: log p of each word given the tokens before it,
    forward over input_ids and backward over reversed_ids; [CLS] (2), [SEP] (3), [PAD]
    (0) skipped."""
    import torch

    out = []
    for b in range(input_ids.shape[0]):
        total = 0.0
        for logits, ids in ((forward_logits[b], input_ids[b]),
                            (backward_logits[b], reversed_ids[b])):
            for t in range(1, ids.shape[0]):
                if int(ids[t]) > 4 and attention_mask[b, t]:
                    total += torch.log_softmax(logits[t - 1], dim=-1)[ids[t]].item()
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def test_log_likelihood_checker_accepts_the_library_and_a_loop(capsys):
    from course_lib.exercises.fast_slow import check_summed_log_likelihood
    from course_lib.methods.fast_slow.decoder import summed_log_likelihood

    check_summed_log_likelihood(summed_log_likelihood)
    check_summed_log_likelihood(_h_loop)
    assert capsys.readouterr().out.count("correct") == 2


def test_log_likelihood_checker_names_the_usual_mistakes():
    import torch

    from course_lib.exercises.fast_slow import check_summed_log_likelihood

    def one_direction(logits, ids, words, shift=True):
        log_p = torch.log_softmax(logits, dim=-1)
        if not shift:
            return (log_p.gather(2, ids[..., None]).squeeze(2) * words).sum(1)
        return (log_p[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2) * words[:, 1:]).sum(1)

    def words_of(ids, mask):
        return ((ids > 4) & mask.bool()).double()

    def no_shift(f, b, ids, rev, mask):
        return (one_direction(f, ids, words_of(ids, mask), False)
                + one_direction(b, rev, words_of(rev, mask), False))

    def with_padding(f, b, ids, rev, mask):
        ones = torch.ones_like(ids, dtype=torch.float64)
        return one_direction(f, ids, ones) + one_direction(b, rev, ones)

    def with_sep(f, b, ids, rev, mask):
        return one_direction(f, ids, mask.double()) + one_direction(b, rev, mask.double())

    def normalised(f, b, ids, rev, mask):
        return _h_loop(f, b, ids, rev, mask) / words_of(ids, mask).sum(1)

    def forward_only(f, b, ids, rev, mask):
        return one_direction(f, ids, words_of(ids, mask))

    def backward_on_forward_ids(f, b, ids, rev, mask):
        return (one_direction(f, ids, words_of(ids, mask))
                + one_direction(b, ids, words_of(ids, mask)))

    cases = [
        (no_shift, "not shifted"),
        (with_padding, "padding"),
        (with_sep, r"\[SEP\] counted"),
        (normalised, "length-normalised"),
        (forward_only, "only the forward direction"),
        (backward_on_forward_ids, "reversed caption"),
        (lambda *a: -_h_loop(*a), "sign"),
        (lambda *a: _h_loop(*a).sum(), "one number"),
        (lambda *a: _h_loop(*a) + 1e-3, "differs from eq. 2-3"),
    ]
    for fn, message in cases:
        with pytest.raises(ExerciseError, match=message):
            check_summed_log_likelihood(fn)


def test_loss_checkers_accept_a_plain_number_and_say_it_cannot_train(capsys):
    # a Python float used to be refused ("expected one number (a 0-d tensor), got float")
    from course_lib.core.losses import contrastive_loss
    from course_lib.exercises.hivlp import check_hrl_loss
    from course_lib.exercises.pretraining import check_cmr_loss
    from course_lib.methods.hivlp.model import hrl_loss

    check_cmr_loss(lambda s: float(contrastive_loss(s)))
    check_hrl_loss(lambda images, texts: hrl_loss(images, texts).item())
    out = capsys.readouterr().out
    assert out.count("correct") == 2 and out.count("plain number") == 2


def test_hrl_checker_names_one_direction_only():
    # lesson 05 promises that this answer is named; it used to get the
    # generic "expected ..., got ..."
    import torch
    import torch.nn.functional as F

    from course_lib.exercises.hivlp import check_hrl_loss

    def images_as_queries(images, texts):
        return sum(F.cross_entropy(i @ t.T, torch.arange(len(i)))
                   for i, t in zip(images, texts, strict=True))

    def texts_as_queries_halved(images, texts):
        return sum(F.cross_entropy(t @ i.T, torch.arange(len(i))) / 2
                   for i, t in zip(images, texts, strict=True))

    for answer in (images_as_queries, texts_as_queries_halved):
        with pytest.raises(ExerciseError, match="only one direction"):
            check_hrl_loss(answer)


def test_timing_checker_accepts_latency_vs_gallery_and_names_what_is_wrong(capsys):
    # the timing exercises of lessons 00-03 had no checker
    import torch

    from course_lib.core.timing import latency_vs_gallery
    from course_lib.exercises.timing import check_latency_rows, check_top_k

    rows = latency_vs_gallery(lambda n: (lambda: sum(range(n))), [100, 200, 400, 800], warmup=1,
                              repeats=3, max_measured=400)
    check_latency_rows(rows, [100, 200, 400, 800], measured_up_to=400)
    with pytest.raises(ExerciseError, match="one row per gallery size"):
        check_latency_rows(rows[:3], [100, 200, 400, 800], measured_up_to=400)
    with pytest.raises(ExerciseError, match="pass max_measured"):
        check_latency_rows([{**r, "measured": True} for r in rows], [100, 200, 400, 800],
                           measured_up_to=400)
    with pytest.raises(ExerciseError, match="positive number"):
        check_latency_rows([{**r, "ms_per_query": 0.0} for r in rows], [100, 200, 400, 800],
                           measured_up_to=400)
    cheap = [dict(r) for r in rows]
    cheap[-1]["ms_per_query"] = cheap[-2]["ms_per_query"] / 10
    with pytest.raises(ExerciseError, match="cannot be cheaper"):
        check_latency_rows(cheap, [100, 200, 400, 800], measured_up_to=400)
    scores = torch.arange(20.0)
    check_top_k(torch.topk(scores, 10).indices, torch.topk(scores, 10).indices)
    with pytest.raises(ExerciseError, match="the top 10 are"):
        check_top_k(torch.arange(10), torch.topk(scores, 10).indices)
    assert capsys.readouterr().out.count("in the right shape") == 1


def test_chance_checker_accepts_the_library_and_names_the_usual_mistakes(capsys):
    from math import comb

    from course_lib.exercises.real_photos import check_chance_recall
    from course_lib.notebook import chance_recall

    # the library's product over picks against the checker's count of sets
    check_chance_recall(chance_recall)
    assert "correct" in capsys.readouterr().out
    for wrong, message in ((lambda n, k, r=1: min(k * r, n) / n * 100, "at least one"),
                           (lambda n, k, r=1: 1 - comb(n - r, min(k, n)) / comb(n, min(k, n)),
                            "in percent"),
                           (lambda n, k, r=1: (100 * (1 - comb(n - r, k) / comb(n, k)) if k <= n
                                               else 100 * k / n),
                            "more than the 20 candidates")):
        with pytest.raises(ExerciseError, match=message):
            check_chance_recall(wrong)
