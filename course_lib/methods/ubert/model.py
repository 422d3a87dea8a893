"""U-BERT (Yu, Fei and Li, ICTIR 2022): each feature is an intra-modal part plus an inter-modal
residual (§4.1).

    regions  r_i = LN(feature + box) + type(1)                (eq. 2)
    tokens   t_i = word + position + type(0)
    BERT_img(R) -> r̂_i,  I_intra = mean_i r̂_i                 (eq. 6-7)
    BERT_txt(T) -> t̂_i,  T_intra = mean_i t̂_i                 (eq. 8-9)
    BERT_cross([r_1..r_M, t_1..t_N]) -> [r̄_1..r̄_M, t̄_1..t̄_N]  (eq. 10-11, the *input* embeddings)
    I_inter = mean_i r̄_i,  T_inter = mean_i t̄_i               (eq. 12-13)
    all four L2-normalised (§4.1, "to make the magnitude ... comparable")
    s1 = cos(I_intra, T_intra)                                (eq. 14, stage 1)
    s2 = cos(α·I_intra + I_inter, α·T_intra + T_inter), α = 0.5  (eq. 15, stage 2)

Stage 1 is a dual encoder (gallery I_intra in a FAISS index). Stage 2 re-scores the top K from
cached states (`UBERTStates`): per candidate only the L_c cross layers run, O(K·L_c·c) against a
full cross-encoder's O(K·L·c).

Our choices where the paper is silent (runs: docs/tuning_notes.md, "U-BERT"):
- One table of input embeddings r_i, t_i serves the towers and BERT_cross (eq. 6 and 10 read eq.
  2's); step 2 freezes it with the towers. (BERT_cross over the tower outputs scored lower.)
- The paper's input embeddings are pre-trained; ours, learned through a mean over each side, never
  tie words to regions, and BERT_cross over them ranked no better than stage 1. So with
  `cross_towers="scan"` each token BERT_cross reads also carries LN(Linear(.)) of the frozen SCAN
  encoders' reading of it; "none" is eq. 10 over step 1's tables alone.
- Means count every real token, [CLS] and [SEP] included; padding is masked out.
- `text_encoder`: BERT_txt is that pretrained BERT, t_i its embedding layer's output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import JointEmbedding, Transformer, masked_mean
from course_lib.core.checkpoints import inference
from course_lib.core.encoders import pretrained_bert
from course_lib.core.optimizer import pretrained_lr_scales
from course_lib.core.settings import CourseConfig
from course_lib.data.datasets import image_batch, image_fields, text_fields
from course_lib.methods.queries import checked_pairs, length_blocks

CROSS_TOWERS = ("scan", "none")
STEP_TWO_PARTS = ("cross.", "cross_inputs.")  # what step 2 trains: BERT_cross, its SCAN inputs
TRAININGS = ("two_step", "joint")


@dataclass
class UBERTConfig(CourseConfig):
    """Defaults chosen in docs/tuning_notes.md, "U-BERT"."""

    hidden: int = 128  # width of every token, in the towers and in BERT_cross (paper: 768)
    tower_layers: int = 2  # blocks in each intra-modal tower, BERT_img and BERT_txt (paper: 12)
    cross_layers: int = 1  # blocks L_c of BERT_cross (paper: 3 of 12; the cross-encoder has 3)
    heads: int = 4  # attention heads per block
    alpha: float = 0.5  # weight of the intra part in eq. 15 (the paper's, "without cherry-picking")
    cross_towers: str = "scan"  # "scan": BERT_cross's tokens also carry SCAN's reading; or "none"
    training: str = "two_step"  # §4.3's towers with L1 then BERT_cross with L2, or "joint" L1 + L2
    dropout: float = 0.1  # on the embeddings and inside every block (the paper's 0.1)
    margin: float = 0.1  # hinge margin of L1 and L2 (the paper gives none; VSE++'s is 0.2)
    max_violation: bool = False  # the hardest in-batch negatives only (§4.3, "as VSE++"), or all
    sum_warmup_steps: int = 200  # with max_violation: each stage's first steps sum every hinge
    max_text_length: int = 40  # token positions (the paper: up to 44 tokens)
    # None: ours, from random weights; else the pretrained BERT BERT_txt starts from
    text_encoder: str | None = None
    # with text_encoder: BERT_txt's rate as a multiple of lr (e.g. 0.1) while it trains; None: 1
    text_encoder_lr_scale: float | None = None
    batch_size: int = 256  # step 1 (the towers with L1): pairs per step (the paper's: 216)
    lr: float = 1e-3  # peak AdamW learning rate of step 1
    max_steps: int = 4000  # optimizer steps of step 1 (~20 epochs of the 10k-scene train split)
    cross_batch_size: int = 16  # step 2 (BERT_cross with L2): pairs per step, each with each
    cross_lr: float = 4e-3  # peak AdamW rate of step 2 and of joint training
    cross_steps: int = 5000  # optimizer steps of step 2 (joint: max_steps + cross_steps)
    warmup_fraction: float = 0.05  # share of each stage's steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm (VSE++)
    seed: int = 0  # model initialisation and data order

    SMOKE: ClassVar[dict] = {"max_steps": 40, "cross_steps": 40, "sum_warmup_steps": 10,
                             "batch_size": 64}
    # the real-photo preset (CourseConfig.REAL_PHOTOS), chosen on Flickr8k's val
    REAL_PHOTOS: ClassVar[dict] = {"max_steps": 300, "cross_steps": 150, "batch_size": 128}

    def __post_init__(self):
        self.lr_scales()  # a scale without a pretrained text encoder is refused here
        self.check_choices(training=TRAININGS, cross_towers=CROSS_TOWERS)

    def lr_scales(self) -> dict | None:
        """TrainConfig.lr_scales: the pretrained BERT_txt's rate scaled by text_encoder_lr_scale."""
        return pretrained_lr_scales("text_tower.", self.text_encoder_lr_scale, self.text_encoder,
                                    "UBERTConfig")


def enhanced_similarity(image_intra, text_intra, image_inter, text_inter, alpha: float = 0.5):
    """Eq. 15, pair by pair, on unit-norm (P, H) inputs -> (P,); α -> infinity gives eq. 14's s1."""
    return F.cosine_similarity(alpha * image_intra + image_inter, alpha * text_intra + text_inter,
                               dim=-1, eps=1e-8)


class UBERT(JointEmbedding):
    """The towers, BERT_cross and the two scores: encode_images / encode_texts -> I_intra / T_intra
    (B, H); *_states add BERT_cross's tokens; pair_scores -> (B, B) s2. scan: frozen SCAN copy."""

    modality = "regions"

    def __init__(self, region_dim: int, vocab_size: int, config: UBERTConfig | None = None,
                 box_dim: int = 7, pad_token_id: int = 0, scan: nn.Module | None = None):
        cfg = config or UBERTConfig()
        if (cfg.cross_towers == "scan") != (scan is not None):
            raise ValueError("config.cross_towers='scan' needs the trained SCAN model, UBERT(..., "
                             "scan=scan_model) (UBERTMethod passes its SCAN method's); "
                             "cross_towers='none' takes none")
        H = cfg.hidden
        # a pretrained BERT_txt brings its own word table: the course's shrinks to one row
        super().__init__(region_dim, 1 if cfg.text_encoder else vocab_size, H, cfg.max_text_length,
                         box_dim, 0 if cfg.text_encoder else pad_token_id)
        self.config, self.dropout = cfg, nn.Dropout(cfg.dropout)
        self.image_tower = Transformer(H, cfg.tower_layers, cfg.heads, cfg.dropout)  # BERT_img
        if cfg.text_encoder is None:
            self.text_tower = Transformer(H, cfg.tower_layers, cfg.heads, cfg.dropout)  # BERT_txt
        else:
            self.text_tower = pretrained_bert(cfg.text_encoder, vocab_size, H, "UBERTConfig",
                                              "the width BERT_cross reads")
        self.cross = Transformer(H, cfg.cross_layers, cfg.heads, cfg.dropout)  # BERT_cross: L_c
        self._init_tables()
        self.towers_frozen, self.scan = False, None
        if scan is not None:  # built last: the towers' and BERT_cross's initial weights ignore it
            self.scan = copy.deepcopy(scan).requires_grad_(False).eval()  # its own frozen copy
            E = scan.config.embed_dim
            self.cross_inputs = nn.ModuleDict({side: nn.Sequential(nn.Linear(E, H), nn.LayerNorm(H))
                                               for side in ("word", "region")})

    def freeze_towers(self) -> UBERT:
        """Step 2 of §4.3: towers and embeddings fixed, in eval mode even while training."""
        for name, p in self.named_parameters():
            if not name.startswith(STEP_TWO_PARTS):  # the embedding tables and both towers
                p.requires_grad_(False)
        self.towers_frozen = True
        return self.train(self.training)

    def train(self, mode: bool = True) -> UBERT:
        super().train(mode)
        if self.towers_frozen:  # frozen parts run as at inference: no dropout
            for module in (self.image_tower, self.text_tower, self.region, self.dropout):
                module.eval()
        if self.scan is not None:
            self.scan.eval()
        return self

    # ---- stage 1: the towers -----------------------------------------------------------------
    def _image_tower(self, images: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r_i, eq. 10's tokens (B, M, H), region_mask (B, M) bool, I_intra (B, H) unit)."""
        mask = images["region_mask"].bool()  # (B, M)
        embedded = self.dropout(self.embed_image(images))  # (B, M, H) r_i, eq. 2
        attended = self.image_tower(embedded, mask)  # (B, M, H) r̂_i, eq. 6
        intra = F.normalize(masked_mean(attended, mask), dim=-1, eps=1e-8)  # eq. 7
        return embedded, mask, intra

    def _text_tower(self, texts: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t_i, eq. 10's tokens (B, N, H), attention_mask (B, N) bool, T_intra (B, H) unit)."""
        mask = texts["attention_mask"].bool()  # (B, N)
        if self.config.text_encoder is None:
            embedded = self.dropout(self.embed_text(texts))  # (B, N, H) t_i
            attended = self.text_tower(embedded, mask)  # (B, N, H) t̂_i, eq. 8
        else:  # BERT's embedding layer gives t_i (its own dropout included), its last layer t̂_i
            out = self.text_tower.bert(input_ids=texts["input_ids"], output_hidden_states=True,
                                       attention_mask=texts["attention_mask"])
            embedded, attended = out.hidden_states[0], out.last_hidden_state  # (B, N, H) each
        intra = F.normalize(masked_mean(attended, mask), dim=-1, eps=1e-8)  # eq. 9
        return embedded, mask, intra

    def image_states(self, images: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens BERT_cross reads (B, M, H), region_mask (B, M) bool, I_intra (B, H) unit)."""
        tokens, mask, intra = self._image_tower(images)
        if self.scan is not None:  # + SCAN's reading of each region (cross_towers="scan")
            regions, real = self.scan.encode_images(images)  # (B, M, E), (B, M)
            regions = self.cross_inputs["region"](regions.to(tokens.dtype))  # (B, M, H)
            tokens = tokens + regions * real.unsqueeze(-1)
        return tokens, mask, intra

    def text_states(self, texts: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens BERT_cross reads (B, N, H), attention_mask (B, N) bool, T_intra (B, H) unit)."""
        tokens, mask, intra = self._text_tower(texts)
        if self.scan is not None:  # + SCAN's reading of each word (cross_towers="scan")
            words, is_word = self.scan.encode_words_in_place(texts)  # (B, N, E), (B, N)
            words = self.cross_inputs["word"](words.to(tokens.dtype))  # (B, N, H)
            tokens = tokens + words * is_word.unsqueeze(-1)
        return tokens, mask, intra

    def encode_images(self, batch: dict) -> torch.Tensor:
        return self._image_tower(batch)[2]  # (B, H): stage 1 needs no SCAN pass

    def encode_texts(self, batch: dict) -> torch.Tensor:
        return self._text_tower(batch)[2]  # (B, H)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(I_intra (B, H), T_intra (B, H)) of a pair batch: losses.batch_scores gives s1 (B, B)."""
        return self.encode_images(batch), self.encode_texts(batch)

    # ---- stage 2: BERT_cross -----------------------------------------------------------------
    def inter(self, image_tokens, region_mask, text_tokens,
              text_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 10-13: regions (P, M, H), tokens (P, N, H), masks -> unit I_inter, T_inter (P, H)."""
        M = image_tokens.shape[1]
        x = torch.cat([image_tokens, text_tokens], dim=1)  # (P, M + N, H), eq. 10
        mask = torch.cat([region_mask, text_mask], dim=1)  # (P, M + N)
        h = self.cross(x, mask)  # (P, M + N, H), eq. 11
        image_inter = F.normalize(masked_mean(h[:, :M], region_mask), dim=-1, eps=1e-8)  # eq. 12
        text_inter = F.normalize(masked_mean(h[:, M:], text_mask), dim=-1, eps=1e-8)  # eq. 13
        return image_inter, text_inter

    def s2(self, image, text) -> torch.Tensor:
        """Eq. 15 for aligned pairs; image / text = (tokens, mask, intra) as the *_states give."""
        image_inter, text_inter = self.inter(image[0], image[1], text[0], text[1])
        return enhanced_similarity(image[2], text[2], image_inter, text_inter, self.config.alpha)

    def pair_scores(self, image, text) -> torch.Tensor:
        """(B, B) s2 of every image with every caption of a batch, positives on the diagonal."""
        B = image[2].shape[0]
        rows = torch.arange(B, device=image[2].device).repeat_interleave(B)  # (B*B,) image of pair
        cols = torch.arange(B, device=image[2].device).repeat(B)  # (B*B,) caption of pair
        return self.s2([s[rows] for s in image], [s[cols] for s in text]).view(B, B)


# ----------------------------------------------------------------------------- cached states
@dataclass
class UBERTStates:
    """Stage 2's offline cache per image and caption: BERT_cross's tokens, mask and intra vector."""

    image_tokens: torch.Tensor  # (N, M, H)
    region_mask: torch.Tensor  # (N, M) bool
    image_intra: torch.Tensor  # (N, H)
    text_tokens: torch.Tensor  # (T, L, H)
    text_mask: torch.Tensor  # (T, L) bool
    text_intra: torch.Tensor  # (T, H)

    def image(self, rows) -> tuple:
        return self.image_tokens[rows], self.region_mask[rows], self.image_intra[rows]

    def text(self, rows) -> tuple:
        text_mask = self.text_mask[rows]
        length = max(int(text_mask.sum(1).max()), 1) if len(text_mask) else 1  # drop common padding
        return self.text_tokens[rows][:, :length], text_mask[:, :length], self.text_intra[rows]


def compute_states(model: UBERT, split, tokenizer, *, batch_size: int = 512,
                   device=None) -> UBERTStates:
    """Run the towers once over a split's images and captions (stage 2's offline work)."""
    images = image_fields(split)
    texts = text_fields(split.captions, tokenizer, model.config.max_text_length)  # (T, L)
    lengths = texts["attention_mask"].sum(1)  # (T,) real tokens, padding on the right
    # captions in batches of like lengths, each cut to its longest
    order = torch.argsort(lengths, descending=True, stable=True)  # (T,)
    T, L = texts["input_ids"].shape
    image_parts, text = [], None
    with inference(model, device) as device:
        for start in range(0, split.n_images, batch_size):
            block = image_batch(images, slice(start, start + batch_size))
            block = {k: v.to(device) for k, v in block.items()}
            image_parts.append([s.cpu() for s in model.image_states(block)])
        for start in range(0, split.n_texts, batch_size):
            rows = order[start:start + batch_size]
            block = {k: v[rows, :int(lengths[rows].max())].to(device) for k, v in texts.items()}
            tokens, mask, intra = (s.cpu() for s in model.text_states(block))  # tokens (b, l, H)
            if text is None:  # filled in caption order, zero past each batch's longest: no copies
                text = [tokens.new_zeros(T, L, tokens.shape[-1]), mask.new_zeros(T, L),
                        intra.new_zeros(T, intra.shape[-1])]  # the full setting's: gigabytes
            for whole, part in zip(text, (tokens, mask, intra), strict=True):
                whole[rows, :part.shape[1]] = part
    return UBERTStates(*(torch.cat(column) for column in zip(*image_parts, strict=True)), *text)


def score_cached_pairs(model: UBERT, states: UBERTStates, image_indices, text_indices, *,
                       batch_size: int = 1024, device=None) -> torch.Tensor:
    """s2 (P,) of the pairs (image_indices[p], text_indices[p]) from cached states."""
    images, texts = checked_pairs(image_indices, text_indices)  # (P,) each
    out = torch.empty(len(images))
    with inference(model, device) as device:
        for rows in length_blocks(states.text_mask.sum(1)[texts], batch_size):  # (b,) each
            image = [s.to(device) for s in states.image(images[rows])]
            text = [s.to(device) for s in states.text(texts[rows])]
            out[rows] = model.s2(image, text).float().cpu()
    return out


def rescore_candidates(model: UBERT, query: tuple, gallery: tuple,
                       direction: str = "t2i") -> torch.Tensor:
    """Stage 2 of one query against K candidates -> (K,): query states (1, ...) expanded as views
    against the gallery's (K, ...); t2i: a caption against images, i2t the other way round."""
    K = gallery[2].shape[0]
    expanded = tuple(s.expand(K, *s.shape[1:]) for s in query)
    return model.s2(gallery, expanded) if direction == "t2i" else model.s2(expanded, gallery)


def build_ubert(config: UBERTConfig, split, tokenizer, scan=None) -> UBERT:
    """A fresh UBERT; scan: the trained SCANModel cross_towers="scan" reads."""
    if not split.has_regions:
        raise ValueError("U-BERT reads detector regions (eq. 2); this split has none. Use a split "
                         "with regions, boxes and region_mask (the synthetic benchmark has them)")
    return UBERT(split.regions.shape[-1], len(tokenizer), config,
                 pad_token_id=tokenizer.pad_token_id, scan=scan)
