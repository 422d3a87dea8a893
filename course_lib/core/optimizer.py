"""LightningDOT's optimisation recipe, which every model of the course trains with: AdamW with
weight decay on matrices only, the learning rate warmed up linearly, then decayed linearly to 0."""

from __future__ import annotations

from torch import nn


def warmup_linear_decay(step: int, total_steps: int, warmup_steps: int) -> float:
    """LR multiplier: 0 -> 1 linearly over `warmup_steps`, then linearly to 0 at `total_steps`."""
    if step < warmup_steps:
        return step / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 lr_scales: dict | None = None) -> list[dict]:
    """AdamW groups: 2-D+ tensors decayed, 1-D (biases, norm weights) not. lr_scales: name prefix ->
    multiplier of `lr` (e.g. {"text_encoder.": 0.1}), in groups of their own after the others."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    scales = dict(lr_scales or {})
    if scales and lr is None:
        raise ValueError("lr_scales multiply lr: pass lr as well")
    unknown = [prefix for prefix in scales if not any(n.startswith(prefix) for n, _ in named)]
    if unknown:
        raise ValueError(f"lr_scales names {unknown}, which start no trainable parameter's name "
                         f"(e.g. {named[0][0]!r}); give prefixes of model.named_parameters()")

    def scale_of(name: str) -> float:  # the longest matching prefix wins
        matches = [prefix for prefix in scales if name.startswith(prefix)]
        return scales[max(matches, key=len)] if matches else 1.0

    groups = []
    for scale in [1.0] + sorted(set(scales.values()) - {1.0}):
        params = [(n, p) for n, p in named if scale_of(n) == scale]
        extra = {} if scale == 1.0 else {"lr": lr * scale}
        groups += [{"params": [p for _, p in params if p.dim() >= 2],
                    "weight_decay": weight_decay, **extra},
                   {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0, **extra}]
    return [g for g in groups if g["params"]] if scales else groups


def pretrained_lr_scales(prefix: str, scale: float | None, text_encoder: str | None,
                         config: str) -> dict | None:
    """TrainConfig.lr_scales of a pretrained text encoder under `prefix` at `scale` times the rate
    (None: one rate); a scale without `text_encoder` is a ValueError naming `config`'s fields."""
    if scale is None:
        return None
    if text_encoder is None or scale <= 0:
        raise ValueError(f"{config}(text_encoder_lr_scale={scale}) scales a pretrained text "
                         "encoder's rate: set text_encoder (e.g. offline_weights.MINILM_NAME) and "
                         "a scale > 0, or leave it None")
    return {prefix: scale}
