"""The frozen text encoder's shared states (core.frozen_states) against the BERT run directly."""

import pytest
import torch

from course_lib.core.encoders import BertTextEncoder
from course_lib.core.frozen_states import FrozenStates, weights_fingerprint


def _encoder(seed: int = 0) -> BertTextEncoder:
    torch.manual_seed(seed)
    return BertTextEncoder(40, hidden=16, layers=2, heads=2, max_length=12).freeze().eval()


def _batch(lengths, width=10, seed=1):
    """Right-padded captions of the given lengths (ids 4.., [PAD] = 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, 40, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


class Counting(torch.nn.Module):
    """A BERT that counts the captions it is asked to read."""

    def __init__(self, bert):
        super().__init__()
        self.bert, self.read = bert, 0

    def forward(self, input_ids, attention_mask):
        self.read += len(input_ids)
        return self.bert(input_ids=input_ids, attention_mask=attention_mask)


def test_the_states_are_the_berts_and_each_caption_is_read_once():
    encoder, memo = _encoder(), FrozenStates()
    counting = Counting(encoder.bert)
    ids, mask = _batch([3, 7, 5, 10])
    with torch.no_grad():
        direct = encoder.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        first = memo(counting, ids, mask)
        # the same captions in another order and batch, with one new one
        more_ids, more_mask = _batch([3, 7, 5, 10, 4], seed=1)
        again = memo(counting, more_ids[[3, 0, 4]], more_mask[[3, 0, 4]])
    assert counting.read == 5  # four, then only the new one
    real = mask.bool().unsqueeze(-1)
    torch.testing.assert_close(first, direct.masked_fill(~real, 0.0), atol=1e-5, rtol=1e-5)
    assert torch.equal(again[0], first[3]) and torch.equal(again[1], first[0])
    new = encoder.bert(input_ids=more_ids[4:, :4], attention_mask=more_mask[4:, :4])
    torch.testing.assert_close(again[2, :4], new.last_hidden_state[0], atol=1e-5, rtol=1e-5)
    assert not again[2, 4:].any()  # zero at padding


def test_a_frozen_encoder_without_gradients_reads_the_shared_states(monkeypatch):
    import course_lib.core.encoders as encoders

    memo = FrozenStates()
    monkeypatch.setattr(encoders, "FROZEN_STATES", memo)
    ids, mask = _batch([4, 6])
    frozen, trainable = _encoder(), BertTextEncoder(40, hidden=16, layers=2, heads=2,
                                                    max_length=12).freeze(1).eval()
    with torch.no_grad():
        frozen({"input_ids": ids, "attention_mask": mask})
        assert len(memo.kept) == 2
        trainable({"input_ids": ids, "attention_mask": mask})  # its last block learns: not shared
        assert len(memo.kept) == 2
    frozen({"input_ids": ids, "attention_mask": mask})  # with gradients too: nothing new
    assert len(memo.kept) == 2


def test_training_through_a_frozen_encoder_reads_each_caption_once_and_still_learns(monkeypatch):
    """In training (gradients on) the frozen BERT's states come from the memo: a caption seen in
    an earlier batch is not read again, and the layer above the states still gets its gradient."""
    import course_lib.core.encoders as encoders

    memo = FrozenStates()
    monkeypatch.setattr(encoders, "FROZEN_STATES", memo)
    encoder, head = _encoder().train(), torch.nn.Linear(16, 1)
    reads = []
    encoder.bert.register_forward_hook(lambda *_: reads.append(1))
    ids, mask = _batch([4, 6, 3])
    direct = encoder.bert(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
    assert len(reads) == 1
    for _ in range(3):  # three steps over the same captions: one read, in the first
        tokens = encoder({"input_ids": ids, "attention_mask": mask}).tokens  # (B, T, H)
        head(tokens).sum().backward()
    assert len(reads) == 2 and not tokens.requires_grad
    torch.testing.assert_close(tokens, direct.masked_fill(~mask.bool().unsqueeze(-1), 0.0),
                               atol=1e-5, rtol=1e-5)
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


def test_other_or_changed_weights_are_other_states():
    a, b = _encoder(0), _encoder(1)
    assert weights_fingerprint(a.bert) != weights_fingerprint(b.bert)
    assert weights_fingerprint(a.bert) == weights_fingerprint(_encoder(0).bert)
    before = weights_fingerprint(a.bert)
    with torch.no_grad():
        a.bert.embeddings.word_embeddings.weight[5] += 1.0  # changed in place
    assert weights_fingerprint(a.bert) != before
    a.load_state_dict(_encoder(0).state_dict())  # back to the first weights
    assert weights_fingerprint(a.bert) == before


def test_the_states_kept_stay_under_their_bytes_dropping_the_least_recently_used():
    encoder = _encoder()
    one_caption = 5 * 16 * 4  # a 5-token caption's (5, 16) float32 states
    memo = FrozenStates(max_bytes=2 * one_caption)
    ids, mask = _batch([5, 5, 5])
    with torch.no_grad():
        memo(encoder.bert, ids[:2], mask[:2])
        memo(encoder.bert, ids[:1], mask[:1])  # the first caption used last
        memo(encoder.bert, ids[2:], mask[2:])
    assert memo.bytes == 2 * one_caption
    kept = {key[1] for key in memo.kept}
    assert kept == {tuple(ids[0, :5].tolist()), tuple(ids[2, :5].tolist())}


def test_left_padding_is_refused():
    ids, mask = _batch([3])
    with pytest.raises(ValueError, match="right-padded"):
        FrozenStates()(_encoder().bert, ids, mask.flip(1))


def test_a_timed_query_reads_its_caption_every_call_as_a_new_one_would():
    """The clock pauses the memo: a repeated caption must not be timed as a free lookup."""
    from course_lib.core.frozen_states import FROZEN_STATES
    from course_lib.core.timing import measure, profile_stages

    encoder = _encoder()
    reads = []
    encoder.bert.register_forward_hook(lambda *_: reads.append(1))
    ids, mask = _batch([6])
    batch = {"input_ids": ids, "attention_mask": mask}
    FROZEN_STATES.clear()
    try:
        with torch.no_grad():
            encoder(batch)  # the caption is now kept
            assert len(reads) == 1
            encoder(batch)
            assert len(reads) == 1  # outside a clock: looked up
            measure(lambda: encoder(batch), warmup=2, repeats=5)
            assert len(reads) == 1 + 2 + 5
            profile_stages([("encode", lambda _: encoder(batch))], warmup=1, repeats=3)
            assert len(reads) == 8 + 2 * (1 + 3)  # the stage and the whole query, each call
            encoder(batch)
            assert len(reads) == 16  # the memo is back after the clock
    finally:
        FROZEN_STATES.clear()
