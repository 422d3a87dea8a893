"""The error every exercise checker raises, and how a checker reads a one-number answer."""

from numbers import Real

import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""


def scalar_answer(got, label: str, hint: str) -> tuple[float, bool]:
    """A returned loss as (its value, whether it is a tensor that can train), else ExerciseError."""
    if torch.is_tensor(got) and got.numel() == 1:
        return float(got.detach()), True
    if isinstance(got, Real) and not isinstance(got, bool):
        return float(got), False
    shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
    raise ExerciseError(f"on {label}: expected one number (a 0-d tensor), got {shape}; {hint}")


NO_GRADIENT_NOTE = ("(you returned a plain number: the value is right, but training needs the "
                    "tensor itself, so return the loss without .item() or float())")
