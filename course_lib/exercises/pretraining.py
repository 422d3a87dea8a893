"""Checkers of lesson 03: LightningDOT's CMR loss and BERT's 80/10/10 word masking."""

import torch
import torch.nn.functional as F

from course_lib.core.losses import IGNORE, contrastive_loss
from course_lib.core.tokens import WORD_SPECIAL_TOKENS

from .errors import NO_GRADIENT_NOTE, ExerciseError, check_answer, scalar_answer


def _cmr_cases(seed: int = 0):
    """(label, (B, B) float64 scores): random, then ones where CMR's two directions disagree."""
    generator = torch.Generator().manual_seed(seed)
    for batch in (5, 16, 2):  # 5 first: there summing over the batch and not halving differ
        yield f"a random {batch}x{batch} batch", 3 * torch.randn(batch, batch, generator=generator,
                                                                  dtype=torch.float64)
    yield "a non-symmetric 2x2 batch", torch.tensor([[2.0, 0.0], [3.0, 1.0]], dtype=torch.float64)
    yield "a non-symmetric 3x3 batch", torch.tensor(
        [[4.0, 1.0, -2.0], [0.5, 0.0, 3.0], [-1.0, 2.0, 1.5]], dtype=torch.float64)
    yield "a batch of one pair", torch.tensor([[0.7]], dtype=torch.float64)


def _cmr_mistakes(scores) -> list[tuple[float, str]]:
    """Losses of the usual wrong CMRs on scores, each with what to tell the learner."""
    targets = torch.arange(len(scores))
    per_image = F.cross_entropy(scores, targets)  # text retrieval: softmax over each row
    per_text = F.cross_entropy(scores.t(), targets)  # image retrieval: softmax over each column
    eye = torch.eye(len(scores), dtype=torch.bool)
    negatives_only = scores.masked_fill(eye, float("-inf"))
    denominators = (torch.logsumexp(negatives_only, 1) + torch.logsumexp(negatives_only, 0)) / 2
    no_positive = denominators - scores.diagonal()
    return [
        (float(per_image), "only the image->text direction (a softmax over each row) is there; "
         "eq. 6 also needs the text->image one (a softmax over each column)"),
        (float(per_text), "only the text->image direction (a softmax over each column) is there; "
         "eq. 6 also needs the image->text one (a softmax over each row)"),
        (float(per_image + per_text),
         "you added the two directions but did not halve the sum (eq. 6: 1/2n)"),
        (float((per_image + per_text) / 2 * len(scores)),
         "you summed over the batch; CMR averages over the n pairs (eq. 6: 1/2n)"),
        (float(no_positive.mean()), "the positive pair is missing from the softmax's denominator; "
         "it runs over all n candidates, the positive included"),
    ]


def check_cmr_loss(fn) -> None:
    """fn(scores (B, B) images x texts, positives on the diagonal) -> LightningDOT's CMR, eq. 6."""
    plain_number = False
    for label, scores in _cmr_cases():
        expected = float(contrastive_loss(scores))
        got = fn(scores.clone().requires_grad_(True))
        value, trainable = scalar_answer(got, label, "average the per-query losses into one scalar",
                                         "scores")
        plain_number |= not trainable
        check_answer(value, expected, label, "expected {expected:.6f}, got {got:.6f}; CMR is "
                     "(cross-entropy of each row against its diagonal + the same for each column) "
                     "/ 2, each averaged over the batch", _cmr_mistakes, scores,
                     tol=1e-5)  # float32 answers pass too
    print("CMR loss: correct (both directions, averaged, batches of 1 to 16)" +
          (f" {NO_GRADIENT_NOTE}" if plain_number else ""))


def _caption_batch(n: int, vocab_size: int, generator, lengths, special=WORD_SPECIAL_TOKENS):
    """(ids, attention_mask, real words) of n captions [CLS] w.. [SEP] [PAD].., lengths (in words)
    uniform in `lengths` inclusive, words uniform over non-special ids."""
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


def _masking_invariants(ids, real, masked, labels, special=WORD_SPECIAL_TOKENS) -> None:
    """What must hold for every call of a BERT masking, whatever its random draws."""
    if tuple(masked.shape) != tuple(ids.shape) or tuple(labels.shape) != tuple(ids.shape):
        raise ExerciseError(f"masked_ids and labels must both have the shape of input_ids "
                            f"{tuple(ids.shape)}, got {tuple(masked.shape)} and "
                            f"{tuple(labels.shape)}")
    picked = labels != IGNORE
    if float(picked.double().mean()) > 0.5:
        raise ExerciseError(f"labels must be IGNORE ({IGNORE}) at every position you did not pick "
                            "(other words, [CLS], [SEP], padding), so that only the masked words "
                            "count in the loss")
    for token, name in ((special.cls, "[CLS]"), (special.sep, "[SEP]"), (special.pad, "[PAD]")):
        spot = ids == token
        if (picked & spot).any() or (masked[spot] != token).any():
            raise ExerciseError(f"{name} was picked or changed; only real words may be masked "
                                "(skip the [CLS], [SEP] and [PAD] ids, and the positions where "
                                "attention_mask is 0)")
    if (labels[picked] != ids[picked]).any():
        raise ExerciseError("at a picked word, labels must hold its original id (what the model "
                            "must predict)")
    if (masked[~picked] != ids[~picked]).any():
        raise ExerciseError("a word you did not pick was changed (its label is IGNORE); only "
                            "picked words may differ from input_ids")
    missed = real.any(1) & ~picked.any(1)
    if missed.any():
        raise ExerciseError(f"{int(missed.sum())} caption(s) have no picked word; pick at least "
                            "one per caption (UNITER: the caption's first real word, when the coin "
                            "flips picked none)")


def check_mask_tokens(fn, vocab_size: int = 120) -> None:
    """fn(input_ids, attention_mask, vocab_size, mask_prob, generator) -> (masked_ids, labels), as
    core.losses.mask_tokens: real words picked with probability mask_prob (at least one per
    caption), 80% -> [MASK], 10% -> a random word, 10% kept; labels IGNORE elsewhere. Any one
    forced pick passes, with a note when it is not UNITER's (the first real word, as [MASK])."""
    special = WORD_SPECIAL_TOKENS

    def run(ids, attention, mask_prob, seed):
        before = ids.clone()
        out = fn(ids, attention, vocab_size, mask_prob, torch.Generator().manual_seed(seed))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ExerciseError("return two tensors: (masked_ids, labels)")
        if not torch.equal(ids, before):
            raise ExerciseError("input_ids was changed in place; clone it first "
                                "(masked = input_ids.clone())")
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
            raise ExerciseError(f"with mask_prob={mask_prob} you picked {100 * rate:.1f}% of the "
                                f"words; expected about {100 * expected:.1f}% (each word with "
                                "probability mask_prob, plus one forced pick where a caption got "
                                "none)")
    ids0, attention0, real0 = _caption_batch(200, vocab_size, generator, (1, 8), special)
    masked0, labels0 = run(ids0, attention0, 0.0, seed=7)  # no coin picks: every pick is forced
    _masking_invariants(ids0, real0, masked0, labels0, special)
    first = real0 & (real0.cumsum(1) == 1)  # (n, T) each caption's first real word
    if not torch.equal(labels0 != IGNORE, first) or (masked0[first] != special.mask).any():
        print("note: where the coin flips picked no word you force one word, but not always the "
              "caption's first, or not always as [MASK]; UNITER's rule (and "
              "course_lib.core.losses.mask_tokens) forces the first real word and makes it [MASK]. "
              "Accepted: either way every caption is in the loss.")
    once, again = run(ids, attention, 0.15, 1), run(ids, attention, 0.15, 1)
    if not all(torch.equal(a, b) for a, b in zip(once, again, strict=True)):  # (masked, labels)
        raise ExerciseError("two calls with generators of the same seed gave different masks; draw "
                            "every random number from `generator` (torch.rand(..., "
                            "generator=generator))")
    picked = labels != IGNORE  # the mask_prob = 0.4 batch: about 10k picked words
    became, original = masked[picked], ids[picked]
    if (torch.isin(became, torch.tensor(special.all)) & (became != special.mask)).any():
        raise ExerciseError(f"some random replacements are special tokens; draw them from the real "
                            f"words, ids {len(special.all)} .. vocab_size - 1")
    shares = {"[MASK]": became == special.mask,
              "a random word": (became != special.mask) & (became != original),
              "kept": became == original}
    shares = {k: float(v.double().mean()) for k, v in shares.items()}
    split = ", ".join(f"{100 * v:.0f}% {k}" for k, v in shares.items())
    if any(abs(share - target) > 0.03 for share, target in zip(shares.values(), (0.8, 0.1, 0.1),
                                                                strict=True)):
        raise ExerciseError(f"of the picked words {split}; BERT's split is 80% [MASK], 10% a "
                            "random word, 10% kept (one uniform draw per picked word decides "
                            "which)")
    print(f"mask_tokens: correct ({100 * rates[0.15]:.1f}% of the words picked at mask_prob 0.15, "
          f"{100 * rates[0.4]:.1f}% at 0.4; {split})")
