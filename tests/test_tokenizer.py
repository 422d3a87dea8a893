"""The word-level tokenizer, saving and loading it, and the pretrained-name path (no network)."""

import pytest

from course_lib.core.tokens import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS, UNK_ID
from course_lib.data.tokenizer import build_word_tokenizer, load_tokenizer, tokenizer_for

CAPTIONS = [
    "a small red circle left of a big blue square",
    "two green triangles above a yellow star",
    "A big blue square",
    "a red circle",
]


@pytest.fixture
def tok():
    return build_word_tokenizer(CAPTIONS, max_length=16)


def test_special_tokens_and_deterministic_vocabulary(tok):
    vocab = tok.get_vocab()
    assert ([vocab[t] for t in SPECIAL_TOKENS] == [PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID]
            == [0, 1, 2, 3, 4])
    assert ((tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
             tok.mask_token_id) == (0, 1, 2, 3, 4))
    counts = {}
    for caption in CAPTIONS:
        for w in caption.lower().split():
            counts[w] = counts.get(w, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))  # frequency, then alphabetical
    assert [vocab[w] for w in words] == list(range(5, 5 + len(words)))
    assert build_word_tokenizer(list(reversed(CAPTIONS))).get_vocab() == vocab  # order-free
    assert tok.model_max_length == 16


def test_min_freq_drops_rare_words():
    vocab = build_word_tokenizer(CAPTIONS, min_freq=2).get_vocab()
    assert {"a", "red", "circle", "big", "blue", "square"} <= set(vocab) and "star" not in vocab


def test_round_trip_and_cls_sep(tok):
    for caption in CAPTIONS:
        ids = tok(caption)["input_ids"]
        assert ids[0] == CLS_ID and ids[-1] == SEP_ID and UNK_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == caption.lower()
    assert (tok.convert_ids_to_tokens(tok("a red circle")["input_ids"])
            == ["[CLS]", "a", "red", "circle", "[SEP]"])


def test_unknown_word_maps_to_unk(tok):
    ids = tok("a purple circle")["input_ids"]
    assert ids[2] == UNK_ID and tok.convert_ids_to_tokens(ids[2]) == "[UNK]"


def test_batch_padding_to_longest_and_truncation(tok):
    enc = tok(["a red circle", "a small red circle left of a big blue square"], padding="longest",
              truncation=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 12)  # 10 words + [CLS] + [SEP]
    assert enc["attention_mask"][0].tolist() == [1] * 5 + [0] * 7
    assert enc["input_ids"][0, 5:].tolist() == [PAD_ID] * 7
    assert "token_type_ids" not in enc
    short = tok(CAPTIONS[0], truncation=True, max_length=6)["input_ids"]
    assert len(short) == 6 and short[-1] == SEP_ID


def test_save_and_load_give_identical_encodings(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    batch = CAPTIONS + ["an unseen word"]
    assert loaded(batch, padding=True)["input_ids"] == tok(batch, padding=True)["input_ids"]
    assert loaded.get_vocab() == tok.get_vocab() and loaded.model_max_length == 16
    assert loaded.mask_token_id == MASK_ID and loaded.pad_token_id == PAD_ID
    assert tokenizer_for(None, name=str(tmp_path / "tok")).get_vocab() == tok.get_vocab()


def test_tokenizer_for_builds_from_split_or_list(tok):
    from course_lib.data.split import RetrievalSplit

    split = RetrievalSplit("s", CAPTIONS, [0, 0, 1, 1], ["x", "y"])
    assert tokenizer_for(split).get_vocab() == tok.get_vocab()
    assert tokenizer_for(CAPTIONS, max_length=8).model_max_length == 8
    with pytest.raises(TypeError):
        tokenizer_for("a red circle")


def test_pretrained_name_goes_to_auto_tokenizer(monkeypatch, tok):
    import transformers

    calls = []

    def fake_from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        return tok

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    assert tokenizer_for(CAPTIONS, name="bert-base-uncased") is tok
    assert calls == [("bert-base-uncased", {"local_files_only": False})]


def test_missing_pretrained_name_offline_gives_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    with pytest.raises(OSError) as info:
        load_tokenizer("no-such-org/no-such-tokenizer")
    message = str(info.value)
    assert "no-such-org/no-such-tokenizer" in message and "HF_HUB_OFFLINE" in message
    assert "internet" in message and "local copy" in message and "build_word_tokenizer" in message


def test_missing_local_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer("./no_tokenizer_here")


def test_round_trip_on_synthetic_captions():
    synthetic = pytest.importorskip("course_lib.data.synthetic")
    bench = synthetic.make_benchmark(synthetic.SyntheticConfig.smoke(), seed=0, progress=False)
    tok = tokenizer_for(bench["train"].captions + bench["pretrain"].captions)
    captions = bench["test"].captions[:200] + bench["pretrain"].captions[:50]
    enc = tok(captions, padding="longest", truncation=True, max_length=40)
    assert all(UNK_ID not in ids for ids in enc["input_ids"])
    assert (tok.batch_decode(enc["input_ids"], skip_special_tokens=True)
            == [c.lower() for c in captions])
    assert len(tok) < 200  # a small closed vocabulary (about 100 words)
    train_only = tokenizer_for(bench["train"])  # test captions share the training vocabulary
    assert all(UNK_ID not in ids for ids in train_only(bench["test"].captions)["input_ids"])
