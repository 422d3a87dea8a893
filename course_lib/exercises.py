"""Checkers for the notebooks' exercises: each runs the learner's function on cases with
known answers and says what is wrong in words (the usual mistakes first), or that it passes.

The reference answers come from `course_lib.metrics`, so an exercise checks the learner against
the same tested code the rest of the course uses.
"""

from __future__ import annotations

import numpy as np

from .metrics import retrieval_metrics, retrieval_ranks


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""


def _cases(seed: int = 0):
    """Small score matrices (n_images, n_texts) with 5 captions per image, ties included."""
    rng = np.random.default_rng(seed)
    for n_images in (2, 3, 7):
        txt2img = np.repeat(np.arange(n_images), 5)
        sims = rng.normal(size=(n_images, 5 * n_images)).round(1)  # rounding makes ties
        yield sims, txt2img


def _recall_from_ranks(ranks, k):
    return 100.0 * np.mean(np.asarray(ranks) < k)


def check_t2i_ranks(fn) -> None:
    """fn(sims, txt2img) -> 0-based rank of the true image for every text (length n_texts)."""
    for sims, txt2img in _cases():
        expected = retrieval_ranks(sims, txt2img)[1]
        got = np.asarray(fn(sims.copy(), txt2img.copy()))
        if got.shape != expected.shape:
            raise ExerciseError(f"expected one rank per text, shape {expected.shape}, got {got.shape}; "
                                "text queries are the columns of sims (n_images, n_texts)")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("every rank is one too high: either they are 1-based (the course counts from "
                                "0, R@K = mean(rank < K)) or you count the true image itself among those "
                                "scoring at least as high; count only the other images")
        ties = (sims == sims[txt2img, np.arange(sims.shape[1])][None, :]).sum(0) - 1
        if ties.any() and not np.array_equal(got, expected) and np.array_equal(got, expected - ties):
            raise ExerciseError("on ties you count only strictly higher scores; count every *other* image "
                                "scoring at least as high as the true one (the pessimistic convention the "
                                "course uses, so a model that scores everything alike cannot look perfect)")
        if not np.array_equal(got, expected):
            bad = int(np.flatnonzero(got != expected)[0])
            raise ExerciseError(f"text {bad}: expected rank {expected[bad]}, got {got[bad]} "
                                f"(on a {sims.shape[0]}x{sims.shape[1]} matrix)")
    print("t2i ranks: correct")


def check_i2t_ranks(fn) -> None:
    """fn(sims, txt2img) -> 0-based best rank over each image's captions (length n_images)."""
    for sims, txt2img in _cases(1):
        expected = retrieval_ranks(sims, txt2img)[0]
        got = np.asarray(fn(sims.copy(), txt2img.copy()))
        if got.shape != expected.shape:
            raise ExerciseError(f"expected one rank per image, shape {expected.shape}, got {got.shape}")
        if np.array_equal(got, expected + 1):
            raise ExerciseError("your ranks are 1-based; the course counts from 0 (R@K = mean(rank < K))")
        first_caption_only = np.array([((sims[i] >= sims[i, np.flatnonzero(txt2img == i)[0]])
                                        & (txt2img != i)).sum() for i in range(sims.shape[0])])
        if np.array_equal(got, first_caption_only) and not np.array_equal(got, expected):
            raise ExerciseError("you ranked only the first caption of each image; the i2t rank is the "
                                "best (smallest) rank over all of the image's ground-truth captions")
        if not np.array_equal(got, expected):
            bad = int(np.flatnonzero(got != expected)[0])
            raise ExerciseError(f"image {bad}: expected rank {expected[bad]}, got {got[bad]}")
    # and the recalls they give agree with the library's
    sims, txt2img = next(_cases(2))
    metrics = retrieval_metrics(sims, txt2img, ks=(1, 5))
    ranks = np.asarray(fn(sims, txt2img))
    if abs(_recall_from_ranks(ranks, 1) - metrics["i2t_r1"]) > 1e-9:
        raise ExerciseError("ranks look right but the recall they give disagrees with retrieval_metrics")
    print("i2t ranks: correct")


# ----------------------------------------------------------------------------- lesson 01

def _score_batches(seed: int = 0):
    """Square (B, B) score matrices, rows images and columns texts, positives on the diagonal."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for batch in (2, 5, 16):
        yield torch.randn(batch, batch, generator=generator, dtype=torch.float64).tanh()


def _hinge_directions(scores, margin: float, max_violation: bool):
    """The two halves of VSE++'s loss (wrong texts per image, wrong images per text), and the
    sum-of-hinges total with the diagonal left in: the usual mistakes, to recognise them."""
    positives = scores.diagonal().view(-1, 1)  # (B, 1)
    cost_text = (margin + scores - positives).clamp(min=0)  # (B, B) rows: images
    cost_image = (margin + scores - positives.t()).clamp(min=0)  # (B, B) columns: texts
    with_diagonal = float(cost_text.sum() + cost_image.sum())
    eye = scores.new_ones(scores.shape[0]).diag().bool()
    cost_text, cost_image = cost_text.masked_fill(eye, 0), cost_image.masked_fill(eye, 0)
    if max_violation:
        return float(cost_text.max(1).values.sum()), float(cost_image.max(0).values.sum()), with_diagonal
    return float(cost_text.sum()), float(cost_image.sum()), with_diagonal


def check_hinge_loss(fn, margin: float = 0.2) -> None:
    """fn(scores, margin, max_violation) -> VSE++'s hinge loss, summed over the batch."""
    from .losses import hinge_triplet_loss

    def close(a, b):
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))

    for max_violation in (False, True):
        label = "max-violation" if max_violation else "sum of hinges"
        for scores in _score_batches():
            expected = float(hinge_triplet_loss(scores, margin, max_violation))
            got = float(fn(scores.clone(), margin, max_violation))
            if close(got, expected):
                continue
            batch = scores.shape[0]
            per_image, per_text, with_diagonal = _hinge_directions(scores, margin, max_violation)
            if close(got * batch, expected):
                raise ExerciseError(f"{label}: you averaged over the batch; VSE++ returns the sum")
            if not max_violation and close(got, with_diagonal):
                raise ExerciseError(f"{label}: the positives count as their own negatives (each adds "
                                    "`margin`); zero the diagonal of both cost matrices")
            if close(got, per_image) or close(got, per_text):
                raise ExerciseError(f"{label}: only one direction is counted; add wrong texts per image "
                                    "(rows) and wrong images per text (columns)")
            raise ExerciseError(f"{label}: expected {expected:.6f} on a {batch}x{batch} batch, got {got:.6f}; "
                                "check the hinge [margin + S(i, j) - S(i, i)]_+ and the axis of each max")
    print("hinge loss: correct (sum of hinges and max-violation)")


# ----------------------------------------------------------------------------- lesson 02

def _attend(query, context, lam, *, norm_over_query=True, softmax_over_context=True, clip=True):
    """SCAN's func_attention with one step switchable, to recognise a learner's mistake."""
    import torch
    import torch.nn.functional as F

    attn = torch.bmm(context, query.transpose(1, 2))  # (P, Lc, Lq)
    if clip:
        attn = F.leaky_relu(attn, 0.1)
    attn = attn / (attn.norm(dim=2 if norm_over_query else 1, keepdim=True) + 1e-8)
    weights = torch.softmax(lam * attn, dim=1 if softmax_over_context else 2)  # (P, Lc, Lq)
    return torch.bmm(weights.transpose(1, 2), context)  # (P, Lq, D)


def check_func_attention(fn, lambda_softmax: float = 9.0) -> None:
    """fn(query (P, Lq, D), context (P, Lc, D), lambda_softmax) -> attended (P, Lq, D), as SCAN."""
    import torch
    import torch.nn.functional as F

    from .scan import func_attention

    generator = torch.Generator().manual_seed(0)
    query = F.normalize(torch.randn(3, 4, 8, generator=generator, dtype=torch.float64), dim=-1)
    context = F.normalize(torch.randn(3, 6, 8, generator=generator, dtype=torch.float64), dim=-1)
    expected, _ = func_attention(query, context, lambda_softmax)
    got = fn(query.clone(), context.clone(), lambda_softmax)
    got = got[0] if isinstance(got, tuple) else got
    if tuple(got.shape) != tuple(expected.shape):
        raise ExerciseError(f"attended must be (P, Lq, D) = {tuple(expected.shape)}, got {tuple(got.shape)}: "
                            "one attended context vector per query item")
    if torch.allclose(got, expected, atol=1e-8):
        print("func_attention: correct")
        return
    mistakes = [
        (dict(norm_over_query=False), "you L2-normalised over the context axis; SCAN's clipped_l2norm "
                                      "normalises over the query axis"),
        (dict(softmax_over_context=False), "the softmax runs over the query axis; each query item's weights "
                                           "must sum to 1 over the context items"),
        (dict(clip=False), "the LeakyReLU(0.1) before the normalisation is missing (SCAN's clipped_l2norm)"),
    ]
    for switches, message in mistakes:
        if torch.allclose(got, _attend(query, context, lambda_softmax, **switches), atol=1e-8):
            raise ExerciseError(message)
    if torch.allclose(got, _attend(query, context, 1.0), atol=1e-8):
        raise ExerciseError("lambda_softmax is missing: multiply the normalised scores by it before the softmax")
    worst = (got - expected).abs().max().item()
    raise ExerciseError(f"attended vectors differ from SCAN's by up to {worst:.3g}; follow the steps: "
                        "context . query^T, LeakyReLU(0.1), L2-norm over queries, times lambda, softmax "
                        "over context, weighted sum of context")


# ----------------------------------------------------------------------------- lesson 03

def _cmr_cases(seed: int = 0):
    """(label, (B, B) float64 scores): random batches, then hand-made ones where the two
    directions of CMR disagree (so a one-direction answer cannot pass) and a batch of one."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for batch in (5, 16, 2):  # 5 first: there summing over the batch and not halving differ
        yield f"a random {batch}x{batch} batch", 3 * torch.randn(batch, batch, generator=generator,
                                                                  dtype=torch.float64)
    yield "a non-symmetric 2x2 batch", torch.tensor([[2.0, 0.0], [3.0, 1.0]], dtype=torch.float64)
    yield "a non-symmetric 3x3 batch", torch.tensor([[4.0, 1.0, -2.0], [0.5, 0.0, 3.0], [-1.0, 2.0, 1.5]],
                                                    dtype=torch.float64)
    yield "a batch of one pair", torch.tensor([[0.7]], dtype=torch.float64)


def _cmr_mistakes(scores) -> list[tuple[float, str]]:
    """Losses of the usual wrong CMRs on scores, each with what to tell the learner."""
    import torch
    import torch.nn.functional as F

    targets = torch.arange(len(scores))
    per_image = F.cross_entropy(scores, targets)  # text retrieval: softmax over each row
    per_text = F.cross_entropy(scores.t(), targets)  # image retrieval: softmax over each column
    eye = torch.eye(len(scores), dtype=torch.bool)
    negatives_only = scores.masked_fill(eye, float("-inf"))
    denominators = (torch.logsumexp(negatives_only, 1) + torch.logsumexp(negatives_only, 0)) / 2
    no_positive = denominators - scores.diagonal()
    return [
        (float(per_image), "only the image->text direction (a softmax over each row) is there; eq. 6 "
                           "also needs the text->image one (a softmax over each column)"),
        (float(per_text), "only the text->image direction (a softmax over each column) is there; eq. 6 "
                          "also needs the image->text one (a softmax over each row)"),
        (float(per_image + per_text), "you added the two directions but did not halve the sum (eq. 6: 1/2n)"),
        (float((per_image + per_text) / 2 * len(scores)), "you summed over the batch; CMR averages over the "
                                                           "n pairs (eq. 6: 1/2n)"),
        (float(no_positive.mean()), "the positive pair is missing from the softmax's denominator; it runs "
                                    "over all n candidates, the positive included"),
    ]


def check_cmr_loss(fn) -> None:
    """fn(scores (B, B) images x texts, positives on the diagonal) -> LightningDOT's CMR, eq. 6."""
    import torch

    from .losses import contrastive_loss

    for label, scores in _cmr_cases():
        expected = float(contrastive_loss(scores))
        given = scores.clone().requires_grad_(True)
        got = fn(given)
        if not torch.is_tensor(got) or got.numel() != 1:
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise ExerciseError(f"on {label} expected one number (a 0-d tensor), got {shape}; average the "
                                "per-query losses into one scalar")
        if not got.requires_grad:
            raise ExerciseError("the loss carries no gradient back to the scores: keep it in torch (no "
                                ".item(), .numpy() or float() inside), or training cannot use it")
        value = float(got.detach())
        if abs(value - expected) <= 1e-5 * max(1.0, abs(expected)):  # float32 answers pass too
            continue
        for wrong, message in _cmr_mistakes(scores):
            if abs(value - wrong) <= 1e-5 * max(1.0, abs(wrong)):
                raise ExerciseError(f"on {label}: {message}")
        raise ExerciseError(f"on {label} expected {expected:.6f}, got {value:.6f}; CMR is "
                            "(cross-entropy of each row against its diagonal + the same for each column) / 2, "
                            "each averaged over the batch")
    print("CMR loss: correct (both directions, averaged, batches of 1 to 16)")


def _caption_batch(n: int, vocab_size: int, generator, lengths=(1, 14), special=None):
    """n captions [CLS] w.. [SEP] [PAD].. with lengths (in words) drawn from `lengths`, inclusive;
    words uniform over the non-special ids; special: SpecialTokens (default the word tokenizer's)."""
    import torch

    from .data.tokenizer import WORD_SPECIAL_TOKENS

    special = special or WORD_SPECIAL_TOKENS
    words = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=generator)  # (n,)
    width = int(words.max()) + 2
    ids = torch.full((n, width), special.pad, dtype=torch.long)
    position = torch.arange(width).expand(n, -1)  # (n, width)
    real = (position >= 1) & (position <= words[:, None])
    word_ids = special.word_ids(vocab_size)  # (V - S,)
    ids[real] = word_ids[torch.randint(len(word_ids), (int(real.sum()),), generator=generator)]
    ids[:, 0] = special.cls
    ids[torch.arange(n), words + 1] = special.sep
    return ids, (position <= words[:, None] + 1).long(), real


def _masking_invariants(ids, real, masked, labels, special=None) -> None:
    """What must hold for every call of a BERT masking, whatever its random draws."""
    from .data.tokenizer import WORD_SPECIAL_TOKENS
    from .lightningdot import IGNORE

    special = special or WORD_SPECIAL_TOKENS

    if tuple(masked.shape) != tuple(ids.shape) or tuple(labels.shape) != tuple(ids.shape):
        raise ExerciseError(f"masked_ids and labels must both have the shape of input_ids {tuple(ids.shape)}, "
                            f"got {tuple(masked.shape)} and {tuple(labels.shape)}")
    picked = labels != IGNORE
    if float(picked.double().mean()) > 0.5:
        raise ExerciseError(f"labels must be IGNORE ({IGNORE}) at every position you did not pick (other words, "
                            "[CLS], [SEP], padding), so that only the masked words count in the loss")
    for token, name in ((special.cls, "[CLS]"), (special.sep, "[SEP]"), (special.pad, "[PAD]")):
        spot = ids == token
        if (picked & spot).any() or (masked[spot] != token).any():
            raise ExerciseError(f"{name} was picked or changed; only real words may be masked (skip the [CLS], "
                                "[SEP] and [PAD] ids, and the positions where attention_mask is 0)")
    if (labels[picked] != ids[picked]).any():
        raise ExerciseError("at a picked word, labels must hold its original id (what the model must predict)")
    if (masked[~picked] != ids[~picked]).any():
        raise ExerciseError("a word you did not pick was changed (its label is IGNORE); only picked words may "
                            "differ from input_ids")
    missed = real.any(1) & ~picked.any(1)
    if missed.any():
        raise ExerciseError(f"{int(missed.sum())} caption(s) have no picked word; pick at least one per "
                            "caption (UNITER: the caption's first real word, when the coin flips picked none)")


def check_mask_tokens(fn, vocab_size: int = 120) -> None:
    """fn(input_ids, attention_mask, vocab_size, mask_prob, generator) -> (masked_ids, labels), the
    contract of course_lib.lightningdot.mask_tokens: real words picked with probability mask_prob (at
    least one per caption), 80% -> [MASK], 10% -> a random word, 10% kept; labels IGNORE elsewhere.
    Where the coin flips picked none, UNITER (and the library) picks the caption's first real word
    and makes it [MASK]; the checker accepts any one forced word, and says so when yours is not the
    first (a mask_prob of 0 shows the forced picks alone).
    The batches use the word tokenizer's ids (WORD_SPECIAL_TOKENS: [PAD]=0 .. [MASK]=4), the ids the
    exercise's fn takes from course_lib.data.tokenizer."""
    import torch

    from .data.tokenizer import WORD_SPECIAL_TOKENS as special
    from .lightningdot import IGNORE

    def run(ids, attention, mask_prob, seed):
        before = ids.clone()
        out = fn(ids, attention, vocab_size, mask_prob, torch.Generator().manual_seed(seed))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ExerciseError("return two tensors: (masked_ids, labels)")
        if not torch.equal(ids, before):
            raise ExerciseError("input_ids was changed in place; clone it first (masked = input_ids.clone())")
        return torch.as_tensor(out[0]), torch.as_tensor(out[1])

    generator, rates = torch.Generator().manual_seed(0), {}
    # small batches for the rules (1-word captions: the forced pick), large ones for the statistics
    for n, lengths, mask_prob in ((6, (1, 5), 0.15), (40, (1, 3), 0.15), (3000, (3, 14), 0.15),
                                  (3000, (3, 14), 0.4)):
        ids, attention, real = _caption_batch(n, vocab_size, generator, lengths, special)
        masked, labels = run(ids, attention, mask_prob, seed=n)
        _masking_invariants(ids, real, masked, labels, special)
        words = real.sum(1).double()  # (n,) each caption's words; below, its expected picks
        expected = float((words * mask_prob + (1 - mask_prob) ** words).sum() / words.sum())
        rates[mask_prob] = rate = float((labels != IGNORE).sum() / real.sum())
        if n >= 3000 and not (mask_prob - 0.02 <= rate <= expected + 0.03):
            raise ExerciseError(f"with mask_prob={mask_prob} you picked {100 * rate:.1f}% of the words; expected "
                                f"about {100 * expected:.1f}% (each word with probability mask_prob, plus one "
                                "forced pick where a caption got none)")
    ids0, attention0, real0 = _caption_batch(200, vocab_size, generator, (1, 8), special)
    masked0, labels0 = run(ids0, attention0, 0.0, seed=7)  # no coin picks: every pick is a forced one
    _masking_invariants(ids0, real0, masked0, labels0, special)
    first = real0 & (real0.cumsum(1) == 1)  # (n, T) each caption's first real word
    if not torch.equal(labels0 != IGNORE, first) or (masked0[first] != special.mask).any():
        print("note: where the coin flips picked no word you force one word, but not always the caption's "
              "first, or not always as [MASK]; UNITER's rule (and course_lib.lightningdot.mask_tokens) forces "
              "the first real word and makes it [MASK]. Accepted: either way every caption is in the loss.")
    if not all(torch.equal(a, b) for a, b in zip(run(ids, attention, 0.15, 1), run(ids, attention, 0.15, 1))):
        raise ExerciseError("two calls with generators of the same seed gave different masks; draw every "
                            "random number from `generator` (torch.rand(..., generator=generator))")
    picked = labels != IGNORE  # the mask_prob = 0.4 batch: about 10k picked words
    became, original = masked[picked], ids[picked]
    if (torch.isin(became, torch.tensor(special.all)) & (became != special.mask)).any():
        raise ExerciseError(f"some random replacements are special tokens; draw them from the real words, "
                            f"ids {len(special.all)} .. vocab_size - 1")
    shares = {"[MASK]": (became == special.mask),
              "a random word": (became != special.mask) & (became != original),
              "kept": became == original}
    shares = {k: float(v.double().mean()) for k, v in shares.items()}
    for what, target in (("[MASK]", 0.8), ("a random word", 0.1), ("kept", 0.1)):
        if abs(shares[what] - target) > 0.03:
            split = ", ".join(f"{100 * v:.0f}% {k}" for k, v in shares.items())
            raise ExerciseError(f"of the picked words {split}; BERT's split is 80% [MASK], 10% a random word, "
                                f"10% kept (one uniform draw per picked word decides which)")
    print(f"mask_tokens: correct ({100 * rates[0.15]:.1f}% of the words picked at mask_prob 0.15, "
          f"{100 * rates[0.4]:.1f}% at 0.4; " + ", ".join(f"{100 * v:.0f}% {k}" for k, v in shares.items()) + ")")


# ----------------------------------------------------------------------------- lesson 04

def _eq15_cases(seed: int = 0):
    """(label, [I_intra, T_intra, I_inter, T_inter] (P, H) float64 each, alpha): unit vectors as the
    model hands them over, then unnormalised ones (each row its own length) and other alphas."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)

    def parts(P, H, unit):
        vectors = [torch.randn(P, H, generator=generator, dtype=torch.float64) for _ in range(4)]
        if unit:
            return [F.normalize(v, dim=-1) for v in vectors]
        return [v * (0.2 + 3 * torch.rand(P, 1, generator=generator, dtype=torch.float64)) for v in vectors]

    yield "6 pairs of unit vectors, alpha 0.5", parts(6, 8, True), 0.5
    yield "6 pairs of unit vectors, alpha 0.3", parts(6, 8, True), 0.3
    yield "5 pairs of unnormalised vectors, alpha 0.5", parts(5, 8, False), 0.5
    yield "4 pairs of unnormalised vectors, alpha 2.0", parts(4, 16, False), 2.0
    yield "a single pair of unit vectors, alpha 0.5", parts(1, 8, True), 0.5


def _eq15_mistakes(image_intra, text_intra, image_inter, text_inter, alpha) -> list:
    """(scores (P,), what to tell the learner) of the usual wrong versions of eq. 15."""
    import torch.nn.functional as F

    def cos(a, b):
        return F.cosine_similarity(a, b, dim=-1)

    def unit(v):
        return F.normalize(v, dim=-1)

    image, text = alpha * image_intra + image_inter, alpha * text_intra + text_inter  # (P, H) each
    return [
        ((image * text).sum(-1), "you returned the dot product of the two sums: the sums were not normalised. Eq. 15 "
                                 "is their cosine: divide by the norms of alpha*I_intra + I_inter and alpha*T_intra "
                                 "+ T_inter (a sum of two unit vectors is not a unit vector)"),
        (((alpha * unit(image_intra) + unit(image_inter)) * (alpha * unit(text_intra) + unit(text_inter))).sum(-1),
         "you normalised the four parts but not their sums; eq. 15 is the cosine of the sums: divide by "
         "the norms of alpha*I_intra + I_inter and alpha*T_intra + T_inter"),
        (cos(image_intra + alpha * image_inter, text_intra + alpha * text_inter),
         "alpha multiplies the inter-modal part; in eq. 15 it weighs the intra-modal part: alpha*I_intra + I_inter "
         "(and alpha*T_intra + T_inter)"),
        (alpha * cos(image_intra, text_intra) + cos(image_inter, text_inter),
         "you added two cosines (intra with intra, inter with inter); eq. 15 is one cosine between the two sums"),
        (cos(alpha * unit(image_intra) + unit(image_inter), alpha * unit(text_intra) + unit(text_inter)),
         "you L2-normalised the four inputs again; the model hands them over already normalised (§4.1), so take "
         "them as they come: only the two sums are normalised, by the cosine itself"),
        (cos(image_intra, text_intra), "this is s1 (eq. 14), the intra-modal cosine: the inter-modal parts are "
                                       "missing"),
        (cos(image_inter, text_inter), "only the inter-modal parts are there: add alpha times the intra-modal ones"),
    ]


def check_enhanced_similarity(fn) -> None:
    """fn(image_intra, text_intra, image_inter, text_inter, alpha) -> (P,) eq. 15 for P aligned pairs:
    cos(alpha * I_intra + I_inter, alpha * T_intra + T_inter), compared with
    course_lib.ubert.enhanced_similarity on unit and unnormalised inputs and several alphas."""
    import torch

    from .ubert import enhanced_similarity

    def close(a, b):
        return tuple(a.shape) == tuple(b.shape) and torch.allclose(a, b, atol=1e-6, rtol=1e-6)

    for label, parts, alpha in _eq15_cases():
        P = parts[0].shape[0]
        expected = enhanced_similarity(*parts, alpha=alpha)  # (P,)
        got = fn(*(p.clone() for p in parts), alpha=alpha)
        if not torch.is_tensor(got):
            got = torch.as_tensor(np.asarray(got, dtype=np.float64))
        got = got.detach().to(torch.float64).cpu()
        if got.dim() == 2 and got.shape[0] == got.shape[1] == P and P > 1:
            raise ExerciseError(f"on {label}: you returned a ({P}, {P}) matrix, every image against every caption; "
                                f"eq. 15 is per pair here: row p of the image inputs with row p of the text inputs "
                                f"-> ({P},). Take the cosine along the last axis, not a matrix product")
        if got.numel() == P and tuple(got.shape) != (P,):
            raise ExerciseError(f"on {label}: expected shape ({P},), one score per pair, got {tuple(got.shape)}: "
                                "drop the extra axis (keepdim=False, or .squeeze(-1))")
        if tuple(got.shape) != (P,):
            raise ExerciseError(f"on {label}: expected shape ({P},), one score per pair, got {tuple(got.shape)}")
        if close(got, expected):
            continue
        for wrong, message in _eq15_mistakes(*parts, alpha):
            if close(got, wrong):
                raise ExerciseError(f"on {label}: {message}")
        worst = (got - expected).abs().max().item()
        raise ExerciseError(f"on {label}: scores differ from eq. 15 by up to {worst:.3g}; eq. 15 is "
                            "cos(alpha*I_intra + I_inter, alpha*T_intra + T_inter), one number per pair")
    print("enhanced similarity (eq. 15): correct (unit and unnormalised inputs, alpha from 0.3 to 2, 1 to 6 pairs)")


def check_rerank_one_by_one(fn, model, query, gallery, atol: float = 1e-5) -> None:
    """fn(model, query, gallery) -> (K,) s2 of one query against its K candidates, computed one
    candidate at a time, compared with course_lib.ubert.rescore_candidates (all K in one batch).
    query: a caption's (tokens (1, L, H), mask (1, L), T_intra (1, H)); gallery: the candidates'
    (tokens (K, M, H), masks (K, M), I_intra (K, H)), as UBERTStates.text / .image give them. Both
    run in eval mode without gradients; the model's mode is restored after."""
    import torch

    from .ubert import rescore_candidates

    K = gallery[2].shape[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = rescore_candidates(model, query, gallery).float().cpu()  # (K,)
            try:
                got = fn(model, query, gallery)
            except Exception as error:  # the learner's bug: say where to look, keep the traceback
                raise ExerciseError(f"your function raised {type(error).__name__}: {error}. model.s2 takes "
                                    "batches: candidate k is tuple(s[k:k + 1] for s in gallery), a batch of one "
                                    "(s[k] drops the batch axis), paired with the query as it is") from error
    finally:
        model.train(was_training)
    if isinstance(got, (list, tuple)):
        raise ExerciseError(f"you returned a {type(got).__name__} of {len(got)} items; return one ({K},) tensor: "
                            "torch.cat the (1,) scores of the candidates")
    if not torch.is_tensor(got):
        raise ExerciseError(f"return a torch tensor of shape ({K},), got {type(got).__name__}")
    got = got.detach().float().cpu()
    if tuple(got.shape) != (K,):
        hint = (" (torch.cat the (1,) pieces, or .squeeze() a stack of them)" if got.numel() == K else
                f": one score for each of the {K} candidates")
        raise ExerciseError(f"expected shape ({K},), got {tuple(got.shape)}{hint}")
    worst = (got - expected).abs().max().item()
    if worst <= atol:
        print(f"rerank one by one: correct ({K} candidates, largest difference from rescore_candidates "
              f"{worst:.1e})")
        return
    if torch.allclose(got.sort().values, expected.sort().values, atol=atol):
        raise ExerciseError("the right scores in another order: return them in the candidates' order (score k "
                            "belongs to gallery row k); the cascade sorts them afterwards")
    if K > 1 and torch.allclose(got, expected[:1].expand(K), atol=atol):
        raise ExerciseError("every score is candidate 0's: index the gallery with the loop variable, "
                            "tuple(s[k:k + 1] for s in gallery)")
    s1 = gallery[2].float().cpu() @ query[2].float().cpu()[0]  # (K,) cosines of unit intra vectors
    if torch.allclose(got, s1, atol=atol):
        raise ExerciseError("these are the stage-1 scores s1 = cos(I_intra, T_intra) (eq. 14); stage 2 is "
                            "model.s2(candidate, query) (eq. 15), which runs BERT_cross on the pair")
    raise ExerciseError(f"scores differ from rescore_candidates by up to {worst:.3g} (tolerance {atol}); for "
                        "each k: model.s2(tuple(s[k:k + 1] for s in gallery), query), then torch.cat")
