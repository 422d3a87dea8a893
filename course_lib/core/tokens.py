"""Special token ids, as one tokenizer assigns them: the word-level tokenizer has [PAD]=0 [UNK]=1
[CLS]=2 [SEP]=3 [MASK]=4, a pretrained BERT [PAD]=0 [UNK]=100 [CLS]=101 [SEP]=102 [MASK]=103. So
models never assume the ids: whatever builds one reads them with `SpecialTokens.of(tokenizer)`.
In core, below the data layer, because the encoders and losses need them."""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # list position = word tokenizer id
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))  # the word tokenizer's only


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a model treats specially (mask None if the tokenizer has none; all sorted)."""

    pad: int
    cls: int
    sep: int
    mask: int | None
    all: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> SpecialTokens:
        """Read the ids from a transformers tokenizer (word-level or pretrained)."""
        ids = {name: getattr(tokenizer, f"{name}_token_id", None)
               for name in ("pad", "cls", "sep", "mask")}
        missing = [f"{name}_token" for name in ("pad", "cls", "sep") if ids[name] is None]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)}: the text encoders need "
                             "[PAD], [CLS], [SEP] (a BERT-style tokenizer or build_word_tokenizer)")
        every = set(tokenizer.all_special_ids) | {i for i in ids.values() if i is not None}
        return cls(**ids, all=tuple(sorted(every)))

    def word_ids(self, vocab_size: int, device=None):
        """(vocab_size - specials below it,) int64: the non-special ids, ascending."""
        import torch
        allowed = torch.ones(vocab_size, dtype=torch.bool, device=device)  # (V,)
        special = torch.tensor([i for i in self.all if i < vocab_size], dtype=torch.long,
                               device=device)
        allowed[special] = False
        return allowed.nonzero().squeeze(1)


# the word-level tokenizer's ids (build_word_tokenizer checks they are what it gets)
WORD_SPECIAL_TOKENS = SpecialTokens(pad=PAD_ID, cls=CLS_ID, sep=SEP_ID, mask=MASK_ID,
                                    all=tuple(range(len(SPECIAL_TOKENS))))
