"""course_lib.core.train: schedule, exact resume, accumulation, clipping, hooks and errors."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.core.checkpoints import load_model_weights
from course_lib.core.history import History
from course_lib.core.optimizer import param_groups, warmup_linear_decay
from course_lib.core.train import Trainer, move_to_device
from course_lib.core.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread


class Net(nn.Module):
    def __init__(self, hidden=16, dropout=0.2):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                  nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def make_dataset(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, generator=g) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def mse(model, batch, step=0):
    x, y = batch
    pred = model(x)
    return {"loss": ((pred - y) ** 2).mean(), "mae": (pred - y).abs().mean()}


def make_config(**overrides):
    base = dict(max_steps=20, batch_size=8, lr=1e-2, log_every=1, progress=False, device="cpu")
    base.update(overrides)
    return TrainConfig(**base)


def build(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def test_schedule_hand_worked_values():
    assert [warmup_linear_decay(s, 10, 2) for s in (0, 1, 2, 6, 10)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert warmup_linear_decay(0, 10, 0) == 1.0 and warmup_linear_decay(12, 10, 2) == 0.0


def test_optimizer_lr_follows_schedule():
    trainer = Trainer(build(), mse, make_dataset(), make_config(max_steps=10, lr=0.5,
                                                                warmup_fraction=0.2))
    history = trainer.fit()
    # Row s reports the lr used by optimizer step s (1-based), i.e. the multiplier at s - 1.
    assert history.column("lr") == pytest.approx([0.5 * warmup_linear_decay(s, 10, 2)
                                                  for s in range(10)])
    assert all(g["lr"] == 0.0 for g in trainer.optimizer.param_groups)  # decayed to 0 at the end


def test_a_key_logged_on_some_steps_is_averaged_over_those_steps():
    # one objective per batch (LightningDOT pre-training) logs "<task>_loss" only on its own steps
    calls = []

    def alternating(model, batch, step):
        out = mse(model, batch)
        calls.append(float(out["loss"].detach()))
        assert step == len(calls) - 1  # the trainer passes the optimizer steps taken so far
        if len(calls) % 2:
            out["odd_loss"] = out["loss"]
        return out

    config = make_config(max_steps=4, log_every=4)
    history = Trainer(build(), alternating, make_dataset(), config).fit()
    assert history[0]["odd_loss"] == pytest.approx((calls[0] + calls[2]) / 2, rel=1e-5)
    assert history[0]["loss"] == pytest.approx(sum(calls) / 4, rel=1e-5)


def test_loss_goes_down_and_history_columns():
    trainer = Trainer(build(), mse, make_dataset(), make_config(max_steps=120, log_every=10,
                                                                batch_size=16))
    history = trainer.fit()
    loss = history.column("loss")
    assert isinstance(history, History) and len(loss) == 12
    assert history.steps("loss") == list(range(10, 121, 10))
    assert loss[-1] < 0.3 * loss[0]
    assert set(history[0]) >= {"step", "epoch", "lr", "loss", "mae", "grad_norm"}
    assert trainer.model.training


def _fit_interrupted(tmp_path, config_kwargs, stop_after, evaluate=None):
    path = str(tmp_path / "run.pt")
    config = make_config(checkpoint_path=path, **config_kwargs)
    first = Trainer(build(), mse, make_dataset(), config, evaluate=evaluate)
    first.fit(stop_after=stop_after)
    assert first.step == stop_after
    # A new model (other init), optimizer and trainer, as after a kernel restart.
    second = Trainer(build(seed=123), mse, make_dataset(), make_config(checkpoint_path=path,
                                                                       **config_kwargs),
                     evaluate=evaluate)
    return second, second.fit()


@pytest.mark.parametrize("accum, stop_after", [(1, 7), (2, 5)])
def test_resume_is_exact(tmp_path, capsys, fake_cpu_clock, accum, stop_after):
    def evaluate(model):  # draws a random number, so the saved RNG state must come after it
        x, y = make_dataset(16, seed=1).tensors
        return {"val_mse": ((model(x) - y) ** 2).mean(), "noise": torch.rand(())}

    # 64 samples / batch 8 = 8 micro-batches per epoch: both stops fall inside an epoch, and the
    # log window (3) is cut in the middle.
    kwargs = dict(grad_accum_steps=accum, log_every=3, eval_every=4, checkpoint_every=4)
    reference = Trainer(build(), mse, make_dataset(), make_config(**kwargs), evaluate=evaluate)
    expected = reference.fit()
    resumed, history = _fit_interrupted(tmp_path, kwargs, stop_after, evaluate)
    assert f"at step {stop_after}/20" in capsys.readouterr().out
    assert resumed.epoch == reference.epoch and resumed.batch_in_epoch == reference.batch_in_epoch
    for p, q in zip(reference.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # With the fake clock the CPU time is 1 s a step, so the rows match, cpu_seconds included:
    # the measurement is carried over the interruption, never reset.
    assert list(history) == list(expected)
    assert history.steps("val_mse", eval=True) == [4, 8, 12, 16, 20]
    assert history.column("cpu_seconds", eval=True) == [4.0, 8.0, 12.0, 16.0, 20.0]
    assert resumed.cpu_seconds == 20.0


@pytest.fixture
def fake_cpu_clock(monkeypatch):
    """time.process_time replaced by a clock that moves 1 s at each reading (a training step, timed
    between two readings, takes 1 s) and by `advance(s)`: CPU time independent of the machine."""
    import time

    now = [0.0]

    def process_time():
        now[0] += 1.0
        return now[0]

    def advance(seconds):
        now[0] += seconds

    monkeypatch.setattr(time, "process_time", process_time)
    return advance


def _recorded_grads(batch_size, accum, max_steps=12):
    trainer = Trainer(build(dropout=0.0), mse, make_dataset(),
                      make_config(batch_size=batch_size, grad_accum_steps=accum, grad_clip=None,
                                  max_steps=max_steps))
    grads = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        [p.grad.clone() for p in trainer.model.parameters()]))
    return trainer, trainer.fit(), grads


def test_grad_accumulation_matches_bigger_batch():
    # Same shuffle (seed, epoch): micro-batches 2k and 2k+1 of size 4 are exactly batch k of size 8.
    small, small_hist, small_grads = _recorded_grads(4, 2)
    big, big_hist, big_grads = _recorded_grads(8, 1)
    assert len(small_grads) == len(big_grads) == 12
    for gs, gb in zip(small_grads, big_grads, strict=True):
        # without dividing the loss by accum these would be 2x
        for a, b in zip(gs, gb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert small_hist.column("loss") == pytest.approx(big_hist.column("loss"), rel=1e-5)
    for p, q in zip(small.model.parameters(), big.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # The check has power: one micro-batch of 4 alone gives a different gradient.
    _, _, single = _recorded_grads(4, 1, max_steps=1)
    assert not torch.allclose(single[0][0], big_grads[0][0], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("clip", [0.5, None])
def test_grad_clipping(clip):
    def huge(model, batch, step):
        return 1e4 * mse(model, batch)["loss"]

    trainer = Trainer(build(), huge, make_dataset(), make_config(max_steps=3, grad_clip=clip))
    norms = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: norms.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))))
    history = trainer.fit()
    if clip is None:
        assert min(norms) > 10 and "grad_norm" not in history[0]
    else:
        assert max(norms) <= clip * (1 + 1e-5)
        assert min(history.column("grad_norm")) > 10  # logged before clipping


def test_weight_decay_groups():
    model = Net()
    decay, no_decay = Trainer(model, mse, make_dataset(), make_config()).optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and len(decay["params"]) == 2
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 4
    assert len(param_groups(model, 0.1)[0]["params"]) + 4 == len(list(model.parameters()))


def test_lr_scales_move_a_prefixs_parameters_at_their_own_rate():
    # Adam's first step moves every weight by about lr (m / sqrt(v) = sign(g)): the
    # identity checked here, with no weight decay and no warm-up, layer 0 of `body` at a
    # tenth of the rate of the rest
    model = build(dropout=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = make_config(max_steps=1, lr=1e-2, warmup_fraction=0.0, weight_decay=0.0,
                         grad_clip=None, lr_scales={"body.0.": 0.1})
    trainer = Trainer(model, mse, make_dataset(), config)
    assert ([g["lr"] for g in trainer.optimizer.param_groups]
            == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3]))
    trainer.fit()
    for name, p in model.named_parameters():
        moved = (p.detach() - before[name]).abs()
        rate = 1e-3 if name.startswith("body.0.") else 1e-2
        assert moved.max() == pytest.approx(rate, rel=1e-3), name
    # the longest prefix wins
    groups = param_groups(model, 0.01, 1.0, {"body.": 0.5, "body.4.": 0.25})
    assert ([(g["lr"], len(g["params"])) for g in groups]
            == [(0.25, 1), (0.25, 1), (0.5, 1), (0.5, 3)])
    with pytest.raises(ValueError, match="start no trainable parameter"):
        param_groups(model, 0.01, 1.0, {"text_encoder.": 0.1})
    with pytest.raises(ValueError, match="pass lr"):
        param_groups(model, 0.01, None, {"body.0.": 0.1})


@pytest.mark.parametrize("eval_every, expected", [(3, [3, 6, 7]), (None, [7])])
def test_evaluate_hook(eval_every, expected):
    seen = []

    def evaluate(model):
        seen.append((trainer.step, model.training, torch.is_grad_enabled()))
        return {"score": float(trainer.step)}

    trainer = Trainer(build(), mse, make_dataset(),
                      make_config(max_steps=7, eval_every=eval_every), evaluate=evaluate)
    history = trainer.fit()
    assert seen == [(s, False, False) for s in expected]
    assert trainer.model.training
    assert history.column("score", eval=True) == [float(s) for s in expected]
    assert history.steps("score") == expected and len(history.rows(eval=False)) == 7
    # Training CPU time so far, one per evaluation, never decreasing. On the real clock a 7-step
    # toy may take under 5 ms (0.0 at two decimals): the amounts are
    # checked with a fake clock below.
    cpu = history.column("cpu_seconds", eval=True)
    assert len(cpu) == len(expected) and cpu == sorted(cpu)
    assert all(isinstance(c, float) and c >= 0 for c in cpu)


def test_cpu_seconds_leave_out_the_evaluations(fake_cpu_clock):
    """An evaluation that burns CPU does not count as training time: on a fake clock, 1 s a
    training step and 100 s an evaluation, the rows hold the steps' seconds only."""
    def slow_evaluate(model):
        fake_cpu_clock(100.0)
        return {"score": 1.0}

    trainer = Trainer(build(), mse, make_dataset(), make_config(max_steps=4, eval_every=1),
                      evaluate=slow_evaluate)
    cpu = trainer.fit().column("cpu_seconds", eval=True)
    assert cpu == [1.0, 2.0, 3.0, 4.0] and trainer.cpu_seconds == 4.0


def test_nan_loss_raises_with_step():
    calls = []

    def sometimes_nan(model, batch, step):
        calls.append(1)
        loss = mse(model, batch)["loss"]
        return loss * float("nan") if len(calls) == 3 else loss

    with pytest.raises(FloatingPointError, match=r"step 3 .*lower the learning rate"):
        Trainer(build(), sometimes_nan, make_dataset(), make_config()).fit()


def test_clear_errors_for_bad_inputs():
    with pytest.raises(ValueError, match=r"5 samples.*batch_size=8.*drop_last"):
        Trainer(build(), mse, make_dataset(5), make_config())
    with pytest.raises(ValueError, match="empty"):
        Trainer(build(), mse, TensorDataset(torch.zeros(0, 8)), make_config())
    Trainer(build(), mse, make_dataset(5), make_config(drop_last=False, max_steps=2)).fit()
    per_sample = lambda model, batch, step: (model(batch[0]) - batch[1]) ** 2  # noqa: E731
    with pytest.raises(ValueError, match=r"scalar tensor, got shape \(8,\)"):
        Trainer(build(), per_sample, make_dataset(), make_config()).fit()


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    path = str(tmp_path / "a.pt")
    Trainer(build(), mse, make_dataset(), make_config(max_steps=2, checkpoint_path=path)).fit()
    with pytest.raises(ValueError, match=r"different model: shape mismatches .*body\.0\.weight"):
        Trainer(Net(hidden=32), mse, make_dataset(),
                make_config(max_steps=2, checkpoint_path=path)).fit()
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['extra'\]"):
        other = build()
        other.register_buffer("extra", torch.zeros(1))
        load_model_weights(other, path)
    with pytest.warns(UserWarning, match=r"differs in \['lr'\]"):  # finished run, other lr
        Trainer(build(), mse, make_dataset(),
                make_config(max_steps=2, checkpoint_path=path, lr=0.5)).fit()
    fresh = load_model_weights(build(seed=5), path)
    saved = torch.load(path, weights_only=True)["model"]
    assert torch.equal(fresh.body[0].weight, saved["body.0.weight"])


def test_finished_checkpoint_returns_without_training(tmp_path, capsys):
    path = str(tmp_path / "done.pt")
    first = Trainer(build(), mse, make_dataset(), make_config(checkpoint_path=path))
    expected = first.fit()
    calls = []

    def counting(model, batch, step):
        calls.append(1)
        return mse(model, batch)

    again = Trainer(build(seed=9), counting, make_dataset(), make_config(checkpoint_path=path))
    assert again.fit() == expected and calls == []
    assert "finished" in capsys.readouterr().out
    for p, q in zip(first.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q)
    again.fit(resume=False)  # forces a fresh run
    assert len(calls) == 20 and again.step == 20


def test_move_to_device_and_dict_batches():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "items": [torch.zeros(1), "text", (3, Pair(torch.ones(1), None))]}
    moved = move_to_device(batch, torch.device("cpu"))
    assert moved["items"][1] == "text" and isinstance(moved["items"][2][1], Pair)
    assert isinstance(moved["items"][2], tuple) and moved["items"][2][1].b is None

    def collate(samples):  # dict batches with a non-tensor entry pass through the trainer
        x, y = (torch.stack(column) for column in zip(*samples, strict=True))
        return {"x": x, "y": y, "ids": ["id"] * len(samples)}

    def loss_fn(model, b, step):
        assert b["ids"] == ["id"] * 8
        return mse(model, (b["x"], b["y"]))["loss"]

    history = Trainer(build(), loss_fn, make_dataset(), make_config(max_steps=3, amp=True),
                      collate_fn=collate).fit()  # amp=True is silently off on the CPU
    assert len(history) == 3 and all(math.isfinite(v) for v in history.column("loss"))


def test_train_config_takes_the_method_configs_training_fields_and_runtime_on_top(tmp_path):
    from dataclasses import dataclass

    from course_lib.core.settings import CourseConfig
    from course_lib.core.train_config import TRAIN_FIELDS, TrainConfig, train_config

    @dataclass
    class Toy(CourseConfig):
        max_steps: int = 7
        lr: float = 0.5
        width: int = 3  # not a training field: never reaches TrainConfig

    got = train_config(Toy(), lr=0.25, log_every=2, checkpoint_path=tmp_path / "x.pt")
    assert isinstance(got, TrainConfig) and (got.max_steps, got.lr, got.log_every) == (7, 0.25, 2)
    assert got.checkpoint_path == str(tmp_path / "x.pt")  # a Path is stored as text
    assert {"max_steps", "lr"} <= set(TRAIN_FIELDS) and "width" not in TRAIN_FIELDS



def test_an_interrupted_run_resumes_from_its_last_periodic_save(tmp_path):
    # before, a method's run saved only at the end: Ctrl-C after 90% of the
    # steps restarted from step 0
    import dataclasses
    from dataclasses import dataclass

    from course_lib.core.settings import CourseConfig
    from course_lib.core.train_config import train_config

    @dataclass
    class Toy(CourseConfig):
        max_steps: int = 500
        batch_size: int = 8

    assert train_config(Toy(), checkpoint_path=tmp_path / "a.pt").checkpoint_every == 50  # a tenth
    floor = train_config(Toy(max_steps=100), checkpoint_path=tmp_path / "a.pt")
    assert floor.checkpoint_every == 50  # the floor
    assert train_config(Toy()).checkpoint_every is None  # nowhere to save

    path = tmp_path / "run.pt"
    calls = {"n": 0}

    def interrupted(model, batch, step):
        calls["n"] += 1
        if calls["n"] == 180:  # Ctrl-C in the middle of step 180
            raise KeyboardInterrupt
        return mse(model, batch, step)

    config = train_config(Toy(max_steps=200), checkpoint_path=path, lr=1e-2, log_every=10,
                          progress=False)
    with pytest.raises(KeyboardInterrupt):
        Trainer(build(), interrupted, make_dataset(), config).fit()
    resumed = Trainer(build(seed=123), mse, make_dataset(), config)
    resumed.fit()
    uninterrupted = Trainer(build(), mse, make_dataset(),
                            dataclasses.replace(config, checkpoint_path=None))
    uninterrupted.fit()
    assert calls["n"] == 180 and resumed.step == 200
    for p, q in zip(uninterrupted.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------- keep_best

def _scripted_evaluate(values, seen):
    """An evaluate hook reporting `values` in turn and recording the weights it saw at each call."""
    calls = iter(values)

    def evaluate(model):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {"val_t2i_r1": next(calls)}

    return evaluate


def test_keep_best_ends_with_the_weights_of_the_best_evaluation(tmp_path):
    seen = []
    path = str(tmp_path / "best.pt")
    config = make_config(max_steps=12, eval_every=4, keep_best="val_t2i_r1", checkpoint_path=path)
    trainer = Trainer(build(), mse, make_dataset(), config,
                      evaluate=_scripted_evaluate([1.0, 3.0, 3.0], seen))
    history = trainer.fit()
    # steps 4, 8, 12: the best (3.0) first at step 8, kept over its equal at 12
    assert len(seen) == 3
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, seen[1][name]), name
    # the last step's differ
    assert not torch.equal(seen[1]["body.0.weight"], seen[2]["body.0.weight"])
    assert history[-1] == {"step": 12, "kept_step": 8, "kept_val_t2i_r1": 3.0}
    # the finished checkpoint holds the kept weights: loading it gives them back
    again = Trainer(build(seed=5), mse, make_dataset(), config, evaluate=_scripted_evaluate([], []))
    again.fit()
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, seen[1][name]), name


def test_keep_best_across_an_interruption(tmp_path):
    seen = []
    kwargs = dict(max_steps=12, eval_every=4, keep_best="val_t2i_r1", checkpoint_every=4)
    values = [5.0, 1.0, 2.0]  # the best is the first: it must survive the stop at step 6
    resumed, _ = _fit_interrupted(tmp_path, kwargs, 6, _scripted_evaluate(values, seen))
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, seen[0][name]), name


def test_keep_best_needs_an_evaluate_that_reports_it():
    with pytest.raises(ValueError, match="no evaluate was given"):
        Trainer(build(), mse, make_dataset(), make_config(keep_best="val_t2i_r1"))
    trainer = Trainer(build(), mse, make_dataset(),
                      make_config(max_steps=2, keep_best="val_t2i_r1"),
                      evaluate=lambda model: {"val_mse": 1.0})
    with pytest.raises(KeyError, match="not a metric of evaluate"):
        trainer.fit()
