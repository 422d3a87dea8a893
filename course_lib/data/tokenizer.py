"""Tokenizers: a word-level one trained on the captions (the offline default) or a pretrained
Hugging Face one by name, both `transformers` fast tokenizers with BERT's special tokens."""

import os
from pathlib import Path

from course_lib.core.settings import from_hub
from course_lib.core.tokens import CLS_ID, SEP_ID, SPECIAL_TOKENS


def build_word_tokenizer(captions, *, min_freq: int = 1, max_length: int = 40):
    """A word-level tokenizer of the words of `captions` seen >= min_freq times, lower-cased.
    Ids: the special tokens (0-4), then words by frequency, so the same captions give the same ids;
    every text is wrapped as [CLS] words [SEP]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=min_freq,
                                        vocab_size=10**7, show_progress=False)
    tok.train_from_iterator(list(captions), trainer=trainer)
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("tokenizers did not put the special tokens at ids 0-4")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length, padding_side="right",
        model_input_names=["input_ids", "attention_mask"])  # no token_type_ids: one text per input


def load_tokenizer(name_or_path: str | os.PathLike):
    """A tokenizer saved with `save_pretrained` (a directory), or a Hugging Face name (network)."""
    from transformers import AutoTokenizer

    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if text.startswith((".", "/", "~")) or Path(text).is_absolute() or path.suffix == ".json":
        raise FileNotFoundError(
            f"tokenizer directory {path} not found: save one with tok.save_pretrained({text!r}), "
            "or use build_word_tokenizer(captions) / tokenizer_for(split) for the word-level "
            "tokenizer")
    return from_hub(
        lambda **kw: AutoTokenizer.from_pretrained(text, **kw),
        f"the pretrained tokenizer {text!r}",
        "Offline, use the word-level tokenizer built from the captions: tokenizer_for(split) "
        "(name=None) or build_word_tokenizer(split.captions).")


def tokenizer_for(split_or_captions, name: str | None = None, **kwargs):
    """The word-level tokenizer of a split's (or a list's) captions, or `name` loaded instead."""
    if name is not None:
        return load_tokenizer(name)
    captions = getattr(split_or_captions, "captions", split_or_captions)
    if isinstance(captions, str):
        raise TypeError("tokenizer_for needs a RetrievalSplit or a list of captions, not a string")
    return build_word_tokenizer(captions, **kwargs)
