"""Image and text encoders, the parts every retrieval method is built from: forward(a batch dict
of course_lib.data.datasets) -> EncoderOutput. Text encoders take the tokenizer's ids as `special`
(`SpecialTokens.of(tokenizer)`). Nothing here L2-normalises: VSE++ and SCAN do (`l2_normalize`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from course_lib.core.blocks import RegionEmbedding, Transformer, masked_mean
from course_lib.core.frozen_states import FROZEN_STATES
from course_lib.core.offline_weights import pretrained_text_path
from course_lib.core.settings import CourseNote, from_hub, hub_error
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens

# the course's ViT for the synthetic 32x32 images: 8x8 patches of 4 pixels, 2 blocks of width 64
TINY_VIT_NAME = "vit_tiny_patch16_224"
TINY_VIT_KWARGS = dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)


@dataclass
class EncoderOutput:
    tokens: torch.Tensor  # (B, L, E) one vector per region / patch / word, zero where not mask
    mask: torch.Tensor  # (B, L) bool, True = real
    pooled: torch.Tensor  # (B, E) the vector a dual encoder compares with a dot product
    layers: list | None = None  # every block's (B, L, E) states, when asked (return_layers=True)


def l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """x / (||x|| + eps) along dim, as SCAN's l2norm; the squared norm is clamped at eps**2 so a
    zero vector (padding) stays zero with a gradient that is not NaN."""
    return x / (x.pow(2).sum(dim=dim, keepdim=True).clamp(min=eps * eps).sqrt() + eps)


def count_parameters(module: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) scalars in a module."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def word_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor,
              special: SpecialTokens = WORD_SPECIAL_TOKENS) -> torch.Tensor:
    """(B, T) bool: True at real words (and [UNK]), False at [CLS], [SEP] and padding."""
    not_words = (input_ids == special.cls) | (input_ids == special.sep) | (input_ids == special.pad)
    return attention_mask.bool() & ~not_words


class RegionTransformerEncoder(nn.Module):
    """Regions -> transformer with a learned [CLS] (LightningDOT §3's image side, UNITER): tokens
    (B, 1 + R, hidden), [CLS] first, pooled = h0. Regions are a set: no index embedding."""

    def __init__(self, region_dim: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1, box_dim: int = 7):
        super().__init__()
        self.embed = RegionEmbedding(region_dim, hidden, box_dim)
        self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.transformer = Transformer(hidden, layers, heads, dropout)
        self.out_dim = hidden

    def forward(self, batch: dict, return_layers: bool = False) -> EncoderOutput:
        regions, boxes = batch["regions"], batch["boxes"]  # (B, R, D), (B, R, 7)
        region_mask = batch["region_mask"].bool()  # (B, R)
        B = regions.shape[0]
        x = torch.cat([self.cls.expand(B, -1, -1), self.embed(regions, boxes)], 1)  # (B, 1+R, H)
        mask = torch.cat([region_mask.new_ones(B, 1), region_mask], dim=1)  # (B, 1+R)
        return _transformer_output(self.transformer, self.dropout(x), mask, return_layers)


def _transformer_output(transformer: Transformer, x, mask, return_layers: bool) -> EncoderOutput:
    """Run the shared stack; padded outputs are meaningless, so zeroed; pooled = position 0."""
    h, layers = (transformer(x, mask, return_layers=True) if return_layers
                 else (transformer(x, mask), None))
    h = h.masked_fill(~mask.unsqueeze(-1), 0.0)  # (B, L, H)
    return EncoderOutput(tokens=h, mask=mask, pooled=h[:, 0], layers=layers)


class PixelEncoder(nn.Module):
    """Pixels -> a timm ViT or CNN, optionally projected to out_dim (HiVLP, Fast & Slow).
    model_name=None: the tiny ViT for the synthetic 32x32 images (TINY_VIT_KWARGS, random weights).
    tokens: ViT (B, prefix + P, C), [CLS] first; CNN (B, C, h, w) as (B, h*w, C). pooled: the
    backbone's pre-logits pooling ([CLS] for a ViT, the grid's mean for a CNN)."""

    def __init__(self, model_name: str | None = None, pretrained: bool = False,
                 out_dim: int | None = None, **timm_kwargs):
        super().__init__()
        import timm
        if model_name is None and pretrained:
            raise ValueError("the tiny ViT (model_name=None) has no pretrained weights: pass a "
                             "timm name, e.g. PixelEncoder('resnet18', pretrained=True)")
        if model_name is not None and not timm.is_model(model_name):
            raise ValueError(f"timm has no model {model_name!r}; see timm.list_models('*vit*')")
        timm_kwargs = {**TINY_VIT_KWARGS, **timm_kwargs} if model_name is None else timm_kwargs
        try:
            self.backbone = timm.create_model(model_name or TINY_VIT_NAME, pretrained=pretrained,
                                              num_classes=0, **timm_kwargs)
        except Exception as e:  # hub errors vary by version (OSError, httpx, RuntimeError, ...)
            if not pretrained:
                raise
            raise hub_error(f"timm model {model_name!r} with pretrained weights", e,
                            "A weights file on disk can be given as pretrained_cfg_overlay=dict("
                            "file=PATH). Offline, use random weights: PixelEncoder("
                            f"{model_name!r}, pretrained=False), or the tiny ViT: PixelEncoder() "
                            "for the synthetic 32x32 images.") from e
        width = self.backbone.num_features
        self.proj = nn.Linear(width, out_dim) if out_dim is not None else nn.Identity()
        self.out_dim = out_dim if out_dim is not None else width

    def forward(self, batch: dict) -> EncoderOutput:
        pixels = batch["pixels"]  # (B, 3, H, W)
        features = self.backbone.forward_features(pixels)  # ViT (B, N, C) / CNN (B, C, h, w)
        pooled = self.backbone.forward_head(features, pre_logits=True)  # (B, C)
        if features.ndim == 4:
            if getattr(self.backbone, "output_fmt", "NCHW") == "NHWC":  # e.g. Swin
                features = features.permute(0, 3, 1, 2)
            features = features.flatten(2).transpose(1, 2)  # (B, h*w, C)
        mask = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)  # (B, N)
        return EncoderOutput(tokens=self.proj(features), mask=mask, pooled=self.proj(pooled))


class BagOfWordsEncoder(nn.Module):
    """Word embeddings, pooled by their mean over the real words (the simplest baseline); [CLS]
    and [SEP], in every caption, would add the same offset to every vector."""

    def __init__(self, vocab_size: int, hidden: int = 64,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        self.special = special  # a plain attribute: not in the state_dict
        self.embed = nn.Embedding(vocab_size, hidden, padding_idx=special.pad)
        self.out_dim = hidden

    def forward(self, batch: dict) -> EncoderOutput:
        input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()  # (B, T)
        tokens = self.embed(input_ids).masked_fill(~mask.unsqueeze(-1), 0.0)  # (B, T, H)
        pooled = masked_mean(tokens, word_mask(input_ids, mask, self.special))  # (B, H)
        return EncoderOutput(tokens=tokens, mask=mask, pooled=pooled)


class BiGRUEncoder(nn.Module):
    """Word embeddings -> bidirectional GRU over packed sequences (VSE++ / SCAN's text side).
    tokens (B, T, hidden): the two directions' outputs averaged (SCAN), zero at padding. pooled:
    the mean of the last layer's two final states (VSE++'s last output, made bidirectional)."""

    def __init__(self, vocab_size: int, embed_dim: int = 64, hidden: int = 64, layers: int = 1,
                 dropout: float = 0.0, special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        self.special = special
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=special.pad)
        self.gru = nn.GRU(embed_dim, hidden, num_layers=layers, batch_first=True,
                          bidirectional=True, dropout=dropout if layers > 1 else 0.0)
        self.hidden = self.out_dim = hidden

    def forward(self, batch: dict) -> EncoderOutput:
        input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()  # (B, T)
        B, T = input_ids.shape
        lengths = mask.sum(1)  # (B,) right padding: real tokens come first
        if (lengths == 0).any():
            raise ValueError("BiGRUEncoder got an empty text (attention_mask all zero)")
        packed = pack_padded_sequence(self.embed(input_ids), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, h_n = self.gru(packed)  # h_n (layers*2, B, H), already back in batch order
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)  # (B, T, 2H), 0-padded
        tokens = out.view(B, T, 2, self.hidden).mean(2)  # (B, T, H)
        pooled = (h_n[-2] + h_n[-1]) / 2  # (B, H) last layer: forward, backward
        return EncoderOutput(tokens=tokens, mask=mask, pooled=pooled)


class TransformerTextEncoder(nn.Module):
    """Words -> core.blocks' transformer, pooled = the [CLS] output z0 (LightningDOT §3).
    BERT's input embeddings on a pre-LN stack (BERT is post-LN; pre-LN trains from random weights
    more easily and lets HiVLP / U-BERT read any layer). tokens (B, T, hidden), zero at padding."""

    def __init__(self, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                 max_length: int = 64, dropout: float = 0.1,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        self.special = special  # a plain attribute: not in the state_dict
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=special.pad)
        self.position = nn.Embedding(max_length, hidden)
        for table in (self.word, self.position):
            nn.init.normal_(table.weight, std=0.02)  # BERT's initialisation
        with torch.no_grad():
            self.word.weight[special.pad].zero_()
        self.norm, self.dropout = nn.LayerNorm(hidden), nn.Dropout(dropout)
        self.transformer = Transformer(hidden, layers, heads, dropout)
        self.out_dim, self.max_length = hidden, max_length

    def forward(self, batch: dict, return_layers: bool = False) -> EncoderOutput:
        input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()  # (B, T)
        T = input_ids.shape[1]
        _check_positions(T, self.max_length, "encoder")
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.norm(self.word(input_ids) + self.position(positions))  # (B, T, H)
        return _transformer_output(self.transformer, self.dropout(x), mask, return_layers)


def _check_positions(T: int, limit: int, what: str) -> None:
    if T > limit:
        raise ValueError(f"texts of {T} tokens, but this {what} has {limit} positions: tokenise "
                         "with a smaller max_length or build it with a larger max_length")


def _bert_without_pooler(name: str, **kwargs):
    """BertModel.from_pretrained without the pooler or the table of its unused weights."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        bert, info = BertModel.from_pretrained(name, add_pooling_layer=False,
                                               output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    if info.get("missing_keys"):
        warnings.warn(f"the pretrained BERT {name!r} lacks {sorted(info['missing_keys'])}: they "
                      "start from random weights", CourseNote, stacklevel=3)
    return bert


class BertTextEncoder(nn.Module):
    """transformers' BertModel; pooled = the [CLS] last hidden state h0, not BERT's tanh pooler
    (LightningDOT §3); tokens (B, T, hidden), zero at padding. pretrained_name (e.g.
    "bert-base-uncased") loads weights and sizes; else a small random BERT."""

    def __init__(self, vocab_size: int | None, hidden: int = 64, layers: int = 2, heads: int = 4,
                 max_length: int = 64, dropout: float = 0.1, pretrained_name: str | None = None,
                 special: SpecialTokens = WORD_SPECIAL_TOKENS):
        super().__init__()
        self.special = special
        from transformers import BertConfig, BertModel
        if pretrained_name is None:
            config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, intermediate_size=4 * hidden,
                                max_position_embeddings=max_length, hidden_dropout_prob=dropout,
                                attention_probs_dropout_prob=dropout, pad_token_id=special.pad)
            self.bert = BertModel(config, add_pooling_layer=False)
        else:
            self.bert = from_hub(lambda **kw: _bert_without_pooler(pretrained_name, **kw),
                                 f"the pretrained BERT {pretrained_name!r}",
                                 "Offline, use random weights: BertTextEncoder(len(tokenizer)) "
                                 "(pretrained_name=None).")
            if vocab_size is not None and vocab_size != self.bert.config.vocab_size:
                raise ValueError(f"vocab_size {vocab_size} is not {pretrained_name!r}'s "
                                 f"{self.bert.config.vocab_size}: tokenise with tokenizer_for("
                                 f"split, name={pretrained_name!r}), not the word tokenizer")
        self.out_dim = self.bert.config.hidden_size
        self.frozen: list[nn.Module] = []  # parts kept as loaded (freeze)

    def freeze(self, trainable_layers: int = 0) -> BertTextEncoder:
        """Keep the embeddings and all but the last `trainable_layers` blocks as loaded."""
        layers = self.bert.encoder.layer
        if not 0 <= trainable_layers <= len(layers):
            raise ValueError(f"trainable_layers must be in [0, {len(layers)}] (this BERT's "
                             f"layers), got {trainable_layers}")
        for module in self.frozen:
            module.requires_grad_(True)
        self.frozen = [self.bert.embeddings, *layers[:len(layers) - trainable_layers]]
        for module in self.frozen:
            module.requires_grad_(False)
        return self.train(self.training)

    def is_frozen(self) -> bool:
        """freeze(0): its states depend on the ids alone, so copies share them (frozen_states)."""
        return len(self.frozen) == len(self.bert.encoder.layer) + 1

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.frozen:
            module.eval()
        return self

    def forward(self, batch: dict) -> EncoderOutput:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
        _check_positions(input_ids.shape[1], self.bert.config.max_position_embeddings, "BERT")
        if self.is_frozen():  # a fixed function of the ids, which nothing trains through
            with torch.no_grad():
                states = FROZEN_STATES(self.bert, input_ids, attention_mask)  # (B, T, H)
        else:
            states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.bool()
        tokens = states.masked_fill(~mask.unsqueeze(-1), 0.0)  # (B, T, H)
        return EncoderOutput(tokens=tokens, mask=mask, pooled=tokens[:, 0])  # h0 = [CLS]


def pretrained_bert(name: str, vocab_size: int, hidden: int, config: str, why: str,
                    special: SpecialTokens = WORD_SPECIAL_TOKENS) -> BertTextEncoder:
    """BertTextEncoder of a pretrained BERT, which must be `hidden` wide (else a ValueError)."""
    encoder = BertTextEncoder(vocab_size, pretrained_name=pretrained_text_path(name),
                              special=special)
    if encoder.out_dim != hidden:
        raise ValueError(f"{name!r} is {encoder.out_dim} wide but hidden={hidden}: set "
                         f"{config}(hidden={encoder.out_dim}), {why}")
    return encoder


IMAGE_ENCODERS = {"regions": RegionTransformerEncoder, "pixels": PixelEncoder}
TEXT_ENCODERS = {"bow": BagOfWordsEncoder, "gru": BiGRUEncoder,
                 "transformer": TransformerTextEncoder, "bert": BertTextEncoder}


def build_image_encoder(kind: str, **kwargs) -> nn.Module:
    """kind "regions" (kwargs region_dim, hidden, ...) or "pixels" (model_name, pretrained, ...)."""
    if kind not in IMAGE_ENCODERS:
        raise ValueError(f"unknown image encoder {kind!r}; valid kinds: {sorted(IMAGE_ENCODERS)}")
    return IMAGE_ENCODERS[kind](**kwargs)


def build_text_encoder(kind: str, vocab_size: int, **kwargs) -> nn.Module:
    """kind "bow", "gru", "transformer" or "bert"; vocab_size = len(tokenizer)."""
    if kind not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoder {kind!r}; valid kinds: {sorted(TEXT_ENCODERS)}")
    return TEXT_ENCODERS[kind](vocab_size, **kwargs)
