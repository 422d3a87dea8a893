"""Checkers of lesson 06: the Slow model's score h(x, y) from the two decoders' logits (Fast & Slow
eq. 2-3), and one caption scored against a gallery's cached keys / values (the timed exercise)."""

import torch

from course_lib.methods.fast_slow import model as fast_slow

from .errors import ExerciseError, check_answer, float64


def _cases(seed: int = 0):
    """(label, forward_logits, backward_logits (B, T, V) float64, input_ids, reversed_ids,
    attention_mask (B, T)): captions [CLS] words [SEP] [PAD].. of the word tokenizer's ids."""
    generator = torch.Generator().manual_seed(seed)

    def case(lengths, V=12):
        T = max(lengths) + 2
        ids = torch.zeros(len(lengths), T, dtype=torch.long)  # [PAD] = 0
        for b, n in enumerate(lengths):
            ids[b, 0], ids[b, n + 1] = 2, 3  # [CLS], [SEP]
            ids[b, 1:n + 1] = torch.randint(5, V, (n,), generator=generator)  # words: ids >= 5
        mask = (ids != 0).long()
        logits = [3 * torch.randn(len(lengths), T, V, generator=generator, dtype=torch.float64)
                  for _ in range(2)]  # forward, backward: (B, T, V) each
        return logits[0], logits[1], ids, fast_slow.reverse_words(ids, mask), mask

    yield "3 captions of 4, 6 and 2 words (padded)", case([4, 6, 2])
    yield "2 captions of 5 words (no padding)", case([5, 5])
    yield "4 captions of 1 to 7 words", case([1, 7, 3, 6])


def _mistakes(forward_logits, backward_logits, input_ids, reversed_ids, attention_mask) -> list:
    """(h (B,), what to tell the learner) of the usual wrong versions."""
    words = ((input_ids > 4) & attention_mask.bool()).double()  # (B, T) word positions (ids >= 5)
    n_words = words.sum(1)

    def direction(logits, ids, mask, shift=True):
        log_p = torch.log_softmax(logits, dim=-1)
        if shift:
            return (log_p[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2) * mask[:, 1:]).sum(1)
        return (log_p.gather(2, ids[:, :, None]).squeeze(2) * mask).sum(1)

    def both(mask, shift=True):
        return (direction(forward_logits, input_ids, mask, shift)
                + direction(backward_logits, reversed_ids, mask, shift))

    right = both(words)
    fwd = direction(forward_logits, input_ids, words)
    bwd = direction(backward_logits, reversed_ids, words)
    per_word = "length-normalised: h is the plain sum of log-probabilities (eq. 3), "
    return [
        (-right, "the sign is flipped: h is a log-likelihood (<= 0), not a loss"),
        (both(words, shift=False), "the targets are not shifted: the logits at position t predict "
                                   "token t + 1, so compare logits[:, :-1] with ids[:, 1:]"),
        (both(torch.ones_like(words)), "padding (and [CLS] / [SEP]) counted: sum only over "
                                       "targets that are words, not [SEP] and not [PAD]"),
        (both(attention_mask.double()), "[SEP] counted as a target: eq. 3 sums the caption's words "
                                        "y^1..y^L; leave out [SEP] (and padding)"),
        (right / n_words.clamp(min=1), per_word + "do not divide by the number of words"),
        (right / (2 * n_words.clamp(min=1)), per_word + "not a mean per word"),
        (fwd, "only the forward direction: h = h_fwd + h_bwd (eq. 2), add the backward decoder's "
              "log-likelihood of the reversed caption"),
        (bwd, "only the backward direction: add h_fwd, the forward decoder's log-likelihood of "
              "the caption"),
        (fwd + direction(backward_logits, input_ids, words),
         "the backward decoder's targets are the reversed caption (reversed_ids), not input_ids"),
    ]


def check_summed_log_likelihood(fn) -> None:
    """fn(forward_logits, backward_logits, input_ids, reversed_ids, attention_mask) -> h (B,),
    logits (B, T, V) at position t predicting token t + 1, as model.summed_log_likelihood."""
    for label, (forward, backward, ids, reversed_ids, mask) in _cases():
        B = ids.shape[0]
        expected = fast_slow.summed_log_likelihood(forward, backward, ids, reversed_ids,
                                                   mask).double()
        got = float64(fn(forward.clone(), backward.clone(), ids.clone(), reversed_ids.clone(),
                         mask.clone()))
        if got.numel() == 1 and B > 1:
            raise ExerciseError(f"on {label}: you returned one number; return one h per caption, "
                                f"shape ({B},): sum over the positions (dim 1), not over the batch")
        if tuple(got.shape) != (B,):
            raise ExerciseError(f"on {label}: expected shape ({B},), one h per caption, got "
                                f"{tuple(got.shape)}")
        check_answer(got, expected, label, "h differs from eq. 2-3 by up to {worst:.3g}: per "
                     "direction, sum log_softmax of the logits at position t taken at token t + 1, "
                     "over the word targets only", _mistakes, forward, backward, ids, reversed_ids,
                     mask)
    print("summed log-likelihood (eq. 2-3): correct (padded and unpadded captions of 1 to 7 "
          "words, both directions)")


def check_score_one_caption(fn) -> None:
    """fn(model, kvs, text) -> h (N,): one caption (1, T) against the N images whose cached keys /
    values are kvs ({"fwd", "bwd"}: per block (2, N, heads, M, d)), as log_likelihood per pair."""
    torch.manual_seed(0)  # a tiny SlowModel, 6 images' keys / values, a caption (1, T)
    config = fast_slow.SlowConfig(hidden=16, heads=2, layers=2, channels=(4, 8, 8), dropout=0.0)
    model = fast_slow.SlowModel(12, config).eval()
    with torch.no_grad():
        kvs = model.keys_values(model.visual_tokens({"pixels": torch.rand(6, 3, 32, 32)}))
        text = {"input_ids": torch.tensor([[2, 7, 5, 9, 11, 6, 3]]),
                "attention_mask": torch.ones(1, 7, dtype=torch.long)}
        expected = torch.stack([  # (6,) image i's keys / values alone
            model.log_likelihood({d: [kv[:, i:i + 1] for kv in layers]
                                  for d, layers in kvs.items()}, text)[0] for i in range(6)])
        got = fn(model, kvs, {k: v.clone() for k, v in text.items()})
    if not torch.is_tensor(got):
        raise ExerciseError(f"return a ({len(expected)},) tensor, got {type(got).__name__}")
    got = got.detach().float().cpu()
    if got.numel() == 1:
        raise ExerciseError(f"you returned one number; return h of the caption with EACH of the "
                            f"{len(expected)} images: repeat the caption's (1, T) rows N times "
                            "(expand) so pair i reads image i's keys / values")
    if tuple(got.shape) != tuple(expected.shape):
        raise ExerciseError(f"expected shape {tuple(expected.shape)}, one h per gallery image, "
                            f"got {tuple(got.shape)}")
    if torch.allclose(got, -expected, atol=1e-4):
        raise ExerciseError("the sign is flipped: h is a log-likelihood (<= 0), the higher the "
                            "better")
    if not torch.allclose(got, expected, atol=1e-4):
        worst = (got - expected).abs().max().item()
        raise ExerciseError(f"h differs from single-pair model.log_likelihood by up to "
                            f"{worst:.3g}: pass the cached kvs as they are and the caption "
                            "repeated N times to model.log_likelihood")
    print(f"one caption against {len(expected)} cached images: correct (matches {len(expected)} "
          "single-pair scores)")
