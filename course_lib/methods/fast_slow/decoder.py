"""The captioning decoders of Fast & Slow's Slow model (Miech et al. 2021, §3.1, after VirTex):
pre-LN blocks of masked self-attention, cross-attention to the visual tokens and an MLP, and the
summed log-likelihood h(x, y) = h_fwd + h_bwd of a caption read both ways (eq. 1-3).

    tokens (B, M, H)  ->  Decoder.keys_values: per block the cross-attention's (2, B, h, M, d),
                          which depend on the image only (a gallery's are cached offline)
    words  (B, L, H)  ->  Decoder(x, kvs) -> (B, L, H)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import SelfAttention
from course_lib.core.encoders import word_mask
from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens


class CausalSelfAttention(SelfAttention):
    """Masked multi-head self-attention; with right padding no real position sees a padded one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, H = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.heads, H // self.heads)  # (B, L, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, h, L, d) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))


class CrossAttention(nn.Module):
    """Text queries (B, L, H) attend to the visual tokens' keys_values (2, B, h, M, d)."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q, self.kv = nn.Linear(hidden, hidden), nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def keys_values(self, tokens: torch.Tensor) -> torch.Tensor:
        B, M, H = tokens.shape
        return self.kv(tokens).view(B, M, 2, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        B, L, H = x.shape
        q = self.q(x).view(B, L, self.heads, H // self.heads).transpose(1, 2)  # (B, h, L, d)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1],
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))


class DecoderBlock(nn.Module):
    """Pre-LN block (VirTex, §3.1): causal self-attention, cross-attention to K/V, MLP."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1, self.ln_2, self.ln_3 = (nn.LayerNorm(hidden) for _ in range(3))
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.cross = CrossAttention(hidden, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * hidden, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.cross(self.ln_2(x), kv))
        return x + self.drop(self.mlp(self.ln_3(x)))  # (B, L, H)


class Decoder(nn.Module):
    """DecoderBlocks and a final LayerNorm; keys_values -> one (2, B, h, M, d) per block."""

    def __init__(self, hidden: int, layers: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(DecoderBlock(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def keys_values(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        return [block.cross.keys_values(tokens) for block in self.blocks]

    def forward(self, x: torch.Tensor, kvs: list[torch.Tensor]) -> torch.Tensor:
        for block, kv in zip(self.blocks, kvs, strict=True):
            x = block(x, kv)
        return self.ln_f(x)


def reverse_words(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) [CLS] w1 .. wL [SEP] [PAD].. -> [CLS] wL .. w1 [SEP] [PAD].., the backward input."""
    B, T = input_ids.shape
    lengths = attention_mask.long().sum(1, keepdim=True)  # (B, 1): [CLS] + L words + [SEP]
    positions = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
    inside = (positions >= 1) & (positions <= lengths - 2)  # the word positions 1..L
    source = torch.where(inside, lengths - 1 - positions, positions)  # word p <- word L + 1 - p
    return input_ids.gather(1, source)


def summed_log_likelihood(forward_logits: torch.Tensor, backward_logits: torch.Tensor,
                          input_ids: torch.Tensor, reversed_ids: torch.Tensor,
                          attention_mask: torch.Tensor,
                          special: SpecialTokens = WORD_SPECIAL_TOKENS) -> torch.Tensor:
    """h(x, y) = h_fwd + h_bwd (eq. 2-3) -> (B,) from logits (B, T, V), position t predicting token
    t + 1: log p summed over the words only, not length-normalised."""
    words = word_mask(input_ids, attention_mask, special)[:, 1:].float()  # (B, T-1) word targets
    total = 0.0
    for logits, ids in ((forward_logits, input_ids), (backward_logits, reversed_ids)):
        logits = logits[:, :-1].float()  # (B, T-1, V)
        # log p of the next token (B, T-1), without a second (B, T-1, V) tensor of log-probabilities
        target = logits.gather(2, ids[:, 1:, None]).squeeze(2) - torch.logsumexp(logits, dim=-1)
        total = total + (target * words).sum(1)
    return total
