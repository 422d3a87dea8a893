"""What a training run logs, which shipped models carry and the notebooks plot."""

from __future__ import annotations


class History(list):
    """Logged rows, one dict each (a list, so `pandas.DataFrame(history)` works). Training rows:
    {"step", "epoch", "lr", "loss", loss_fn's other scalars, "grad_norm"}, averaged over log_every
    steps. Evaluation rows: {"step", "eval": True, "cpu_seconds", **metrics}, cpu_seconds = CPU
    time in training steps so far: the x-axis of a learning curve by cost to train."""

    def rows(self, eval: bool | None = None) -> list[dict]:
        """All rows, or only evaluation (eval=True) or training (eval=False) rows."""
        return [r for r in self if eval is None or bool(r.get("eval", False)) == eval]

    def column(self, name: str, eval: bool | None = None) -> list[float]:
        """The values of `name` in the rows that have it."""
        return [r[name] for r in self.rows(eval) if name in r]

    def steps(self, name: str, eval: bool | None = None) -> list[int]:
        """The steps that go with `column(name, eval)`."""
        return [r["step"] for r in self.rows(eval) if name in r]
