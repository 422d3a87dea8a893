"""Hard negatives for the cross-encoder's binary ITM, mined from a dual encoder (ALBEF's scheme):
the top-k non-matches of its train-split similarity. Two scenes sharing most objects differ in the
one attribute or relation the caption names: only such a negative makes the model look at it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_ROWS_PER_CHUNK = 1024  # rows of the similarity matrix masked at once while mining


@dataclass
class MinedNegatives:
    """Per text its top-k non-matching images, per image its top-k captions of other images."""

    images_for_text: torch.Tensor  # (n_texts, k) long, most similar first
    texts_for_image: torch.Tensor  # (n_images, k) long, most similar first


@dataclass
class DualEmbeddings:
    """A dual encoder's similarity image_emb @ text_emb.T kept factored (15 MB instead of 2 GB)."""

    image_emb: torch.Tensor  # (n_images, E)
    text_emb: torch.Tensor  # (n_texts, E)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.image_emb), len(self.text_emb)  # (n_images, n_texts), as the matrix's


def _top_k_excluding(rows: Callable[[int, int], torch.Tensor], n_rows: int,
                     is_match: Callable[[int, int], torch.Tensor], k: int) -> torch.Tensor:
    """(n_rows, k): per row the k best non-matching columns, rows(start, stop) a chunk at a time."""
    step = _ROWS_PER_CHUNK  # the last chunk's slices stop at n_rows
    return torch.cat([rows(a, a + step).float().masked_fill(is_match(a, a + step), float("-inf"))
                      .topk(k, dim=1).indices for a in range(0, n_rows, step)])


def _as_cpu_tensor(x) -> torch.Tensor:
    return x.detach().cpu() if torch.is_tensor(x) else torch.from_numpy(np.asarray(x))


def mine_negatives(similarity, txt2img, k: int = 16) -> MinedNegatives:
    """Hard-negative candidates from a (n_images, n_texts) similarity or a `DualEmbeddings`."""
    if isinstance(similarity, DualEmbeddings):
        return mine_negatives_from_embeddings(similarity.image_emb, similarity.text_emb, txt2img, k)
    sims = _as_cpu_tensor(similarity)  # (N, T)
    return _mine(lambda a, b: sims.T[a:b], lambda a, b: sims[a:b], sims.shape, txt2img, k)


def mine_negatives_from_embeddings(image_emb, text_emb, txt2img, k: int = 16) -> MinedNegatives:
    """`mine_negatives` of image_emb (N, E) @ text_emb (T, E).T, a chunk of rows at a time."""
    image_emb, text_emb = _as_cpu_tensor(image_emb).float(), _as_cpu_tensor(text_emb).float()
    return _mine(lambda a, b: text_emb[a:b] @ image_emb.T,  # (b - a, N): texts against images
                 lambda a, b: image_emb[a:b] @ text_emb.T,  # (b - a, T): images against texts
                 (len(image_emb), len(text_emb)), txt2img, k)


def _mine(text_rows, image_rows, shape, txt2img, k: int) -> MinedNegatives:
    """text_rows(a, b) -> (b - a, N), image_rows(a, b) -> (b - a, T): rows of the similarity."""
    txt2img = torch.as_tensor(np.asarray(txt2img), dtype=torch.long)  # (T,)
    n_images, n_texts = shape
    if len(txt2img) != n_texts:
        raise ValueError(f"txt2img has {len(txt2img)} captions but the similarity {n_texts}")
    own_count = int(torch.bincount(txt2img, minlength=n_images).max())
    if not 1 <= k <= min(n_images - 1, n_texts - own_count):
        raise ValueError(f"k={k} must be in [1, {min(n_images - 1, n_texts - own_count)}]: there "
                         f"are only {n_images} images and {n_texts} captions")
    image_ids = torch.arange(n_images)
    images_for_text = _top_k_excluding(  # rows = texts; a text's own image is masked
        text_rows, n_texts, lambda a, b: image_ids[None, :] == txt2img[a:b, None], k)
    texts_for_image = _top_k_excluding(  # rows = images; every caption of the image is masked
        image_rows, n_images, lambda a, b: txt2img[None, :] == image_ids[a:b, None], k)
    return MinedNegatives(images_for_text, texts_for_image)


def dual_encoder_miner(dual_method) -> Callable:
    """A `miner(bench, tokenizer, cache_dir)` returning a fitted dual encoder's train similarity."""
    from course_lib.methods.encoding import encode_split
    from course_lib.methods.vsepp import DualEncoder

    def miner(bench, tokenizer, cache_dir=None):
        dual_method.fit(bench, tokenizer, cache_dir)
        split = bench["train"]
        model = getattr(dual_method, "model", None)
        if isinstance(model, DualEncoder) and getattr(dual_method, "tokenizer", None) is not None:
            return DualEmbeddings(*encode_split(model, split, dual_method.tokenizer))
        return dual_method.similarity(split)  # (n_images, n_texts)

    # the cross-encoder's checkpoint name reads this: another dual encoder, another model
    miner.__qualname__ = (f"dual_encoder_miner({type(dual_method).__name__}, "
                          f"{getattr(dual_method, 'config', None)!r})")
    miner.method = dual_method
    return miner
