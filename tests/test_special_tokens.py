"""Special tokens come from the tokenizer, never from the word tokenizer's literal ids 0-4.

Two offline BERT WordPiece tokenizers over the synthetic captions' words (vocab files written here):
"bert" has BERT's ids ([PAD]=0, [unused0..98]=1..99, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103,
then the words), "specials_last" puts the words first and the five special tokens at the end (so
[PAD] is not 0 either). VMLM masking, SCAN's words-only text path, the encoders' word_mask and every
embedding's padding_idx must use that tokenizer's ids.

The rule for random replacement words is `tokenizer.all_special_ids` ([PAD] [UNK] [CLS] [SEP]
[MASK]): BERT's [unusedN] ids are not special to the tokenizer, so they may be drawn, as in BERT.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.core.encoders import word_mask
from course_lib.core.losses import IGNORE, mask_tokens
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.data.captions import caption_vocabulary
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.lightningdot.method import build_lightningdot
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.methods.scan.model import SCANConfig, build_scan, words_only
from course_lib.methods.vsepp import VsePPConfig, build_dual_encoder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread
# the `bench` fixture
BENCH_SIZES = dict(n_train=40, n_val=4, n_test=4, n_pretrain=4, n_compositional=1)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = caption_vocabulary()  # every word a synthetic caption can hold


def _bert_tokenizer(folder, layout: str):
    from transformers import BertTokenizerFast

    if layout == "bert":
        lines = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + SPECIALS[1:] + WORDS
    else:
        lines = WORDS + SPECIALS
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n")
    # from the folder: transformers 5 ignores
    # BertTokenizerFast(vocab_file=...) (5 special tokens only)
    return BertTokenizerFast.from_pretrained(str(folder), local_files_only=True, do_lower_case=True,
                                             model_max_length=40)


@pytest.fixture(scope="module", params=["bert", "specials_last"])
def bert_tok(request, tmp_path_factory):
    tok = _bert_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    if request.param == "bert":
        assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
                tok.mask_token_id] == [0, 100, 101, 102, 103]
    else:
        assert tok.pad_token_id == len(WORDS) and tok.mask_token_id == len(WORDS) + 4
    return tok


def _captions(n: int, seed: int = 0) -> list[str]:
    """n random captions of 1-12 caption words; every 7th holds an unknown word ([UNK])."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=g).tolist()
    picks = torch.randint(len(WORDS), (sum(lengths),), generator=g).tolist()
    captions, start = [], 0
    for i, n_words in enumerate(lengths):
        words = [WORDS[p] for p in picks[start:start + n_words]]
        start += n_words
        captions.append(" ".join(words + (["zebra"] if i % 7 == 0 else [])))
    return captions


def _check_masking(tok, ids, attention, masked, labels, *, bulk: bool):
    """The VMLM masking rules with tok's ids; bulk: enough picks for the 80/10/10 proportions."""
    specials = torch.tensor(tok.all_special_ids)
    special = torch.isin(ids, specials)  # (B, T) [CLS] [SEP] [PAD] [UNK] ...
    picked = labels != IGNORE
    assert picked.any()
    assert not (picked & special).any(), "a special token ([CLS], [SEP], [PAD], [UNK]) was masked"
    assert not (picked & ~attention.bool()).any()
    assert torch.equal(masked[special], ids[special]), "special tokens stay as they are"
    assert torch.equal(labels[picked], ids[picked]) and torch.equal(masked[~picked], ids[~picked])
    became = masked[picked]
    to_mask = became == tok.mask_token_id
    swapped = ~to_mask & (became != ids[picked])
    assert not torch.isin(became[swapped], specials).any(), "a random word was a special token"
    assert (became < len(tok)).all()
    if bulk:
        rate = to_mask.double().mean().item()
        assert abs(rate - 0.8) < 0.03, "80% must become the real [MASK] id"
        assert abs(swapped.double().mean().item() - 0.1) < 0.03


def test_special_tokens_of_reads_the_tokenizer(bert_tok):
    special = SpecialTokens.of(bert_tok)
    assert (special.pad, special.cls, special.sep, special.mask) == (
        bert_tok.pad_token_id, bert_tok.cls_token_id, bert_tok.sep_token_id, bert_tok.mask_token_id)
    assert special.all == tuple(sorted(bert_tok.all_special_ids)) and len(special.all) == 5
    word_tok = build_word_tokenizer(["a red circle"])
    assert SpecialTokens.of(word_tok) == WORD_SPECIAL_TOKENS
    assert WORD_SPECIAL_TOKENS.all == (0, 1, 2, 3, 4)


def test_mask_tokens_uses_the_tokenizers_ids(bert_tok):
    enc = bert_tok(_captions(3000), padding="longest", return_tensors="pt")
    ids, attention = enc["input_ids"], enc["attention_mask"]  # (B, T)
    assert (ids == bert_tok.unk_token_id).any()  # the unknown word is there, to be left alone
    masked, labels = mask_tokens(ids, attention, len(bert_tok), 0.4,
                                 generator=torch.Generator().manual_seed(0),
                                 special=SpecialTokens.of(bert_tok))
    _check_masking(bert_tok, ids, attention, masked, labels, bulk=True)
    # random words: every non-special id can come out ([unusedN] too: they are not special ids)
    became = masked[(labels != IGNORE) & (masked != bert_tok.mask_token_id)]
    assert len(set(became.tolist())) > 0.5 * (len(bert_tok) - 5)


def test_mask_tokens_forces_the_first_real_word(bert_tok):
    # UNITER's rule: with no word drawn, the first token that is not special becomes [MASK]; a
    # leading unknown word ([UNK], special to the tokenizer) is skipped
    w1, w2 = WORDS[0], WORDS[1]
    enc = bert_tok([f"{w1} {w2}", f"zebra {w2} {w1}", w2], padding="longest", return_tensors="pt")
    ids, attention = enc["input_ids"], enc["attention_mask"]  # (3, T)
    assert ids[1, 1] == bert_tok.unk_token_id
    masked, labels = mask_tokens(ids, attention, len(bert_tok), 0.0,
                                 generator=torch.Generator().manual_seed(0),
                                 special=SpecialTokens.of(bert_tok))
    picked = labels != IGNORE
    assert [torch.nonzero(row).flatten().tolist() for row in picked] == [[1], [2], [1]]
    assert (masked[picked] == bert_tok.mask_token_id).all()
    assert torch.equal(labels[picked], ids[picked]) and torch.equal(masked[~picked], ids[~picked])


def test_lightningdot_vmlm_masks_with_the_tokenizers_ids(bench, bert_tok, monkeypatch):
    import course_lib.methods.lightningdot.model as ld

    calls, real_mask_tokens = [], ld.mask_tokens

    def spy(*args, **kwargs):  # records what VMLM's masking produced, whatever its signature
        out = real_mask_tokens(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(ld, "mask_tokens", spy)
    torch.manual_seed(0)
    config = LightningDOTConfig(hidden=16, layers=1, heads=2)
    model = build_lightningdot(config, bench["train"], bert_tok)  # the path the method trains
    assert model.text_encoder.word.padding_idx == bert_tok.pad_token_id
    batch = PairCollate(bert_tok)([PairDataset(bench["train"])[t] for t in range(64)])
    # the vocabulary covers the captions
    assert not (batch["input_ids"] == bert_tok.unk_token_id).any()
    for _ in range(4):
        assert torch.isfinite(model.objective("vmlm", batch))
    masked = torch.cat([m for m, _ in calls])
    labels = torch.cat([label for _, label in calls])
    ids, attention = batch["input_ids"].repeat(4, 1), batch["attention_mask"].repeat(4, 1)
    _check_masking(bert_tok, ids, attention, masked, labels, bulk=False)
    assert (masked == bert_tok.mask_token_id).any()


def _words(tok, captions) -> list[list[int]]:
    return [tok(c, add_special_tokens=False)["input_ids"] for c in captions]


def test_scan_reads_words_only_with_the_tokenizers_ids(bench, bert_tok):
    captions = bench["train"].captions[:8]
    enc = bert_tok(captions, padding="longest", return_tensors="pt")
    special = SpecialTokens.of(bert_tok)
    ids, mask = words_only(enc["input_ids"], enc["attention_mask"], special)  # (B, L)
    words = _words(bert_tok, captions)
    assert [row[m].tolist() for row, m in zip(ids, mask, strict=True)] == words
    assert (ids[~mask] == bert_tok.pad_token_id).all()
    torch.manual_seed(0)
    # as train_scan builds it
    model = build_scan(SCANConfig.smoke(), bench["train"], bert_tok).eval()
    assert model.text_encoder.embed.padding_idx == bert_tok.pad_token_id
    _, word_mask_ = model.encode_texts(dict(enc))
    assert word_mask_.sum(1).tolist() == [len(w) for w in words]


@pytest.mark.parametrize("text_encoder", ["bow", "gru", "bert"])
def test_encoders_word_mask_and_padding_use_the_tokenizers_ids(bench, bert_tok, text_encoder):
    captions = bench["train"].captions[:6]
    enc = bert_tok(captions, padding="longest", return_tensors="pt")
    keep = word_mask(enc["input_ids"], enc["attention_mask"], SpecialTokens.of(bert_tok))  # (B, T)
    assert ([row[k].tolist() for row, k in zip(enc["input_ids"], keep, strict=True)]
            == _words(bert_tok, captions))
    torch.manual_seed(0)
    model = build_dual_encoder(VsePPConfig(text_encoder=text_encoder, hidden=16,
                                           embed_dim=16, layers=1),
                               bench["train"], bert_tok).eval()
    encoder = model.text_encoder
    if text_encoder == "bert":
        assert encoder.bert.config.pad_token_id == bert_tok.pad_token_id
        assert encoder.bert.embeddings.word_embeddings.padding_idx == bert_tok.pad_token_id
        return
    assert encoder.embed.padding_idx == bert_tok.pad_token_id
    assert torch.all(encoder.embed.weight[bert_tok.pad_token_id] == 0)
    # pooled = mean over the words: [CLS] / [SEP] embeddings change nothing
    if text_encoder == "bow":
        with torch.no_grad():
            before = encoder(dict(enc)).pooled
            encoder.embed.weight[[bert_tok.cls_token_id, bert_tok.sep_token_id]] += 5.0
            torch.testing.assert_close(encoder(dict(enc)).pooled, before)
