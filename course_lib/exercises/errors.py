"""The error every exercise checker raises, and how checkers read and compare an answer."""

from numbers import Real

import numpy as np
import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""


NO_GRADIENT_NOTE = ("(you returned a plain number: the value is right, but training needs the "
                    "tensor itself, so return the loss without .item() or float())")


def scalar_answer(got, label: str, hint: str, inputs: str) -> tuple[float, bool]:
    """A returned loss as (its value, whether it is a tensor that can train), else ExerciseError;
    a tensor must carry a gradient back to `inputs`."""
    if torch.is_tensor(got) and got.numel() == 1:
        if not got.requires_grad:
            raise ExerciseError(f"the loss carries no gradient back to the {inputs}: keep it in "
                                "torch (no .item(), .numpy() or float() inside), or training "
                                "cannot use it")
        return float(got.detach()), True
    if isinstance(got, Real) and not isinstance(got, bool):
        return float(got), False
    shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
    raise ExerciseError(f"on {label}: expected one number (a 0-d tensor), got {shape}; {hint}")


def float64(got) -> torch.Tensor:
    """A returned tensor, array or list as a float64 CPU tensor."""
    got = got if torch.is_tensor(got) else torch.as_tensor(np.asarray(got, dtype=np.float64))
    return got.detach().double().cpu()


def close(got, want, tol: float = 1e-6) -> bool:
    """Equal shapes and values up to tol (relative for large values): tensors, or numbers."""
    if torch.is_tensor(got):
        return tuple(got.shape) == tuple(want.shape) and torch.allclose(got, want, tol, tol)
    return abs(got - float(want)) <= tol * max(1.0, abs(float(want)))


def check_answer(got, expected, label: str, explain: str, mistakes, *args, tol=1e-6) -> None:
    """Pass if got is close to expected; else name the first of mistakes(*args) -> [(wrong answer,
    message)] that got matches, or `explain` (formatted with worst, expected and got)."""
    if close(got, expected, tol):
        return
    for wrong, message in mistakes(*args):
        if close(got, wrong, tol):
            raise ExerciseError(f"on {label}: {message}")
    worst = (got - expected).abs().max().item() if torch.is_tensor(got) else abs(got - expected)
    raise ExerciseError(f"on {label}: " + explain.format(worst=worst, expected=expected, got=got))
