"""Hard negatives for the cross-encoder's binary ITM, mined from a dual encoder (ALBEF's scheme):
the top-k non-matches of its train-split similarity (`mine_negatives`; VSE++'s read in chunks
from its two embedding matrices, `dual_encoder_miner`). Hard negatives teach what random ones
cannot: two scenes that share most objects differ in the one attribute or relation the caption
names, and only such a negative makes the model look at it.
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
    """A dual encoder's similarity matrix kept factored: image_emb @ text_emb.T, never formed.

    The default train split's full matrix is 10k x 50k float32 = 2 GB; the two factors are 15 MB,
    and `mine_negatives` reads them a chunk of rows at a time."""

    image_emb: torch.Tensor  # (n_images, E)
    text_emb: torch.Tensor  # (n_texts, E)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.image_emb), len(self.text_emb)  # (n_images, n_texts), as the matrix's


def _top_k_excluding(rows: Callable[[int, int], torch.Tensor], n_rows: int,
                     is_match: Callable[[int, int], torch.Tensor], k: int) -> torch.Tensor:
    """Per row of a (n_rows, m) score matrix the k best columns that are not a match, chunk by
    chunk: rows(start, stop) gives the (stop - start, m) scores of those rows. -> (n_rows, k)"""
    out = []
    for start in range(0, n_rows, _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, n_rows)
        block = rows(start, stop).float().masked_fill(is_match(start, stop), float("-inf"))
        out.append(block.topk(k, dim=1).indices)
    return torch.cat(out)


def _as_cpu_tensor(x) -> torch.Tensor:
    return x.detach().cpu() if torch.is_tensor(x) else torch.from_numpy(np.asarray(x))


def mine_negatives(similarity, txt2img, k: int = 16) -> MinedNegatives:
    """Hard-negative candidates from a dual encoder's similarity matrix (n_images, n_texts), or
    from its two embedding matrices (a `DualEmbeddings`: see `mine_negatives_from_embeddings`).

    A text's own image and an image's own captions are never candidates. The lists are sampled
    afresh at every step (`ITMCollate`), so a caption meets several of its hard negatives, not one
    fixed one; one may still be true of its pair (method.py's docstring).
    """
    if isinstance(similarity, DualEmbeddings):
        return mine_negatives_from_embeddings(similarity.image_emb, similarity.text_emb, txt2img, k)
    sims = _as_cpu_tensor(similarity)  # (N, T)
    return _mine(lambda a, b: sims.T[a:b], lambda a, b: sims[a:b], sims.shape, txt2img, k)


def mine_negatives_from_embeddings(image_emb, text_emb, txt2img, k: int = 16) -> MinedNegatives:
    """`mine_negatives` of the matrix image_emb @ text_emb.T without forming it: each chunk of
    rows is one matrix product, so memory is a chunk (1024 x 50k floats = 200 MB at most on the
    default train split), not the 2 GB matrix. image_emb (N, E), text_emb (T, E)."""
    image_emb, text_emb = _as_cpu_tensor(image_emb).float(), _as_cpu_tensor(text_emb).float()
    return _mine(lambda a, b: text_emb[a:b] @ image_emb.T,  # (b - a, N): texts against images
                 lambda a, b: image_emb[a:b] @ text_emb.T,  # (b - a, T): images against texts
                 (len(image_emb), len(text_emb)), txt2img, k)


def _mine(text_rows, image_rows, shape, txt2img, k: int) -> MinedNegatives:
    """The mining both entry points share: text_rows(a, b) (b - a, N) and image_rows(a, b)
    (b - a, T) give rows of the similarity's transpose and of the similarity itself."""
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
    """The `miner(bench, tokenizer, cache_dir)` that `CrossEncoderMethod` takes, from a dual
    encoder method (anything with fit(bench, tokenizer, cache_dir) and similarity(split), e.g.
    `VsePPMethod()`): it fits the method (or loads it from cache_dir) and returns its train-split
    similarity for `mine_negatives`. A VSE++ `DualEncoder` gives its two embedding matrices
    (`DualEmbeddings`, same ranking, 15 MB instead of the 2 GB matrix); any other method its
    `similarity(bench["train"])`.
    """
    from course_lib.methods.encoding import encode_split
    from course_lib.methods.vsepp import DualEncoder

    def miner(bench, tokenizer, cache_dir=None):
        dual_method.fit(bench, tokenizer, cache_dir)
        split = bench["train"]
        model = getattr(dual_method, "model", None)
        if isinstance(model, DualEncoder) and getattr(dual_method, "tokenizer", None) is not None:
            return DualEmbeddings(*encode_split(model, split, dual_method.tokenizer))
        return dual_method.similarity(split)  # (n_images, n_texts)

    # CrossEncoderMethod names its checkpoint after the miner's __qualname__ and its method's own
    # checkpoint: another dual encoder (its config, data or code) must give another cross-encoder
    miner.__qualname__ = (f"dual_encoder_miner({type(dual_method).__name__}, "
                          f"{getattr(dual_method, 'config', None)!r})")
    miner.method = dual_method
    return miner
