"""What every benchmark method shares: train once (or load the cached checkpoint), then score.

A benchmark method (course_lib.benchmark) has a `name`, `notes`, `fit(bench, tokenizer, cache_dir)`,
`similarity(split)` -> (n_images, n_texts) scores and `query_fn(split)` -> a zero-argument callable
answering one text query against the split's gallery.

    Method              fit-and-cache: the checkpoint is named by checkpoint_name(...), so a cache
                        folder never hands back a model trained on other data or with another config
    DualEncoderMethod   + what every dot-product model shares (VSE++, LightningDOT): the gallery is
                        embedded once into a FAISS index, a query costs one text encoding and a top-k

The encode_* helpers serve any model with `encode_images(batch)` / `encode_texts(batch)` -> (B, E)
and a `modality` attribute ("regions" or "pixels", the image field the datasets must provide).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from course_lib.checkpoints import checkpoint_name, model_device
from course_lib.data.datasets import CaptionDataset, ImageDataset, TextCollate, make_loader
from course_lib.retrieval import build_index, search

# splits with more items than this get a progress bar while they are encoded
_PROGRESS_ITEMS = 20_000


class Method(ABC):
    """Base of the benchmark methods. A subclass sets `checkpoint_prefix` (also its default name)
    and `config_class` (its default config), and implements `train(bench, tokenizer,
    checkpoint_path, cache_dir) -> (model, history)`, which loads a finished checkpoint at
    checkpoint_path instead of training (course_lib.train.Trainer does)."""

    checkpoint_prefix: ClassVar[str] = "method"
    config_class: ClassVar[type]

    def __init__(self, config=None, name: str | None = None, progress: bool = True):
        self.config = config if config is not None else self.config_class()
        self.name, self.progress = name or self.checkpoint_prefix, progress
        self.model = self.tokenizer = self.history = self.checkpoint_path = None

    def checkpoint_extra(self) -> tuple:
        """Anything besides config, data and vocabulary that changes the trained model."""
        return ()

    def fit(self, bench: dict, tokenizer, cache_dir=None) -> "Method":
        """Train on bench["train"], or load cache_dir / "<prefix>-<hash>.pt" if it is there."""
        self.tokenizer, self.checkpoint_path = tokenizer, None
        if cache_dir is not None:
            name = checkpoint_name(self.checkpoint_prefix, self.config.to_dict(), bench["train"],
                                   tokenizer, *self.checkpoint_extra())
            self.checkpoint_path = Path(cache_dir) / name
        self.model, self.history = self.train(bench, tokenizer, self.checkpoint_path, cache_dir)
        return self

    @abstractmethod
    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        """Train on bench["train"] (or load a finished checkpoint_path); return (model, history)."""

    def _fitted(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, tokenizer, cache_dir) first")
        return self.model


# ----------------------------------------------------------------------------- dual encoders

def _encode(model: nn.Module, loader, encode_name: str, device, progress: bool) -> torch.Tensor:
    """Concatenate model.<encode_name>(batch) over a loader: eval mode, no grad, on `device` (None =
    the model's); the result (n, E) on the CPU. The model's train/eval mode is restored after."""
    device = model_device(model, device)
    was_training = model.training
    model.to(device).eval()
    encode, out = getattr(model, encode_name), []
    try:
        with torch.no_grad():
            for batch in tqdm(loader, desc=encode_name.replace("_", " "), disable=not progress,
                              leave=False):
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                out.append(encode(batch).float().cpu())  # (b, E)
    finally:
        model.train(was_training)
    return torch.cat(out)  # (n, E)


def encode_gallery(model: nn.Module, split, *, batch_size: int = 256, device=None,
                   progress: bool | None = None) -> torch.Tensor:
    """(N, E) image embeddings of a split, on the CPU. progress None = a bar for big splits."""
    loader = make_loader(ImageDataset(split, modality=model.modality), batch_size)
    progress = split.n_images > _PROGRESS_ITEMS if progress is None else progress
    return _encode(model, loader, "encode_images", device, progress)


def encode_captions(model: nn.Module, split, tokenizer, *, batch_size: int = 256, device=None,
                    progress: bool | None = None) -> torch.Tensor:
    """(T, E) caption embeddings of a split, on the CPU. progress None = a bar for big splits."""
    loader = make_loader(CaptionDataset(split), batch_size, tokenizer=tokenizer)
    progress = split.n_texts > _PROGRESS_ITEMS if progress is None else progress
    return _encode(model, loader, "encode_texts", device, progress)


def encode_split(model: nn.Module, split, tokenizer, *, batch_size: int = 256, device=None,
                 progress: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb (N, E), text_emb (T, E)) of a split, on the CPU. progress None = bar for big splits."""
    kwargs = dict(batch_size=batch_size, device=device, progress=progress)
    return encode_gallery(model, split, **kwargs), encode_captions(model, split, tokenizer, **kwargs)


def similarity(model: nn.Module, split, tokenizer, **kwargs) -> torch.Tensor:
    """(N, T) dot products of every image and caption of a split (kwargs: encode_split's)."""
    image_emb, text_emb = encode_split(model, split, tokenizer, **kwargs)
    return image_emb @ text_emb.T  # (N, T)


class DualEncoderMethod(Method):
    """A Method whose model scores by a dot product of two independent embeddings."""

    def similarity(self, split) -> torch.Tensor:
        return similarity(self._fitted(), split, self.tokenizer)  # (N, T)

    def query_fn(self, split, top_k: int = 10, caption_index: int = 0, index_kind: str = "flat"):
        """A zero-argument callable answering one text query: the online cost of retrieval.

        The gallery's image embeddings are computed once, here (offline), into a FAISS index
        (`index_kind`, exact by default); each call tokenises one caption, runs the text encoder
        and searches the index. Returns the top_k image indices (top_k,), best first.
        """
        model = self._fitted().eval()
        index = build_index(encode_gallery(model, split), kind=index_kind)  # offline: (N, E)
        collate, device = TextCollate(self.tokenizer), model_device(model)
        caption = split.captions[caption_index]

        @torch.no_grad()
        def answer() -> np.ndarray:
            batch = {k: v.to(device) for k, v in collate.encode([caption]).items()}  # (1, T)
            query = model.encode_texts(batch).float().cpu()  # (1, E)
            return search(index, query, top_k)[1][0]  # (top_k,)

        return answer

    def image_query_fn(self, split, top_k: int = 10, image_index: int = 0, index_kind: str = "flat"):
        """The same for text retrieval: the split's captions are indexed offline, each call encodes
        one image and searches them. Returns the top_k caption indices (top_k,), best first."""
        model = self._fitted().eval()
        index = build_index(encode_captions(model, split, self.tokenizer), kind=index_kind)  # (T, E)
        image = ImageDataset(split, modality=model.modality)[image_index]
        device = model_device(model)

        @torch.no_grad()
        def answer() -> np.ndarray:
            batch = {k: v[None].to(device) for k, v in image.items() if torch.is_tensor(v)}  # (1, ...)
            query = model.encode_images(batch).float().cpu()  # (1, E)
            return search(index, query, top_k)[1][0]  # (top_k,)

        return answer


__all__ = ["Method", "DualEncoderMethod", "encode_gallery", "encode_captions", "encode_split",
           "similarity"]
