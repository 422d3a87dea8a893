"""Retrieval metrics: Recall@K, median rank, rsum and AR, exactly as VSE++ / SCAN / LightningDOT.

Input: similarities `sims` (n_images, n_texts) and `txt2img` (n_texts,), each text's image. An
image's i2t rank is its best caption's; a text's t2i rank is its true image's. Ranks are 0-based:
R@K = 100 * mean(rank < K), medr = floor(median(rank)) + 1, meanr = mean(rank) + 1, rsum = the sum
of all recalls, ar their mean. Ties count pessimistically: a rank counts the *wrong* candidates
scoring *at least as high*, so a model scoring every pair the same gets R@K 0, not 100. Ranks are
counts over chunks of image rows (no sort), so a torch tensor stays on its device. The full
setting (LightningDOT §4.3; docs/data.md) ranks only `query_texts` / `query_images`."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import numpy as np
import torch

_CHUNK_ELEMENTS = 1 << 23  # per chunk: a few boolean temporaries of 8 MB each


def _as_tensor(sims) -> torch.Tensor:
    """A real-valued 2-D torch view of `sims` (numpy arrays are shared, not copied)."""
    if isinstance(sims, np.ndarray):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writ")  # read-only: we only read
            try:
                tensor = torch.from_numpy(sims)
            except (TypeError, ValueError):  # negative strides or non-native byte order: copy
                try:
                    native = sims.dtype.newbyteorder("=")
                    tensor = torch.from_numpy(np.ascontiguousarray(sims, native))
                except (TypeError, ValueError) as err:
                    raise TypeError(f"sims has dtype {sims.dtype}, which torch cannot read; "
                                    "pass a float array, e.g. sims.astype(np.float32)") from err
    elif isinstance(sims, torch.Tensor):
        tensor = sims.detach()
    else:
        raise TypeError(f"sims must be a numpy array or a torch tensor, not "
                        f"{type(sims).__name__}; wrap it with np.asarray(...)")
    if tensor.dim() != 2:
        raise ValueError(f"sims must be 2-D (n_images, n_texts), got shape {tuple(tensor.shape)}; "
                         "score every image against every text, e.g. sims = img_emb @ txt_emb.T")
    if not tensor.is_floating_point():
        raise TypeError(f"sims must hold floating-point scores, got dtype {tensor.dtype}; "
                        "cast it first, e.g. sims.astype(np.float32) or sims.float()")
    return tensor


def _check_txt2img(txt2img, n_images: int, n_texts: int,
                   every_image_captioned: bool = True) -> np.ndarray:
    """`txt2img` as an int64 numpy vector, after checking it can index the gallery."""
    txt2img = np.asarray(txt2img.detach().cpu() if torch.is_tensor(txt2img) else txt2img)
    if txt2img.ndim != 1 or not np.issubdtype(txt2img.dtype, np.integer):
        raise ValueError(f"txt2img must be a 1-D integer array (the image index of each text), "
                         f"got shape {txt2img.shape} and dtype {txt2img.dtype}")
    if len(txt2img) != n_texts:
        raise ValueError(f"txt2img has {len(txt2img)} entries but sims has {n_texts} texts "
                         "(columns): sims must be (n_images, n_texts), transpose it if not")
    if n_texts and (txt2img.min() < 0 or txt2img.max() >= n_images):
        raise ValueError(f"txt2img values must lie in [0, {n_images}), got min {txt2img.min()} "
                         f"and max {txt2img.max()}; map image ids to row positions of sims")
    lonely = np.flatnonzero(np.bincount(txt2img, minlength=n_images) == 0)  # uncaptioned images
    if every_image_captioned and len(lonely):
        raise ValueError(f"{len(lonely)} image(s) have no caption (first: {lonely[:5].tolist()}), "
                         "so their i2t rank is undefined; drop their rows or add captions")
    return txt2img.astype(np.int64)


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks:
        raise ValueError("ks is empty; pass at least one cut-off, e.g. ks=(1, 5, 10)")
    if min(ks) < 1:
        raise ValueError(f"every K in ks must be >= 1, got {ks}")
    return ks


def checked_queries(queries, n: int, label: str) -> np.ndarray | None:
    """Query indices as an int64 vector checked against n items, or None (= all)."""
    if queries is None:
        return None
    queries = np.asarray(queries.detach().cpu() if torch.is_tensor(queries) else queries)
    if queries.ndim != 1 or (len(queries) and not np.issubdtype(queries.dtype, np.integer)):
        raise ValueError(f"{label} must be a 1-D vector of indices, got shape {queries.shape}")
    if len(queries) and (queries.min() < 0 or queries.max() >= n):
        raise ValueError(f"{label} must index [0, {n}), got {queries.min()}..{queries.max()}")
    return queries.astype(np.int64)


def t2i_ranks(sims, txt2img, *, chunk_size: int | None = None, query_texts=None) -> np.ndarray:
    """(n_texts,) or (len(query_texts),) 0-based ranks of each query text's true image. Unlike
    `retrieval_ranks`, images need no captions: a *sample* of queries can rank a whole gallery."""
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts, every_image_captioned=False)
    columns = checked_queries(query_texts, n_texts, "query_texts")
    every = columns is None  # then no column is gathered (copied): the common, large case
    columns = np.arange(n_texts) if every else columns
    chunk_size = _chunk_rows(chunk_size, len(columns))
    cols = torch.from_numpy(columns).to(scores.device)  # (Q,)
    true_scores = scores[torch.from_numpy(txt2img[columns]).to(scores.device), cols]  # (Q,)
    ranks = torch.full_like(cols, -1, dtype=torch.int64)  # (Q,); -1: the true image counts itself
    for start in range(0, n_images, chunk_size):
        block = scores[start:start + chunk_size]  # (c, T)
        if torch.isnan(block).any():
            row = start + int(torch.isnan(block).any(dim=1).nonzero()[0, 0])
            raise ValueError(f"sims contains NaN (first in image row {row}); fix the model or data "
                             "(e.g. normalise with eps, or torch.nan_to_num if it is masking)")
        ranks += ((block if every else block[:, cols]) >= true_scores[None, :]).sum(0)  # (Q,)
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


def retrieval_ranks(sims, txt2img, *, chunk_size: int | None = None, query_texts=None,
                    query_images=None) -> tuple[np.ndarray, np.ndarray]:
    """0-based ranks (i2t (n_images,), t2i (n_texts,)), or of the queries given."""
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts)
    rows = checked_queries(query_images, n_images, "query_images")
    every_row = rows is None  # then blocks are views (slices), not gathered copies
    rows = np.arange(n_images) if every_row else rows
    chunk_size = _chunk_rows(chunk_size, n_texts)
    t2i = t2i_ranks(scores, txt2img, chunk_size=chunk_size, query_texts=query_texts)  # (Q_t,)
    device = scores.device
    text_image = torch.from_numpy(txt2img).to(device)  # (T,)
    true_t2i = scores[text_image, torch.arange(n_texts, device=device)]  # (T,)
    # an image's i2t rank is its best-scoring caption's (include_self=False: every image has one)
    best_i2t = torch.zeros(n_images, dtype=scores.dtype, device=device).scatter_reduce(
        0, text_image, true_t2i, reduce="amax", include_self=False)  # (N,)
    # own captions tied with the best one are not "wrong candidates": subtract them from the count
    own_at_best = torch.zeros(n_images, dtype=torch.int64, device=device).scatter_add_(
        0, text_image, (true_t2i == best_i2t[text_image]).long())  # (N,)
    rows_t = torch.from_numpy(rows).to(device)  # (Q_i,)
    i2t = torch.empty(len(rows), dtype=torch.int64, device=device)  # (Q_i,)
    for start in range(0, len(rows), chunk_size):
        picked = rows_t[start:start + chunk_size]  # (c,)
        block = scores[start:start + chunk_size] if every_row else scores[picked]  # (c, T)
        at_least = (block >= best_i2t[picked, None]).sum(1)  # (c,)
        i2t[start:start + len(picked)] = at_least - own_at_best[picked]
    return i2t.cpu().numpy(), t2i


def ranks_from_top_k(scores, is_true) -> np.ndarray:
    """0-based ranks, pessimistic on ties, from each query's top-k: scores (Q, k) best first,
    is_true (Q, k) bool. k when no truth made the list. Equals `retrieval_ranks` whenever the rank
    is below k and no wrong item outside the list ties the truth."""
    scores = torch.as_tensor(np.asarray(scores) if not torch.is_tensor(scores) else scores).float()
    is_true = torch.as_tensor(is_true if torch.is_tensor(is_true) else np.asarray(is_true)).bool()
    if scores.shape != is_true.shape or scores.dim() != 2:
        raise ValueError(f"scores {tuple(scores.shape)} and is_true {tuple(is_true.shape)} must "
                         "both be (Q, k)")
    best_true = scores.masked_fill(~is_true, float("-inf")).max(dim=1).values  # (Q,)
    wrong_ahead = ((scores >= best_true[:, None]) & ~is_true).sum(1)  # (Q,)
    return wrong_ahead.masked_fill(~is_true.any(dim=1), scores.shape[1]).numpy()  # none found: k


def metrics_from_ranks(i2t_ranks, t2i_ranks, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """The metric dict (the module docstring's keys) from 0-based rank vectors."""
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
                      chunk_size: int | None = None, t2i_sims=None, query_texts=None,
                      query_images=None) -> dict[str, float]:
    """{i2t_r{k}, t2i_r{k} (percent), i2t_medr, t2i_medr, i2t_meanr, t2i_meanr, rsum, ar} of sims
    (n_images, n_texts), numpy or torch; every image needs >= 1 caption. t2i_sims: other scores
    of the same shape for text->image (a two-stage method re-ranks each direction apart)."""
    i2t, t2i = retrieval_ranks(sims, txt2img, chunk_size=chunk_size, query_texts=query_texts,
                               query_images=query_images)
    if t2i_sims is not None:
        if tuple(t2i_sims.shape) != tuple(sims.shape):
            raise ValueError(f"t2i_sims has shape {tuple(t2i_sims.shape)}, sims "
                             f"{tuple(sims.shape)}: both must be (n_images, n_texts)")
        t2i = t2i_ranks(t2i_sims, txt2img, query_texts=query_texts)
    return metrics_from_ranks(i2t, t2i, ks)


def coco_1k_metrics(sims, txt2img, n_folds: int = 5, ks: Sequence[int] = (1, 5, 10), *,
                    chunk_size: int | None = None) -> dict[str, float]:
    """COCO 1K: retrieval_metrics averaged over n_folds sequential folds of images and their
    captions (as VSE++); rsum and ar recomputed from the averaged recalls."""
    ks = _check_ks(ks)
    scores = _as_tensor(sims)  # (N, T)
    n_images, n_texts = scores.shape
    txt2img = _check_txt2img(txt2img, n_images, n_texts)
    if n_folds < 1 or n_images % n_folds:
        raise ValueError(f"n_images = {n_images} must split into n_folds = {n_folds} equal "
                         "folds; use n_folds=5 on the 5,000-image COCO test")
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


def hit_probability(pool: np.ndarray, good: np.ndarray, k) -> np.ndarray:
    """P(one of `good` items lands in the first k of `pool` shuffled) = 1 - C(pool - good, k) /
    C(pool, k), as a product of k ratios (no overflow). k: int or per row (k <= 0: 0)."""
    pool, good = np.asarray(pool, dtype=np.float64), np.asarray(good, dtype=np.float64)
    k = np.asarray(k, dtype=np.int64)
    miss = np.ones(np.broadcast(pool, good, k).shape)
    for t in range(int(k.max(initial=0))):
        num, den = pool - good - t, pool - t
        miss *= np.where(t < k, np.where(num > 0, num / np.maximum(den, 1.0), 0.0), 1.0)
    return np.where((good > 0) & (k > 0), 1.0 - miss, 0.0)


def expected_hits(image_vectors, text_vectors, txt2img, k: int, direction: str = "t2i",
                  queries=None, chunk: int = 256) -> np.ndarray:
    """(Q,) each query's chance that its truth is in the top k, ties broken at random, for dot
    products of image_vectors (N, D) and text_vectors (T, D): the expected recall of a ranker whose
    scores tie often. i2t: an image's best own caption (own captions tied with it count). Scores
    are rounded to 1e-9, so sums equal up to rounding tie."""
    images, texts = (np.asarray(v, dtype=np.float64) for v in (image_vectors, text_vectors))
    txt2img = np.asarray(txt2img, dtype=np.int64)
    if images.ndim != 2 or texts.ndim != 2 or images.shape[1] != texts.shape[1]:
        raise ValueError(f"need (N, D) image and (T, D) text vectors of one width, got "
                         f"{images.shape} and {texts.shape}")
    if direction not in ("t2i", "i2t"):
        raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")
    n_queries = len(texts) if direction == "t2i" else len(images)
    queries = np.arange(n_queries) if queries is None else np.asarray(queries)
    out = np.empty(len(queries))
    for start in range(0, len(queries), chunk):
        rows = queries[start:start + chunk]
        if direction == "t2i":
            scores = np.round(texts[rows] @ images.T, 9)  # (q, N)
            best = scores[np.arange(len(rows)), txt2img[rows]][:, None]  # (q, 1) true image's
            good = np.ones(len(rows))
        else:
            scores = np.round(images[rows] @ texts.T, 9)  # (q, T)
            own = txt2img[None, :] == rows[:, None]  # (q, T)
            best = np.where(own, scores, -np.inf).max(axis=1, keepdims=True)  # (q, 1) best own
            good = (own & (scores == best)).sum(axis=1)
        ahead, tied = (scores > best).sum(axis=1), (scores == best).sum(axis=1)
        out[start:start + len(rows)] = hit_probability(tied, good, k - ahead)
    return out


def format_metrics(m: dict[str, float]) -> str:
    """One line for a notebook: 'i2t R@1/5/10 52.1/80.3/88.9 medr 1 | t2i ... | rsum 410 AR 68'."""
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
    tail = " ".join(f"{label} {m[key]:.1f}" for key, label in (("rsum", "rsum"), ("ar", "AR"))
                    if key in m)
    return " | ".join(parts + ([tail] if tail else []))
