"""What every head's training and method share: its learning curve, the optimizer and step, the
checkpoint it is cached under, and the recalls that choose settings on val."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn as nn

from course_lib.core.checkpoints import checkpoint_name
from course_lib.core.metrics import ranks_from_top_k, recall_at_k
from course_lib.methods.frozen_heads.features import TextStates, image_tokens
from course_lib.methods.queries import ground_truth

@dataclass
class Curve:
    """A learning curve: steps, training loss, and t2i R@1 on val and on train[:n] at each point."""

    step: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    val_r1: list = field(default_factory=list)
    train_r1: list = field(default_factory=list)
    seconds: float = 0.0
    best_step: int = 0  # the step whose weights were kept (the best val point: early stopping on val)



class DistinctPhotos:
    """Training batches of distinct photos, each with one of its captions drawn at random: no two captions
    of one photo in a batch, so the in-batch negatives hold no false negative."""

    def __init__(self, split, seed: int):
        self.n_images, self.generator = split.n_images, torch.Generator().manual_seed(seed)
        self.captions_of = [torch.from_numpy(np.flatnonzero(split.txt2img == i)) for i in range(split.n_images)]

    def draw(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(photos (B,), captions (B,)): the indices of one batch."""
        images = torch.randperm(self.n_images, generator=self.generator)[:batch_size]
        captions = torch.stack([self.captions_of[i][torch.randint(len(self.captions_of[i]), (), generator=self.generator)]
                                for i in images.tolist()])
        return images, captions


def optimizer_for(model, config):
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / config.steps))))
    return optimizer, schedule


def optimizer_step(model, loss, optimizer, schedule) -> None:
    """One optimizer step on `loss`: gradients clipped to norm 2 (VSE++'s), then the schedule."""
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    optimizer.step()
    schedule.step()


def t2i_r1(image_emb, text_emb, txt2img) -> float:
    """Text-to-image R@1 (percent) of embeddings, by exact dot product."""
    best = (text_emb @ image_emb.T).argmax(1)  # (T,)
    return 100.0 * float((best == torch.as_tensor(txt2img)).float().mean())



class FrozenMethod:
    """What the three method classes share: a name, notes, the benchmark's budgets, a checkpoint."""

    eval_pairs: ClassVar[tuple] = (None, None)
    timed_sizes: ClassVar[tuple] = (None, None)
    prefix: ClassVar[str] = "frozen"

    def __init__(self, name: str, config, progress: bool = True):
        self.name, self.config, self.progress = name, config, progress
        self.model, self.curve, self.from_shipped, self.checkpoint_path = None, None, False, None

    def pairs_per_query(self, split, direction: str) -> int:
        return 0

    def _training_inputs(self, bench, text: TextStates, grid: int | None = None):
        """(regions (N, R, D), boxes (R, 7), states (T, L, D), mask (T, L)) of bench["train"], with the text
        side and the torch seed set: what every fit starts from."""
        self.text = text
        torch.manual_seed(self.config.seed)
        return (*image_tokens(bench["train"], grid), *text.of(bench["train"], self.progress))

    def _checkpoint(self, bench, text: TextStates, cache_dir, *extra):
        if cache_dir is None:
            return None
        return Path(cache_dir) / checkpoint_name(self.prefix, {**asdict(self.config), "text": text.name,
                                                               "scratch": text.scratch}, bench["train"],
                                                 text.tokenizer, *extra)

    def _load(self, path) -> bool:
        if path is None or not path.is_file():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.curve = Curve(**saved["curve"])
        return True

    def _save(self, path) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.model.state_dict(), "curve": asdict(self.curve)}, path)

    def _fitted(self):
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, text_states, cache_dir) first")
        return self.model.eval()



def recalls(method, split, ks=(1, 5, 10)) -> dict:
    """Every query's recalls (no sampling), for choosing settings on val."""
    out = {}
    for direction in ("t2i", "i2t"):
        queries = split.text_queries if direction == "t2i" else split.image_queries
        indices, scores = method.rank(split, direction, max(ks), queries)
        ranks = ranks_from_top_k(scores, ground_truth(split, direction, queries, indices))
        out |= {f"{direction}_r{k}": v for k, v in recall_at_k(ranks, ks).items()}
    return out


__all__ = ["Curve", "DistinctPhotos", "optimizer_for", "optimizer_step", "t2i_r1", "FrozenMethod", "recalls"]
