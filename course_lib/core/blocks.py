"""The blocks every transformer in the course shares: a pre-LN block (nanoGPT's, with a padding
mask), a stack that can hand back every layer's states (HiVLP's early outputs read them), and
UNITER's input embeddings. The block computes torch's `nn.TransformerEncoderLayer(norm_first=True,
activation="gelu", dim_feedforward=4H)` as an explicit loop a learner can read (test_blocks)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    """Multi-head self-attention over a padded sequence; padded keys get no attention."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, L, H = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.heads, H // self.heads)  # (B, L, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, h, L, d)
        keep = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, L) True = attend
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))  # (B, L, H)


class Block(nn.Module):
    """Pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x)), MLP = 4H with GELU."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * hidden, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), mask))  # (B, L, H)
        return x + self.drop(self.mlp(self.ln_2(x)))  # (B, L, H)


class Transformer(nn.Module):
    """`layers` Blocks and a final LayerNorm (pre-LN leaves the residual unnormalised): x (B, L, H),
    mask (B, L) True = real -> (B, L, H); return_layers=True adds each block's output after ln_f."""

    def __init__(self, hidden: int, layers: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                return_layers: bool = False):
        states = []
        for block in self.blocks:
            x = block(x, mask)  # (B, L, H)
            if return_layers:
                states.append(self.ln_f(x))
        return (self.ln_f(x), states) if return_layers else self.ln_f(x)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real positions: (B, L, H), (B, L) True/1 = real -> (B, H); none real -> 0."""
    weights = mask.unsqueeze(-1).to(x.dtype)  # (B, L, 1)
    return (x * weights).sum(1) / weights.sum(1).clamp(min=1)


class RegionEmbedding(nn.Module):
    """UNITER's LN(Linear(feature)) + LN(Linear(box)) (§3.1): (B, R, D), (B, R, 7) -> (B, R, H).
    The box (x1, y1, x2, y2, w, h, area) is the only position information (regions are a set)."""

    def __init__(self, region_dim: int, hidden: int, box_dim: int = 7):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(region_dim, hidden), nn.LayerNorm(hidden))
        self.box = nn.Sequential(nn.Linear(box_dim, hidden), nn.LayerNorm(hidden))

    def forward(self, regions: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        return self.feature(regions) + self.box(boxes)  # (B, R, H)


class JointEmbedding(nn.Module):
    """UNITER's input embeddings, which a single-stream model concatenates (U-BERT eq. 2, 10); the
    base class of the cross-encoder and U-BERT. Subclasses call `_init_tables()` after building
    their layers: BERT's N(0, 0.02), as torch's N(0, 1) slowed the start of training."""

    def __init__(self, region_dim: int, vocab_size: int, hidden: int, max_text_length: int,
                 box_dim: int = 7, pad_token_id: int = 0):
        super().__init__()
        self.pad_token_id, self.max_text_length = pad_token_id, max_text_length
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=pad_token_id)
        self.position = nn.Embedding(max_text_length, hidden)  # words only: boxes place the regions
        self.token_type = nn.Embedding(2, hidden)  # 0 text, 1 region ("type" is nn.Module.type)
        self.text_norm = nn.LayerNorm(hidden)
        self.region = RegionEmbedding(region_dim, hidden, box_dim)
        self.image_norm = nn.LayerNorm(hidden)

    def _init_tables(self) -> None:
        for table in (self.word, self.position, self.token_type):
            nn.init.normal_(table.weight, std=0.02)
        with torch.no_grad():
            self.word.weight[self.pad_token_id].zero_()  # as nn.Embedding(padding_idx=) leaves it

    def embed_text(self, texts: dict) -> torch.Tensor:
        """t_i = LN(word + position + type(0)): (B, T) ids -> (B, T, H)."""
        input_ids = texts["input_ids"]  # (B, T)
        T = input_ids.shape[1]
        if T > self.max_text_length:
            raise ValueError(f"captions of {T} tokens exceed max_text_length="
                             f"{self.max_text_length}: tokenise with max_length=that")
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        return self.text_norm(self.word(input_ids) + self.position(positions)
                              + self.token_type.weight[0])

    def embed_image(self, images: dict) -> torch.Tensor:
        """r_i = LN(RegionEmbedding(feature, box) + type(1)): (B, R, D), (B, R, 7) -> (B, R, H)."""
        return self.image_norm(self.region(images["regions"], images["boxes"])
                               + self.token_type.weight[1])
