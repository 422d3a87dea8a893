"""The error every exercise checker raises."""


class ExerciseError(AssertionError):
    """Raised by a checker: the message says what is wrong and how to look for it."""
