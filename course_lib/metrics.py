"""Retrieval metrics: Recall@K, median rank, rsum and AR, exactly as VSE++ / SCAN / LightningDOT.

The input is a similarity matrix `sims[n_images, n_texts]` and `txt2img[n_texts]`, the image of
each text. Image-to-text ("i2t", text retrieval): an image's rank is the best rank among all of its
ground-truth captions. Text-to-image ("t2i", image retrieval): a text's rank is the rank of its one
true image. Ranks are 0-based; `R@K = 100 * mean(rank < K)`; `medr = floor(median(rank)) + 1`;
`meanr = mean(rank) + 1`; `rsum` is the sum of all the recalls and `ar` their mean (LightningDOT's
average recall).

Ties are counted optimistically: the rank of a true item is the number of candidates with a
*strictly greater* score, so a tie with a wrong candidate does not cost the true one. (An argsort
protocol breaks ties by position instead; the two agree whenever scores are distinct.)

Nothing here sorts the matrix. A rank is a count, `(scores > true_score).sum()`, computed over
chunks of image rows, so a 5k x 25k matrix needs only a few tens of MB beyond itself, and a torch
tensor stays on its own device (only the small rank vectors come back to the CPU).
"""

from __future__ import annotations

import re
import warnings
from typing import Sequence

import numpy as np
import torch

# Elements per chunk: each chunk makes a few boolean temporaries of this size (8 MB each).
_CHUNK_ELEMENTS = 1 << 23


def _as_tensor(sims) -> torch.Tensor:
    """A real-valued 2-D torch view of `sims` (numpy arrays are shared, not copied)."""
    if isinstance(sims, np.ndarray):
        with warnings.catch_warnings():
            # torch warns that read-only arrays stay read-only; we only ever read them.
            warnings.filterwarnings("ignore", message=".*not writ")
            try:
                tensor = torch.from_numpy(sims)
            except (TypeError, ValueError):
                # Negative strides or non-native byte order: one contiguous copy is unavoidable.
                try:
                    tensor = torch.from_numpy(np.ascontiguousarray(sims, sims.dtype.newbyteorder("=")))
                except (TypeError, ValueError) as err:
                    raise TypeError(
                        f"sims has dtype {sims.dtype}, which torch cannot read; "
                        "pass a float array, e.g. sims.astype(np.float32)"
                    ) from err
    elif isinstance(sims, torch.Tensor):
        tensor = sims.detach()
    else:
        raise TypeError(
            f"sims must be a numpy array or a torch tensor, not {type(sims).__name__}; "
            "wrap it with np.asarray(...)"
        )
    if tensor.dim() != 2:
        raise ValueError(
            f"sims must be 2-D (n_images, n_texts), got shape {tuple(tensor.shape)}; "
            "score every image against every text, e.g. sims = img_emb @ txt_emb.T"
        )
    if not tensor.is_floating_point():
        raise TypeError(
            f"sims must hold floating-point scores, got dtype {tensor.dtype}; "
            "cast it first, e.g. sims.astype(np.float32) or sims.float()"
        )
    return tensor


def _check_txt2img(txt2img, n_images: int, n_texts: int, every_image_captioned: bool = True) -> np.ndarray:
    """`txt2img` as an int64 numpy vector, after checking it can index the gallery."""
    if isinstance(txt2img, torch.Tensor):
        txt2img = txt2img.detach().cpu().numpy()
    txt2img = np.asarray(txt2img)
    if txt2img.ndim != 1 or not np.issubdtype(txt2img.dtype, np.integer):
        raise ValueError(
            f"txt2img must be a 1-D integer array (the image index of each text), got shape "
            f"{txt2img.shape} and dtype {txt2img.dtype}"
        )
    if len(txt2img) != n_texts:
        raise ValueError(
            f"txt2img has {len(txt2img)} entries but sims has {n_texts} texts (columns); "
            "sims must be (n_images, n_texts) - transpose it if it is (n_texts, n_images)"
        )
    if n_texts and (txt2img.min() < 0 or txt2img.max() >= n_images):
        raise ValueError(
            f"txt2img values must lie in [0, {n_images}), got min {txt2img.min()} and max "
            f"{txt2img.max()}; map image ids to row positions of sims (0..n_images-1)"
        )
    captions_per_image = np.bincount(txt2img, minlength=n_images)  # (n_images,)
    lonely = np.flatnonzero(captions_per_image == 0)
    if every_image_captioned and len(lonely):
        raise ValueError(
            f"{len(lonely)} image(s) have no caption (first: {lonely[:5].tolist()}), so their "
            "i2t rank is undefined; drop those rows from sims or add their captions"
        )
    return txt2img.astype(np.int64)


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks:
        raise ValueError("ks is empty; pass at least one cut-off, e.g. ks=(1, 5, 10)")
    if min(ks) < 1:
        raise ValueError(f"every K in ks must be >= 1, got {ks}")
    return ks


def t2i_ranks(sims, txt2img, *, chunk_size: int | None = None) -> np.ndarray:
    """0-based rank of each text's true image, (n_texts,): images scoring strictly higher.

    Unlike `retrieval_ranks`, images need not have captions here, so it also scores a *sample* of
    text queries against a whole gallery (how the benchmark evaluates slow methods on big galleries).
    """
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts, every_image_captioned=False)
    chunk_size = _chunk_rows(chunk_size, n_texts)
    text_image = torch.from_numpy(txt2img).to(scores.device)  # (T,)
    true_scores = scores[text_image, torch.arange(n_texts, device=scores.device)]  # (T,)
    ranks = torch.zeros(n_texts, dtype=torch.int64, device=scores.device)  # (T,)
    for start in range(0, n_images, chunk_size):
        block = _checked_block(scores, start, chunk_size)  # (c, T)
        ranks += (block > true_scores[None, :]).sum(0)
    return ranks.cpu().numpy()


def recall_at_k(ranks, ks: Sequence[int] = (1, 5, 10)) -> dict[int, float]:
    """{k: 100 * mean(rank < k)} for 0-based ranks."""
    ranks = np.asarray(ranks)
    if ranks.size == 0:
        raise ValueError("no ranks: the similarity matrix is empty")
    return {k: 100.0 * float(np.mean(ranks < k)) for k in _check_ks(ks)}


def _chunk_rows(chunk_size: int | None, n_texts: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(n_texts, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


def _checked_block(scores: torch.Tensor, start: int, chunk_size: int) -> torch.Tensor:
    """Rows [start, start + chunk_size) of scores, after checking them for NaN."""
    block = scores[start:start + chunk_size]  # (c, T)
    if torch.isnan(block).any():
        row = start + int(torch.isnan(block).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"sims contains NaN (first in image row {row}); fix the model or data that "
            "produced it (e.g. normalise with eps, or torch.nan_to_num if it is masking)"
        )
    return block


def retrieval_ranks(sims, txt2img, *, chunk_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """0-based ranks `(i2t_ranks (n_images,), t2i_ranks (n_texts,))` under the module's protocol.

    `chunk_size` is the number of image rows scored at once (default: about 8M matrix elements
    per chunk); it changes memory use only, never the result.
    """
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts)
    chunk_size = _chunk_rows(chunk_size, n_texts)
    t2i = t2i_ranks(scores, txt2img, chunk_size=chunk_size)  # (T,)

    device = scores.device
    text_image = torch.from_numpy(txt2img).to(device)  # (T,)
    true_t2i = scores[text_image, torch.arange(n_texts, device=device)]  # (T,)
    # i2t: an image's best rank over its captions is the rank of its best-scoring caption,
    # because "number of strictly greater scores" only falls as the threshold rises.
    # include_self=False: the zeros are placeholders, every image has >= 1 caption (checked).
    best_i2t = torch.zeros(n_images, dtype=scores.dtype, device=device).scatter_reduce(
        0, text_image, true_t2i, reduce="amax", include_self=False)  # (N,)
    i2t = torch.empty(n_images, dtype=torch.int64, device=device)  # (N,)
    for start in range(0, n_images, chunk_size):
        block = scores[start:start + chunk_size]  # (c, T), NaN-checked by t2i_ranks
        i2t[start:start + len(block)] = (block > best_i2t[start:start + len(block), None]).sum(1)
    return i2t.cpu().numpy(), t2i


def metrics_from_ranks(i2t_ranks, t2i_ranks, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """The metric dict from 0-based rank vectors (see the module docstring for the keys)."""
    ks = _check_ks(ks)
    result: dict[str, float] = {}
    recalls = []
    for direction, ranks in (("i2t", np.asarray(i2t_ranks)), ("t2i", np.asarray(t2i_ranks))):
        for k, recall in recall_at_k(ranks, ks).items():
            result[f"{direction}_r{k}"] = recall
            recalls.append(recall)
        result[f"{direction}_medr"] = float(np.floor(np.median(ranks)) + 1)
        result[f"{direction}_meanr"] = float(np.mean(ranks) + 1)
    result["rsum"] = float(sum(recalls))
    result["ar"] = result["rsum"] / len(recalls)
    return result


def retrieval_metrics(sims, txt2img, ks: Sequence[int] = (1, 5, 10), *,
                      chunk_size: int | None = None, t2i_sims=None) -> dict[str, float]:
    """VSE++ retrieval metrics of a similarity matrix.

    sims: (n_images, n_texts), numpy or torch (any device, any real dtype); rows are images.
    txt2img: (n_texts,) integer index of each text's image; every image needs >= 1 caption (any
    number, not only 5).
    Returns `i2t_r{k}` and `t2i_r{k}` in percent for every k in ks (a k larger than the gallery
    gives 100), `i2t_medr`, `t2i_medr`, `i2t_meanr`, `t2i_meanr`, `rsum` (sum of the 2*len(ks)
    recalls) and `ar` (their mean). Ties count optimistically: rank = number of candidates with
    a strictly greater score. `chunk_size` (image rows per chunk) trades memory for nothing else.
    t2i_sims: other scores (same shape) for the text->image direction, when the two directions are
    scored differently (a two-stage method re-ranks each direction's own candidates).
    """
    ks = _check_ks(ks)
    i2t, t2i = retrieval_ranks(sims, txt2img, chunk_size=chunk_size)
    if t2i_sims is not None:
        if tuple(t2i_sims.shape) != tuple(sims.shape):
            raise ValueError(f"t2i_sims has shape {tuple(t2i_sims.shape)}, sims {tuple(sims.shape)}: "
                             "both must be (n_images, n_texts)")
        t2i = t2i_ranks(t2i_sims, txt2img)
    return metrics_from_ranks(i2t, t2i, ks)


def coco_1k_metrics(sims, txt2img, n_folds: int = 5, ks: Sequence[int] = (1, 5, 10), *,
                    chunk_size: int | None = None) -> dict[str, float]:
    """COCO 1K protocol: retrieval_metrics averaged over `n_folds` sequential folds of images.

    Fold f holds images [f*m, (f+1)*m) with m = n_images / n_folds, and exactly their captions.
    Recalls, medr and meanr are averaged over folds (as VSE++ does); rsum and ar are recomputed
    from the averaged recalls. On the 5K COCO test this is the "1K" number of the papers.
    """
    ks = _check_ks(ks)
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts)
    if n_folds < 1 or n_images % n_folds:
        raise ValueError(
            f"n_images = {n_images} must split into n_folds = {n_folds} equal folds; "
            "use n_folds=5 on the 5,000-image COCO test"
        )
    fold_size = n_images // n_folds
    per_fold = []
    for fold in range(n_folds):
        first = fold * fold_size
        text_idx = np.flatnonzero((txt2img >= first) & (txt2img < first + fold_size))  # (T_f,)
        fold_sims = scores[first:first + fold_size][:, torch.from_numpy(text_idx).to(scores.device)]
        per_fold.append(retrieval_metrics(fold_sims, txt2img[text_idx] - first, ks,
                                          chunk_size=chunk_size))
    averaged = {key: float(np.mean([m[key] for m in per_fold])) for key in per_fold[0]}
    recalls = [averaged[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks]
    averaged["rsum"] = float(sum(recalls))
    averaged["ar"] = averaged["rsum"] / len(recalls)
    return averaged


def format_metrics(m: dict[str, float]) -> str:
    """One line for a notebook, e.g. 'i2t R@1/5/10 52.1/80.3/88.9 medr 1 | t2i ... | rsum 410.2 AR 68.4'."""
    parts = []
    for direction in ("i2t", "t2i"):
        ks = sorted(int(match.group(1)) for key in m
                    if (match := re.fullmatch(rf"{direction}_r(\d+)", key)))
        if not ks:
            continue
        recalls = "/".join(f"{m[f'{direction}_r{k}']:.1f}" for k in ks)
        text = f"{direction} R@{'/'.join(map(str, ks))} {recalls}"
        if f"{direction}_medr" in m:
            text += f" medr {m[f'{direction}_medr']:g}"
        parts.append(text)
    tail = " ".join(f"{label} {m[key]:.1f}" for key, label in (("rsum", "rsum"), ("ar", "AR")) if key in m)
    return " | ".join(parts + ([tail] if tail else []))
