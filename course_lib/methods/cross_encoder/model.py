"""The single-stream cross-encoder (UNITER-style): one transformer reads a caption and an image
together and outputs one matching score (U-BERT §3, eq. 2-5). The course's accurate but slow
re-ranker: O(n_images * n_texts) forward passes against a dual encoder's O(n_images + n_texts).

    text  [CLS] w1 .. wT [SEP]  ->  word + position + type(0) embeddings, LayerNorm
                                    + LN(Linear(SCAN's encoding of each word))       (towers="scan")
    image r1 .. rR              ->  LN(Linear(feature)) + LN(Linear(box)) + type(1), LayerNorm
                                    + LN(Linear(SCAN's encoding of each region))     (towers="scan")
    [text ; image]              ->  one pre-LN `blocks.Transformer`, one padding mask
    [CLS] output                ->  Linear  ->  one matching logit per pair

Towers: UNITER starts from BERT and a detector, ALBEF from aligned unimodal encoders; ours from
scratch mostly stalled on one matching bit per pair (docs/tuning_notes.md, "Four trainings of the
default config"). So by default each token also carries the trained SCAN encoders' view of it,
frozen as in LiT (fine-tuning them undid SCAN's alignment). Training: method.py and itm.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from course_lib.core.blocks import JointEmbedding, Transformer, masked_mean
from course_lib.core.checkpoints import inference
from course_lib.core.settings import CourseConfig
from course_lib.core.train import move_to_device
from course_lib.data.datasets import IMAGE_KEYS, image_batch, image_fields, text_fields
from course_lib.methods.queries import by_caption_length, checked_pairs

TEXT_KEYS = ("input_ids", "attention_mask")  # the text fields the model reads
# pairs per forward pass, cache-sized on a CPU (docs/tuning_notes.md, "Cross-encoder"); GPU: 4096+
BLOCK_PAIRS = 256


@dataclass
class CrossEncoderConfig(CourseConfig):
    # Defaults chosen in docs/tuning_notes.md, "Cross-encoder".
    hidden: int = 64  # width of every token (text and region) in the transformer
    layers: int = 3  # transformer blocks over the joint sequence (U-BERT's L)
    heads: int = 4  # attention heads per block
    dropout: float = 0.0  # in embeddings and blocks (BERT: 0.1); fresh negatives barely overfit
    towers: str = "scan"  # "scan": + frozen SCAN's encoding of each token; "none": from scratch
    loss: str = "listwise"  # softmax CE over the batch grid both ways (itm.py) or "binary" BCE
    itc_weight: float = 0.0  # listwise: weight of ALBEF's ITC loss, which then picks the grid
    grid_size: int = 16  # with ITC: captions in the scored grid (16 x their images = 256 pairs)
    grid_clusters: int = 2  # with ITC: look-alike groups in the grid (2 of 8)
    max_text_length: int = 40  # tokens per caption incl. [CLS] and [SEP]; longer ones are cut
    # the rest are for loss="binary" (mined negatives need it: the listwise grid has no miner)
    negatives_per_positive: int = 1  # negative captions per image, images per caption (ALBEF: 1)
    hard_negative_fraction: float = 0.0  # chance a negative is from the miner's top-k, else random
    hard_negative_k: int = 16  # a hard negative is drawn from the dual encoder's top-k non-matches
    hard_negative_after: float = 0.0  # share of max_steps before hard negatives start
    online_candidates: int = 1  # negatives drawn per slot, trained on the top-scored (1 = off)
    balance_classes: bool = True  # weigh a positive as its 2n negatives (else: "always no" first)
    batch_size: int = 16  # captions a step (listwise: a 16 x 16 grid; binary, use 64: B(1 + 2n))
    lr: float = 2e-3  # peak AdamW learning rate (a small model from scratch tolerates a large one)
    max_steps: int = 3000  # optimizer steps (listwise: a few CPU minutes)
    warmup_fraction: float = 0.1  # share of max_steps with a linear warm-up
    grad_clip: float = 2.0  # max global gradient norm
    seed: int = 0  # model initialisation, data order and negative sampling

    SMOKE: ClassVar[dict] = dict(hidden=32, layers=2, batch_size=12, max_steps=60)
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 300}  # chosen on Flickr8k's val


class CrossEncoder(JointEmbedding):
    """Caption and regions in one transformer: forward(images, texts) -> logits (B,) for B pairs.
    towers: a trained `SCANModel`, kept as a frozen copy; itc_weight > 0 adds ALBEF's ITC heads."""

    def __init__(self, region_dim: int, vocab_size: int, config: CrossEncoderConfig | None = None,
                 box_dim: int = 7, pad_token_id: int = 0, towers: nn.Module | None = None):
        cfg = config or CrossEncoderConfig()
        H = cfg.hidden
        super().__init__(region_dim, vocab_size, H, cfg.max_text_length, box_dim, pad_token_id)
        self.config = cfg
        if cfg.towers not in ("scan", "none"):
            raise ValueError(f"towers={cfg.towers!r}: 'scan' (SCAN's trained encoders) or 'none' "
                             "(from scratch)")
        if (cfg.towers == "scan") != (towers is not None):
            raise ValueError("config.towers='scan' needs the trained SCAN model, CrossEncoder(..., "
                             "towers=scan_model) (CrossEncoderMethod passes its SCAN method's); "
                             "config.towers='none' takes none")
        self.towers = copy.deepcopy(towers)  # freezing its own copy leaves the caller's SCAN as is
        if towers is not None:
            self.towers.requires_grad_(False).eval()  # frozen: SCAN's alignment is what it brings
            E = towers.config.embed_dim
            self.word_from_towers = nn.Sequential(nn.Linear(E, H), nn.LayerNorm(H))
            self.region_from_towers = nn.Sequential(nn.Linear(E, H), nn.LayerNorm(H))
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = Transformer(H, cfg.layers, cfg.heads, cfg.dropout)  # ends in a LayerNorm
        self.head = nn.Linear(H, 1)  # s(T, I) = FC([CLS] output), U-BERT eq. 5
        if cfg.itc_weight > 0:  # ALBEF's contrastive heads on the unimodal features (`unimodal`)
            self.itc_image, self.itc_text = nn.Linear(H, H), nn.Linear(H, H)
            self.itc_log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # ALBEF's
        self._init_tables()

    def train(self, mode: bool = True) -> CrossEncoder:
        super().train(mode)
        if self.towers is not None:
            self.towers.eval()  # frozen towers score as they were trained, in training too
        return self

    def embed_text(self, texts: dict) -> torch.Tensor:
        """JointEmbedding's (B, T, H), plus at each word SCAN's encoding of it (towers="scan")."""
        x = super().embed_text(texts)  # (B, T, H)
        if self.towers is None:
            return x
        tower, is_word = self.towers.encode_words_in_place(texts)  # (B, T, E), (B, T)
        return x + self.word_from_towers(tower.to(x.dtype)) * is_word.unsqueeze(-1)

    def embed_image(self, images: dict) -> torch.Tensor:
        """JointEmbedding's (B, R, H), plus SCAN's encoding of each region (towers="scan")."""
        x = super().embed_image(images)  # (B, R, H)
        if self.towers is None:
            return x
        regions, real = self.towers.encode_images(images)  # (B, R, E), (B, R)
        return x + self.region_from_towers(regions.to(x.dtype)) * real.unsqueeze(-1)

    def forward(self, images: dict, texts: dict) -> torch.Tensor:
        return self.fuse(self.embed_text(texts), texts["attention_mask"], self.embed_image(images),
                         images["region_mask"])  # (B,)

    def fuse(self, text: torch.Tensor, text_mask: torch.Tensor, image: torch.Tensor,
             region_mask: torch.Tensor) -> torch.Tensor:
        """Captions (B, T, H) and images (B, R, H), embedded -> logits (B,): the per-pair part."""
        x = torch.cat([text, image], dim=1)  # (B, T + R, H)
        mask = torch.cat([text_mask.bool(), region_mask.bool()], dim=1)  # (B, T + R), True = real
        return self.head(self.transformer(self.dropout(x), mask)[:, 0]).squeeze(-1)  # (B,)

    def unimodal(self, images: dict, texts: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """ALBEF's unimodal features for ITC: image (N, H), text (B, H), L2-normalised."""
        image = self.itc_image(masked_mean(self.embed_image(images), images["region_mask"]))
        text = self.itc_text(masked_mean(self.embed_text(texts), texts["attention_mask"]))
        return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


# ----------------------------------------------------------------------------- scoring
def _embed(embed, fields: dict, keys, device, batch_size: int) -> torch.Tensor:
    """embed every row of fields, block by block -> (n, L, H) on the CPU."""
    n, chosen = len(fields[keys[0]]), {k: fields[k] for k in keys}
    blocks = [embed(move_to_device(image_batch(chosen, slice(start, start + batch_size)), device))
              .float().cpu() for start in range(0, n, batch_size)]
    return torch.cat(blocks) if blocks else torch.zeros(0, 0, 0)


class Embedded:
    """A split's images and captions through `embed_image` / `embed_text` in eval mode: every image
    once, a caption the first time it is scored, so a query pays only for `fuse`.

        images(rows (n,))      -> tokens (n, R, H), region_mask (n, R)
        captions(indices (m,)) -> tokens (m, T, H), attention_mask (m, T), T = their longest
    """

    def __init__(self, model: CrossEncoder, split, tokenizer, *, device=None,
                 batch_size: int = BLOCK_PAIRS):
        self.model, self.split, self.tokenizer = model, split, tokenizer
        self.batch_size, fields = batch_size, image_fields(split)
        with inference(model, device) as device:  # (N, R, H)
            self.image_tokens = _embed(model.embed_image, fields, IMAGE_KEYS, device, batch_size)
        self.region_mask = fields["region_mask"]  # (N, R)
        self.caption_tokens: dict[int, torch.Tensor] = {}  # caption index -> (T_c, H), real tokens

    def images(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image_tokens[rows], self.region_mask[rows]

    def captions(self, indices, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = [int(t) for t in indices]
        new = [t for t in dict.fromkeys(wanted) if t not in self.caption_tokens]
        if new:
            texts = text_fields([self.split.captions[t] for t in new], self.tokenizer,
                                self.model.config.max_text_length)  # (n, T)
            with inference(self.model, device) as device:  # (n, T, H)
                tokens = _embed(self.model.embed_text, texts, TEXT_KEYS, device, self.batch_size)
            lengths = texts["attention_mask"].sum(1).tolist()  # right padding: the real tokens lead
            self.caption_tokens.update(
                (t, x[:n]) for t, x, n in zip(new, tokens, lengths, strict=True))
        chosen = [self.caption_tokens[t] for t in wanted]
        lengths = torch.tensor([len(x) for x in chosen])  # (m,)
        tokens = (torch.nn.utils.rnn.pad_sequence(chosen, batch_first=True) if chosen
                  else torch.zeros(0, 1, 0))
        return tokens, torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)  # (m, T, H), (m, T)


def score_embedded(model: CrossEncoder, images: tuple, texts: tuple, n_pairs: int,
                   pair_rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], *,
                   batch_size: int, device=None, progress: bool = False) -> torch.Tensor:
    """The one scoring loop -> (n_pairs,): embedded images (N, R, H), texts (U, T, H) with masks;
    pair_rows(start, stop) -> (image rows, text rows)."""
    scores = torch.empty(n_pairs)
    bar = tqdm(total=n_pairs, desc="cross-encoder pairs", unit="pair", unit_scale=True,
               disable=not progress)
    with bar, inference(model, device) as device:  # eval mode, no grad; the mode is restored after
        for start in range(0, n_pairs, batch_size):
            stop = min(start + batch_size, n_pairs)
            image_rows, text_rows = pair_rows(start, stop)  # (b,), (b,)
            text_mask = texts[1][text_rows]  # (b, T)
            length = max(int(text_mask.sum(1).max()), 1)
            block = (texts[0][text_rows, :length], text_mask[:, :length], images[0][image_rows],
                     images[1][image_rows])  # (b, t, H), (b, t), (b, R, H), (b, R)
            scores[start:stop] = model.fuse(*(x.to(device) for x in block)).float().cpu()
            bar.update(stop - start)
    return scores


def score_pairs(model: CrossEncoder, images: dict, texts: dict, *, batch_size: int = BLOCK_PAIRS,
                device=None) -> torch.Tensor:
    """Logits (P,) of P aligned pairs: images[k] (P, ...) with texts[k] (P, T), in eval mode."""
    n = len(texts["input_ids"])
    if len(images["regions"]) != n:
        raise ValueError(f"{len(images['regions'])} images but {n} texts: pairs must be aligned")
    with inference(model, device) as device:
        embedded_images = (_embed(model.embed_image, images, IMAGE_KEYS, device, batch_size),
                           images["region_mask"])  # (P, R, H), (P, R)
        embedded_texts = (_embed(model.embed_text, texts, TEXT_KEYS, device, batch_size),
                          texts["attention_mask"])  # (P, T, H), (P, T)
    return score_embedded(model, embedded_images, embedded_texts, n, lambda start, stop:
                          (torch.arange(start, stop),) * 2, batch_size=batch_size, device=device)


def _indices(given, n: int) -> torch.Tensor:
    """given as a long tensor, or every index below n."""
    return torch.arange(n) if given is None else torch.as_tensor(np.asarray(given)).long()


def score_matrix(model: CrossEncoder, split, tokenizer, image_indices=None, text_indices=None, *,
                 batch_size: int = BLOCK_PAIRS, device=None, progress: bool = True,
                 embedded: Embedded | None = None) -> torch.Tensor:
    """(n_img, n_txt) logits of the chosen images and texts (all by default), text-major."""
    embedded = embedded or Embedded(model, split, tokenizer, device=device, batch_size=batch_size)
    images = _indices(image_indices, split.n_images)  # (n_img,) rows of the split
    text_ids = _indices(text_indices, split.n_texts)  # (n_txt,)
    n_img, n_txt = len(images), len(text_ids)

    def rows(start, stop):
        pair = torch.arange(start, stop)
        return images[pair % n_img], pair // n_img

    scores = score_embedded(model, embedded.images(slice(None)),
                            embedded.captions(text_ids, device), n_img * n_txt, rows,
                            batch_size=batch_size, device=device, progress=progress)
    return scores.view(n_txt, n_img).T.contiguous()  # (n_img, n_txt)


def score_index_pairs(model: CrossEncoder, split, tokenizer, image_indices, text_indices, *,
                      batch_size: int = BLOCK_PAIRS, device=None, progress: bool = False,
                      embedded: Embedded | None = None) -> torch.Tensor:
    """Logits (P,) of the pairs (image_indices[p], text_indices[p]): the re-rankers' pair scorer."""
    images, texts = checked_pairs(_indices(image_indices, split.n_images),
                                  _indices(text_indices, split.n_texts))  # (P,) each
    embedded = embedded or Embedded(model, split, tokenizer, device=device, batch_size=batch_size)
    distinct, text_rows = torch.unique(texts, return_inverse=True)  # (U,), (P,)
    captions = embedded.captions(distinct, device)  # (U, T, H), (U, T)
    order = by_caption_length(captions[1].sum(1)[text_rows])  # (P,) like lengths share a block
    in_order = score_embedded(model, embedded.images(slice(None)), captions, len(images),
                              lambda start, stop: (images[order[start:stop]],
                                                   text_rows[order[start:stop]]),
                              batch_size=batch_size, device=device, progress=progress)
    return in_order[order.argsort()]  # back to the pairs' order


def rerank_scores(model: CrossEncoder, split, tokenizer, candidates, text_indices=None, *,
                  batch_size: int = BLOCK_PAIRS, device=None,
                  progress: bool = False) -> torch.Tensor:
    """Scores (Q, M) of text query q (text_indices, default all) against candidates[q] (Q, M)."""
    candidates = torch.as_tensor(np.asarray(candidates), dtype=torch.long)  # (Q, M)
    text_ids = _indices(text_indices, split.n_texts)  # (Q,)
    if candidates.ndim != 2 or len(candidates) != len(text_ids):
        raise ValueError(f"candidates must be (Q, M) with Q = {len(text_ids)} queries, "
                         f"got shape {tuple(candidates.shape)}")
    Q, M = candidates.shape
    return score_index_pairs(model, split, tokenizer, candidates.reshape(-1),  # query-major
                             text_ids.repeat_interleave(M), batch_size=batch_size, device=device,
                             progress=progress).view(Q, M)
