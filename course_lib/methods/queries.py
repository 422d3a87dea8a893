"""A ranking's queries and answers, the same for every Method: the two directions, the query
indices of a split, which listed items are ground truth, and each row's top k."""

from __future__ import annotations

import numpy as np
import torch

from course_lib.core.metrics import checked_queries

DIRECTIONS = ("t2i", "i2t")
TopK = tuple[torch.Tensor, torch.Tensor]  # (indices (Q, k) long, scores (Q, k)), best first


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS} (t2i: captions query images; "
                         f"i2t: images query captions), got {direction!r}")
    return direction


def query_indices(split, direction: str, queries=None) -> np.ndarray:
    """`queries` if given (checked), else the split's text_queries (t2i) or image_queries (i2t)."""
    t2i = check_direction(direction) == "t2i"
    if queries is None:
        return split.text_queries if t2i else split.image_queries
    return checked_queries(queries, split.n_texts if t2i else split.n_images,
                           f"{direction} queries")


def ground_truth(split, direction: str, queries, indices) -> torch.Tensor:
    """(Q, k) bool: which listed items (indices (Q, k) from rank) are a query's ground truth."""
    txt2img = torch.from_numpy(split.txt2img)
    queries, indices = torch.as_tensor(np.asarray(queries)), torch.as_tensor(np.asarray(indices))
    return (indices == txt2img[queries][:, None] if direction == "t2i"
            else txt2img[indices] == queries[:, None])


def checked_pairs(image_indices, text_indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (P,) long tensors of aligned pair indices, or a clear error."""
    images = torch.as_tensor(np.asarray(image_indices), dtype=torch.long)  # (P,)
    texts = torch.as_tensor(np.asarray(text_indices), dtype=torch.long)  # (P,)
    if images.shape != texts.shape or images.ndim != 1:
        raise ValueError("image_indices and text_indices must be two (P,) vectors of pairs, got "
                         f"shapes {tuple(images.shape)} and {tuple(texts.shape)}")
    return images, texts


def by_caption_length(text_lengths) -> torch.Tensor:
    """Positions (P,) of P pairs, shortest caption first (text_lengths (P,)): cut into blocks in
    this order, a block pads to its longest caption and like lengths pad least."""
    return torch.argsort(torch.as_tensor(text_lengths), stable=True)


def length_blocks(text_lengths: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """by_caption_length's positions in blocks of batch_size, each (b,)."""
    order = by_caption_length(text_lengths)  # (P,)
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def top_k_of(scores: torch.Tensor, top_k: int) -> TopK:
    """(indices, scores) of each row's top_k, best first; top_k capped at the row length."""
    top = torch.topk(scores.float(), min(top_k, scores.shape[1]), dim=1)
    return top.indices, top.values
