"""A split's embeddings for any model with `encode_images(batch)` / `encode_texts(batch)` -> (B, E)
and a `modality` ("regions" or "pixels", the image field the datasets must provide)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset
from tqdm.auto import tqdm

from course_lib.core.checkpoints import inference
from course_lib.core.metrics import retrieval_metrics
from course_lib.data.datasets import CaptionDataset, ImageDataset, make_loader

_PROGRESS_ITEMS = 20_000  # splits with more items than this get a progress bar while encoded


def encode_batches(model: nn.Module, loader, encode, device=None, progress: bool = False,
                   desc: str = "") -> list:
    """[encode(batch)] of a loader's batches on the model's device, under checkpoints.inference."""
    with inference(model, device) as device:
        return [encode({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
                for batch in tqdm(loader, desc=desc, disable=not progress, leave=False)]


def subset_of(dataset, indices):
    """The dataset, or only the items at `indices` (in that order)."""
    return dataset if indices is None else Subset(dataset, [int(i) for i in indices])


def encode_gallery(model: nn.Module, split, *, batch_size: int = 256, device=None,
                   progress: bool | None = None, indices=None) -> torch.Tensor:
    """(N, E) image embeddings of a split (or its `indices`), on the CPU; progress None: if big."""
    images = subset_of(ImageDataset(split, modality=model.modality), indices)
    progress = split.n_images > _PROGRESS_ITEMS if progress is None else progress
    return torch.cat(encode_batches(model, make_loader(images, batch_size),
                                    lambda batch: model.encode_images(batch).float().cpu(),
                                    device, progress, "encode images"))  # (N, E)


def encode_captions(model: nn.Module, split, tokenizer, *, batch_size: int = 256, device=None,
                    progress: bool | None = None, indices=None) -> torch.Tensor:
    """(T, E) caption embeddings of a split (or its captions at `indices`), as encode_gallery."""
    chosen = np.asarray(np.arange(split.n_texts) if indices is None else indices, dtype=np.int64)
    # batches of like lengths, longest first: a batch pads to its longest caption
    order = np.argsort([-len(split.captions[t]) for t in chosen], kind="stable")  # (T,)
    loader = make_loader(subset_of(CaptionDataset(split), chosen[order]), batch_size,
                         tokenizer=tokenizer)
    progress = split.n_texts > _PROGRESS_ITEMS if progress is None else progress
    embeddings = torch.cat(encode_batches(model, loader,
                                          lambda batch: model.encode_texts(batch).float().cpu(),
                                          device, progress, "encode texts"))  # (T, E) sorted
    return embeddings[torch.from_numpy(np.argsort(order))]


def encode_split(model: nn.Module, split, tokenizer, *, batch_size: int = 256, device=None,
                 progress: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb (N, E), text_emb (T, E)) of a split, on the CPU (progress as above)."""
    kwargs = dict(batch_size=batch_size, device=device, progress=progress)
    return (encode_gallery(model, split, **kwargs),
            encode_captions(model, split, tokenizer, **kwargs))


def retrieval_evaluator(split, score_fn):
    """The Trainer's `evaluate` hook: retrieval_metrics of score_fn(model, split) (N, T); a dict of
    named splits prefixes each one's metrics ("val_t2i_r1", ...); split None -> None."""
    if split is None:
        return None
    splits = split if isinstance(split, Mapping) else {"": split}

    def evaluate(model) -> dict:
        metrics = {}
        for name, one in splits.items():
            scores = score_fn(model, one)  # (N, T), or (i2t, t2i) matrices of a two-stage ranker
            scores, t2i = scores if isinstance(scores, tuple) else (scores, None)
            found = retrieval_metrics(scores, one.txt2img, t2i_sims=t2i,
                                      query_texts=one.query_texts, query_images=one.query_images)
            metrics.update({f"{name}_{k}" if name else k: v for k, v in found.items()})
        return metrics

    return evaluate


def learning_curve_splits(bench: dict, n_train: int = 1000) -> dict:
    """{"val", "train": the first n_train training images}: equal galleries, comparable."""
    train = bench["train"]
    n = min(n_train, train.n_images, bench["val"].n_images)
    return {"val": bench["val"].subset(range(n), name=f"val[:{n}]") if n < bench["val"].n_images
            else bench["val"], "train": train.subset(range(n), name=f"train[:{n}]")}


def similarity(model: nn.Module, split, tokenizer, **kwargs) -> torch.Tensor:
    """(N, T) dot products of every image and caption of a split (kwargs: encode_split's)."""
    image_emb, text_emb = encode_split(model, split, tokenizer, **kwargs)  # (N, E), (T, E)
    return image_emb @ text_emb.T
