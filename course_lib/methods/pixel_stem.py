"""A pixel stem pre-trained on the scenes' ground truth: the miniature's ImageNet (or detector).

HiVLP's ViT starts pre-trained and Fast & Slow's ResNet-50s see COCO or CC first; our CNNs would
have to learn to see within a few thousand retrieval steps. So (our choice, for all three) a small
stem is pre-trained once on bench["pretrain"]'s scenes (never the retrieval splits) to name what
sits in each cell of the 3x3 grid (data.scenes.Scenes):

    pixels (B, 3, 32, 32) -> ConvBackbone -> maps (B, c0, 16, 16), (B, c1, 8, 8), (B, c2, 4, 4)
    head_pool "cells":   the 4x4 map average-pooled to the 3x3 grid (B, c2, 3, 3) -> one shared
                         Linear per cell -> (B, 9, 51) logits per cell (the default)
              "flatten": the 4x4 map flattened (B, 16 c2) -> Linear -> (B, 9, 51)
    51 logits a cell: object (49: 0 = empty, else 1 + class shape * 8 + colour), size (2)
    loss: CE(object, all 9 cells) + CE(size, occupied cells only)

One class per (shape, colour), not a head each, makes "a red circle in cell k", and so a bag of the
scene's objects, a linear read-out of the map (docs/findings.md, "What one vector can do").
`ConvBackbone` is Fast's and Slow's CNN, so the stem's backbone loads straight into theirs; the
heads are dropped.

    stem, history = train_pixel_stem(bench, PixelStemConfig(), checkpoint_path=cache / name)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from course_lib.core.settings import CourseConfig, seed_everything
from course_lib.core.stages import Stage, config_fields
from course_lib.core.train import Trainer
from course_lib.core.train_config import train_config
from course_lib.data.datasets import ImageDataset
from course_lib.data.scenes import COLORS, GRID, N_CLASSES, SIZES
from course_lib.methods.encoding import encode_batches

CELLS = GRID * GRID  # 9 cells, cell = row * GRID + col
HEADS = {"object": 1 + N_CLASSES, "size": len(SIZES)}  # logits per cell and head
HEAD_POOLS = ("flatten", "cells")  # PixelStemConfig.head_pool
STEM_FORMAT_VERSION = 1  # bump on purpose when the layout or recipe changes: retrains the stem


@dataclass
class PixelStemConfig(CourseConfig):
    # Defaults chosen in docs/tuning_notes.md, "Pixel stem".
    channels: tuple = (24, 48, 96)  # ConvBackbone widths: those of the model that loads it
    head_pool: str = "cells"  # the 4x4 map pooled to 3x3 "cells" (one shared Linear) or "flatten"ed
    batch_size: int = 128  # scenes per step
    lr: float = 2e-3  # peak AdamW rate
    max_steps: int = 400  # optimizer steps on bench["pretrain"] (20k scenes: 2.6 epochs at 128)
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm
    seed: int = 0  # initialisation and data order

    SMOKE: ClassVar[dict] = {"max_steps": 30, "batch_size": 32, "channels": (8, 16, 32)}

    def __post_init__(self):
        self.channels = tuple(int(c) for c in self.channels)
        if len(self.channels) != 3 or self.head_pool not in HEAD_POOLS:
            raise ValueError(f"channels must be 3 widths and head_pool one of {HEAD_POOLS}, got "
                             f"{self.channels} and {self.head_pool!r}")


def conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU())


class ConvBackbone(nn.Module):
    """Pixels (B, 3, 32, 32) -> maps [(B, c0, 16, 16), (B, c1, 8, 8), (B, c2, 4, 4)]: per stage a
    stride-2 conv then a conv, BN and ReLU (a full-resolution stem cost as much as the rest)."""

    def __init__(self, channels=(24, 48, 96)):
        super().__init__()
        c0, c1, c2 = channels
        self.stages = nn.ModuleList(nn.Sequential(conv_bn_relu(a, b, 2), conv_bn_relu(b, b))
                                    for a, b in ((3, c0), (c0, c1), (c1, c2)))
        self.out_dim = c2

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        maps = [pixels]
        for stage in self.stages:
            maps.append(stage(maps[-1]))
        return maps[1:]  # finest first


def cell_targets(scenes, rows=None) -> dict[str, np.ndarray]:
    """int64 (n, 9) per scene and cell: "object" (0 empty, else 1 + class), "size" (-1 if empty)."""
    rows = np.arange(len(scenes)) if rows is None else np.asarray(rows)
    out = {"object": np.zeros((len(rows), CELLS), np.int64),
           "size": np.full((len(rows), CELLS), -1, np.int64)}
    scene, slot = np.nonzero(scenes.valid[rows])  # (K,) each: every object of the chosen scenes
    cell, shape, color, size = (getattr(scenes, k)[rows][scene, slot].astype(np.int64)
                                for k in ("cell", "shape", "color", "size"))
    out["object"][scene, cell] = 1 + shape * len(COLORS) + color
    out["size"][scene, cell] = size
    return out


class CellDataset(Dataset):
    """Per scene: "pixels" (3, 32, 32), as ImageDataset's, and its cell_targets (9,) each."""

    def __init__(self, split):
        if split.scenes is None:
            raise ValueError(f"split {split.name!r} has no scene ground truth (the synthetic "
                             "benchmark has)")
        self.images = ImageDataset(split, modality="pixels")
        self.targets = {k: torch.from_numpy(v) for k, v in cell_targets(split.scenes).items()}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.images[i]["pixels"], **{k: v[i] for k, v in self.targets.items()}}


class StemBackboneModule(nn.Module):
    """A module whose backbone, while `frozen_backbone`, gets no gradient and stays in eval."""

    frozen_backbone: bool = False

    def freeze_backbone(self) -> None:
        self.backbone.requires_grad_(not self.frozen_backbone)  # the Trainer skips frozen weights

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen_backbone:
            self.backbone.eval()
        return self


class PixelStem(nn.Module):
    """ConvBackbone + heads: (B, 3, 32, 32) -> {"object": (B, 9, 49), "size": (B, 9, 2)}."""

    def __init__(self, config: PixelStemConfig | None = None):
        super().__init__()
        c = self.config = config or PixelStemConfig()
        self.backbone = ConvBackbone(c.channels)
        width = sum(HEADS.values())  # 51 logits a cell
        self.head = (nn.Linear(16 * c.channels[2], CELLS * width) if c.head_pool == "flatten"
                     else nn.Linear(c.channels[2], width))

    def forward(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        grid = self.backbone(pixels)[2]  # (B, C, 4, 4)
        if self.config.head_pool == "flatten":
            logits = self.head(grid.flatten(1)).view(len(grid), CELLS, -1)  # (B, 9, 51)
        else:  # 4x4 -> 3x3 by overlapping averages, row-major like the cell index
            cells = F.adaptive_avg_pool2d(grid, GRID).flatten(2).transpose(1, 2)  # (B, 9, C)
            logits = self.head(cells)  # (B, 9, 51)
        return dict(zip(HEADS, logits.split(list(HEADS.values()), dim=2), strict=True))


def cell_loss(model: PixelStem, batch: dict, step: int = 0) -> dict:
    """Sum of the heads' cross-entropies (size on occupied cells only); logs each."""
    logits = model(batch["pixels"])
    parts = {k: F.cross_entropy(logits[k].flatten(0, 1), batch[k].flatten(), ignore_index=-1)
             for k in HEADS}
    return {"loss": sum(parts.values()), **{f"{k}_loss": v for k, v in parts.items()}}


def cell_accuracy(model: PixelStem, split, batch_size: int = 500) -> dict[str, float]:
    """Per-cell accuracy in percent: "occupancy", then on occupied cells "shape", "color", "size"
    and "object" (all three). Chance: occupancy ~50, shape 1/6, colour 1/8, size 1/2."""
    data = CellDataset(split)
    parts = encode_batches(model, DataLoader(data, batch_size),  # {head: (b, 9) argmax} a batch
                           lambda b: {k: v.argmax(-1).cpu() for k, v in model(b["pixels"]).items()})
    pred = {k: torch.cat([p[k] for p in parts]) for k in HEADS}  # (N, 9) each
    truth, occupied = data.targets, data.targets["object"] > 0
    # class - 1 = shape * n_colors + colour; an "empty" guess gets neither right
    n_colors, guess, actual = len(COLORS), pred["object"] - 1, truth["object"] - 1
    right = {"shape": guess // n_colors == actual // n_colors,
             "color": (guess % n_colors == actual % n_colors) & (pred["object"] > 0),
             "size": pred["size"] == truth["size"]}
    out = {"occupancy": 100.0 * ((pred["object"] > 0) == occupied).float().mean().item()}
    for k, ok in {**right, "object": right["shape"] & right["color"] & right["size"]}.items():
        out[k] = 100.0 * ok[occupied].float().mean().item()
    return out


def stem_config(config) -> PixelStemConfig:
    """The PixelStemConfig a model's config starts from (its stem fields, seed and CNN widths)."""
    return PixelStemConfig(channels=getattr(config, "channels", PixelStemConfig.channels),
                           head_pool=config.stem_head_pool, max_steps=config.stem_steps,
                           seed=config.seed)


def pixel_stem_stage(bench: dict, config: PixelStemConfig) -> Stage:
    """The stem's training stage: its config, bench["pretrain"]'s scenes (no text), its version."""
    return Stage("pixel_stem", reads=config_fields(config), data=bench["pretrain"],
                 version=STEM_FORMAT_VERSION)


class StartsFromPixelStem(ABC):
    """For a Method whose image tower may start from the pixel stem (its stage names it)."""

    @abstractmethod
    def starts_from_stem(self) -> bool:
        """Whether the model's image tower starts from the pixel stem."""

    def stem_stage(self, bench: dict) -> Stage | None:
        """The pixel stem's stage (None when the model does not start from it)."""
        return (pixel_stem_stage(bench, stem_config(self.config)) if self.starts_from_stem()
                else None)

    def stage(self, bench: dict, tokenizer) -> Stage:
        """Every config field, on bench["train"], from the pixel stem when it starts from it."""
        return super().stage(bench, tokenizer, self.stem_stage(bench))

    def stem_checkpoint(self, bench: dict, cache_dir) -> Path | None:
        """Where the stem is cached: cache_dir / its file (None without either)."""
        stem = self.stem_stage(bench)
        return None if stem is None else stem.path(cache_dir)


def train_pixel_stem(bench: dict, config: PixelStemConfig | None = None, *, checkpoint_path=None,
                     evaluate_on="val", eval_every: int | None = None, progress: bool = True,
                     device: str | None = None) -> tuple[PixelStem, list]:
    """Pre-train on bench["pretrain"], evaluated on bench[evaluate_on] -> (stem, History)."""
    c = config or PixelStemConfig()
    seed_everything(c.seed)
    model = PixelStem(c)
    evaluate = None if evaluate_on is None else (lambda m: cell_accuracy(m, bench[evaluate_on]))
    config = train_config(c, checkpoint_path=checkpoint_path, progress=progress, device=device,
                          eval_every=eval_every, log_every=max(1, c.max_steps // 100))
    data = CellDataset(bench["pretrain"])
    history = Trainer(model, cell_loss, data, config, evaluate=evaluate).fit()
    return model.eval(), history


def load_stem_backbone(backbone: ConvBackbone, bench: dict, model_config, *, checkpoint_path=None,
                       progress: bool = True, device: str | None = None) -> None:
    """Copy the pixel stem of `stem_config(model_config)`, trained or loaded, into `backbone`."""
    stem, _ = train_pixel_stem(bench, stem_config(model_config), checkpoint_path=checkpoint_path,
                               progress=progress, device=device)
    backbone.load_state_dict(stem.backbone.state_dict())
