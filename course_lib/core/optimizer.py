"""LightningDOT's optimisation recipe, which every model of the course trains with: AdamW with weight
decay on matrices only, and a learning rate warmed up linearly, then decayed linearly to 0."""

from __future__ import annotations

from torch import nn


def warmup_linear_decay(step: int, total_steps: int, warmup_steps: int) -> float:
    """LR multiplier: 0 -> 1 linearly over `warmup_steps`, then linearly to 0 at `total_steps`."""
    if step < warmup_steps:
        return step / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: 2-D+ tensors decayed, 1-D tensors (biases, norm weights) not."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


__all__ = ["warmup_linear_decay", "param_groups"]
