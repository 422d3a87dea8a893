"""The error every exercise checker raises, and how a checker reads a one-number answer."""

from numbers import Real

import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""


def scalar_answer(got, label: str, hint: str) -> tuple[float, bool]:
    """A loss the learner returned, as (its value, whether it is a tensor that can train): a 0-d
    (or one-element) tensor, or a plain number (its value checks; no gradient). Anything else
    raises ExerciseError naming what came back and `hint`."""
    if torch.is_tensor(got) and got.numel() == 1:
        return float(got.detach()), True
    if isinstance(got, Real) and not isinstance(got, bool):
        return float(got), False
    shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
    raise ExerciseError(f"on {label}: expected one number (a 0-d tensor), got {shape}; {hint}")


NO_GRADIENT_NOTE = ("(you returned a plain number: the value is right, but training needs the "
                    "tensor itself, so return the loss without .item() or float())")
