"""The trainable SCAN model (Lee et al., ECCV 2018): region and word encoders scored by stacked
cross attention (`attention.scan_similarity`), trained with VSE++'s hinge loss.

- image: Linear(region feature) (SCAN's "precomp" encoder) + Linear(7-d box), L2-normalised per
  region. Our synthetic features hold no position, so without the box "left of" is unanswerable;
  `use_boxes=False` is pure SCAN, which scores lower (docs/tuning_notes.md, "SCAN").
- text: word embeddings -> bi-GRU, directions averaged, L2-normalised per word; [CLS]/[SEP] are
  removed first (SCAN has none). With `text_encoder`, a pretrained BERT reads the whole caption and
  Linear(its states at the words) stands where the GRU's were.

Every pair runs its own attention: a text query costs O(gallery size) cross attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from course_lib.core.checkpoints import model_device
from course_lib.core.encoders import BertTextEncoder, BiGRUEncoder, l2_normalize, word_mask
from course_lib.core.losses import hinge_triplet_loss
from course_lib.core.offline_weights import pretrained_text_path
from course_lib.core.settings import CourseConfig
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens
from course_lib.data.datasets import CaptionDataset, ImageDataset, make_loader
from course_lib.methods.encoding import encode_batches, subset_of
from course_lib.methods.scan.attention import scan_similarity

BOX_DIM = 7  # UNITER's box: x1, y1, x2, y2, w, h, area


@dataclass
class SCANConfig(CourseConfig):
    # Defaults chosen in docs/tuning_notes.md, "SCAN".
    direction: str = "t2i"  # "t2i": words attend over regions; "i2t": regions over words
    lambda_softmax: float = 9.0  # attention temperature (SCAN's best t2i: 9; i2t: 4)
    agg: str = "lse"  # pool the per-word (t2i) or per-region (i2t) scores: "lse" or "mean"
    lambda_lse: float = 6.0  # LogSumExp sharpness (SCAN's best t2i: 6)
    embed_dim: int = 64  # joint space of regions and words (SCAN: 1024)
    word_dim: int = 64  # word embedding size fed to the GRU (SCAN: 300)
    use_boxes: bool = True  # add Linear(box) to each region: our features hold no position
    margin: float = 0.2  # hinge margin (VSE++ / SCAN)
    max_violation: bool = True  # hardest in-batch negative only (VSE++ "MH", SCAN's setting)
    batch_size: int = 128  # (image, caption) pairs per batch: the in-batch negatives
    lr: float = 1e-3  # peak AdamW learning rate (SCAN: 2e-4, over 30 epochs)
    max_steps: int = 2000  # 5 epochs of the 10k-scene train split
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm (VSE++ / SCAN)
    seed: int = 0  # model initialisation and data order
    text_encoder: str | None = None  # a BERT (name or folder) under a Linear; None: SCAN's bi-GRU
    text_trainable_layers: int = 0

    SMOKE: ClassVar[dict] = {"max_steps": 40}  # smoke(): tiny training, same code path
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 600, "embed_dim": 256}  # chosen on Flickr8k's val

    def __post_init__(self):
        if self.text_trainable_layers and self.text_encoder is None:
            raise ValueError(f"SCANConfig(text_trainable_layers={self.text_trainable_layers}) "
                             "fine-tunes a pretrained BERT's last layers: name it too, e.g. "
                             "text_encoder='all-MiniLM-L6-v2'")


def normalize_real(items: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, E) -> unit vectors at real items (mask (B, L)), exact zeros at padding."""
    padded = ~mask.unsqueeze(-1)  # (B, L, 1)
    return l2_normalize(items.masked_fill(padded, 1.0)).masked_fill(padded, 0.0)


def words_only(input_ids: torch.Tensor, attention_mask: torch.Tensor,
               special: SpecialTokens = WORD_SPECIAL_TOKENS):
    """`[CLS] w1 .. wn [SEP] [PAD]` -> (ids, mask) (B, L) of `w1 .. wn [PAD]`, words only."""
    order, mask = words_first(word_mask(input_ids, attention_mask, special))  # (B, L) each
    return input_ids.gather(1, order).masked_fill(~mask, special.pad), mask


def words_first(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep (B, T) -> (order, mask) (B, L): gathering by `order` puts each caption's words first."""
    order = torch.argsort((~keep).int(), dim=1, stable=True)  # (B, T) words first
    mask = keep.gather(1, order)  # (B, T)
    length = int(mask.sum(1).max()) if len(mask) else 0
    return order[:, :length], mask[:, :length]


class SCANModel(nn.Module):
    """Regions and words in one space, scored by SCAN's stacked cross attention: encode_images ->
    (regions (B, R, E), mask (B, R)), encode_texts -> (words (B, L, E), mask (B, L)), unit vectors,
    padding exactly zero; forward -> (B, B) scores. `special`: [CLS]/[SEP] dropped, [PAD] padded."""

    modality = "regions"  # the image field the datasets must provide

    def __init__(self, region_dim: int, vocab_size: int, config: SCANConfig | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        self.config = c = config or SCANConfig()
        self.special = special  # a plain attribute: not in the state_dict
        self.region_proj = nn.Linear(region_dim, c.embed_dim)
        self.box_proj = nn.Linear(BOX_DIM, c.embed_dim) if c.use_boxes else None
        self.word_proj = None
        if c.text_encoder is None:
            self.text_encoder = BiGRUEncoder(vocab_size, embed_dim=c.word_dim, hidden=c.embed_dim,
                                             special=special)
        else:
            bert = pretrained_text_path(c.text_encoder)
            self.text_encoder = BertTextEncoder(vocab_size, pretrained_name=bert,
                                                special=special).freeze(c.text_trainable_layers)
            self.word_proj = nn.Linear(self.text_encoder.out_dim, c.embed_dim)
        # SCAN's initialisation of its fc layer: Xavier uniform, zero bias.
        for layer in (self.region_proj, self.box_proj, self.word_proj):
            if layer is not None:
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    def encode_images(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch["region_mask"].bool()  # (B, R)
        regions = self.region_proj(batch["regions"])  # (B, R, E)
        if self.box_proj is not None:
            regions = regions + self.box_proj(batch["boxes"])
        return normalize_real(regions, mask), mask

    def encode_texts(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
        if self.word_proj is None:  # the GRU reads the words alone
            ids, mask = words_only(ids, mask, self.special)  # (B, L)
            tokens = self.text_encoder(dict(input_ids=ids, attention_mask=mask)).tokens  # (B, L, E)
            return normalize_real(tokens, mask), mask
        states = self.text_encoder({"input_ids": ids, "attention_mask": mask}).tokens  # (B, T, H)
        order, words = words_first(word_mask(ids, mask, self.special))  # (B, L)
        states = states.gather(1, order.unsqueeze(-1).expand(-1, -1, states.shape[-1]))  # (B, L, H)
        return normalize_real(self.word_proj(states), words), words  # (B, L, E)

    def encode_words_in_place(self, texts: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """encode_texts' words at their token slots -> (tokens (B, T, E), zero elsewhere; is_word
        (B, T)); a caption repeated in the batch is encoded once."""
        ids = texts["input_ids"]
        distinct, rows = torch.unique(ids, dim=0, return_inverse=True)  # (U, T), (B,)
        first = torch.full((len(distinct),), len(rows), device=rows.device).scatter_reduce(
            0, rows, torch.arange(len(rows), device=rows.device), "amin")  # (U,) a row holding each
        words, real = self.encode_texts({k: texts[k][first]
                                         for k in ("input_ids", "attention_mask")})  # (U, L, E)
        words, real = words[rows], real[rows]  # (B, L, E), (B, L): the words only, in order
        is_word = word_mask(ids, texts["attention_mask"], self.special)  # (B, T)
        tokens = words.new_zeros(*is_word.shape, words.shape[-1])  # (B, T, E)
        tokens[is_word] = words[real]  # row-major on both sides: word j of a caption to its slot
        return tokens, is_word

    def score(self, regions, region_mask, words, word_mask) -> torch.Tensor:
        """scan_similarity with this model's attention settings -> (n_images, n_texts)."""
        c = self.config
        return scan_similarity(regions, region_mask, words, word_mask, direction=c.direction,
                               lambda_softmax=c.lambda_softmax, agg=c.agg, lambda_lse=c.lambda_lse)

    def forward(self, batch: dict) -> torch.Tensor:
        # two captions of one image in a batch count as each other's negatives (VSE++'s note)
        return self.score(*self.encode_images(batch), *self.encode_texts(batch))  # (B, B)


def scan_loss(margin: float = 0.2, max_violation: bool = True):
    """A `loss_fn(model, batch, step)` for core.train.Trainer: VSE++'s hinge on the SCAN scores."""

    def loss_fn(model: nn.Module, batch: dict, step: int = 0) -> torch.Tensor:
        return hinge_triplet_loss(model(batch), margin=margin, max_violation=max_violation)

    return loss_fn


def build_scan(config: SCANConfig, split, tokenizer) -> SCANModel:
    """A fresh SCANModel sized for the split's region features and the tokenizer."""
    return SCANModel(split.regions.shape[-1], len(tokenizer), config, SpecialTokens.of(tokenizer))


# ----------------------------------------------------------------------------- evaluation
def _encode_sets(model: SCANModel, loader, encode, desc: str, progress: bool, device):
    """encode(batch) over a loader -> (items (n, L, E), mask (n, L)) padded, on the CPU."""
    def on_cpu(batch):
        items, mask = encode(batch)
        return items.float().cpu(), mask.cpu()

    chunks = encode_batches(model, loader, on_cpu, device, progress, desc)
    length = max(mask.shape[1] for _, mask in chunks)  # zero padding at the end of each set
    items = torch.cat([F.pad(x, (0, 0, 0, length - x.shape[1])) for x, _ in chunks])  # (n, L, E)
    return items, torch.cat([F.pad(m, (0, length - m.shape[1])) for _, m in chunks])  # (n, L)


def encode_regions(model: SCANModel, split, *, batch_size: int = 512, device=None,
                   progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(regions (N, R, E), region_mask (N, R)) of a split's images, on the CPU."""
    loader = make_loader(ImageDataset(split, modality=model.modality), batch_size)
    return _encode_sets(model, loader, model.encode_images, "encode regions", progress, device)


def encode_words(model: SCANModel, split, tokenizer, *, texts=None, batch_size: int = 512,
                 device=None, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(words (T, L, E), word_mask (T, L)) of a split's captions (or `texts`), on the CPU."""
    loader = make_loader(subset_of(CaptionDataset(split), texts), batch_size, tokenizer=tokenizer)
    return _encode_sets(model, loader, model.encode_texts, "encode words", progress, device)


@torch.no_grad()
def scan_matrix(model: SCANModel, split, tokenizer, *, device=None, batch_size: int = 512,
                image_chunk: int = 256, progress: bool = True) -> torch.Tensor:
    """(N, T) SCAN scores of a split on the CPU, `image_chunk` images a call (1k x 5k: seconds)."""
    device = model_device(model, device)
    kwargs = dict(batch_size=batch_size, device=device, progress=progress)
    regions, region_mask = encode_regions(model, split, **kwargs)  # (N, R, E), (N, R)
    words, word_mask_ = (x.to(device) for x in encode_words(model, split, tokenizer, **kwargs))
    chunks = [slice(i, i + image_chunk) for i in range(0, len(regions), image_chunk)]
    return torch.cat([model.score(regions[c].to(device), region_mask[c].to(device), words,
                                  word_mask_).cpu()  # (image_chunk, T)
                      for c in tqdm(chunks, desc="SCAN scores", disable=not progress, leave=False)])
