"""What a training run logs: `History`, a list of rows (training rows and evaluation rows), which
shipped models carry and the notebooks plot."""

from __future__ import annotations


class History(list):
    """Logged rows, one dict each; a plain list, so `pandas.DataFrame(history)` works too.
    Training rows: {"step", "epoch", "lr", "loss", other scalars of loss_fn, "grad_norm"}, the
    values averaged over the `log_every` steps up to "step" (lr is the one last used). Evaluation
    rows: {"step", "eval": True, "cpu_seconds", **metrics}, cpu_seconds = the process's CPU time
    spent in training steps so far (evaluations excluded, resumed runs included): the x-axis of a
    learning curve that compares models by what they cost to train."""

    def rows(self, eval: bool | None = None) -> list[dict]:
        """All rows, or only evaluation rows (eval=True) or only training rows (eval=False)."""
        return [r for r in self if eval is None or bool(r.get("eval", False)) == eval]

    def column(self, name: str, eval: bool | None = None) -> list[float]:
        """The values of `name` in the rows that have it, in order (for plotting)."""
        return [r[name] for r in self.rows(eval) if name in r]

    def steps(self, name: str, eval: bool | None = None) -> list[int]:
        """The steps that go with `column(name, eval)`: the x-axis of the same plot."""
        return [r["step"] for r in self.rows(eval) if name in r]


__all__ = ["History"]
