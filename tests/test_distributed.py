"""Tests for course_lib.core.distributed and the Trainer under DDP.

Two CPU processes (gloo, started by torchrun, as a learner would) each train a VSE++ dual encoder
(dropout off, so every run is deterministic) for two steps on batches of B; the loss and every
parameter's gradient of each step must equal those of one process training on batches of 2B, to
1e-5, and the two processes must end with the same weights. Also: gather_features' values and
where its gradient flows, the gradient factor of gathered_loss (without it, open_clip's
convention, the gradients are half), rank 0 alone evaluating and saving, and the helpers' answers
without a process group.

This file is also the worker that torchrun starts: `torchrun ... tests/test_distributed.py OUT_DIR`.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

from course_lib.core import distributed
from course_lib.core.blocks import SelfAttention
from course_lib.core.losses import contrastive_loss, hinge_triplet_loss
from course_lib.core.train import Trainer
from course_lib.core.train_config import TrainConfig
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.vsepp import VsePPConfig, build_dual_encoder

B = 4  # pairs per process; the one-process reference trains on 2 * B
PROCESSES = 2
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # torch.testing.assert_close's
APPROX = dict(rel=1e-5, abs=1e-5)  # the same, in pytest.approx's words
MAX_VIOLATION = functools.partial(hinge_triplet_loss, margin=0.2, max_violation=True)
# name -> (loss on the global batch's scores, gathered_loss's match_one_process, grad_accum_steps)
SCENARIOS = {"hinge": (MAX_VIOLATION, True, 1),  # VSE++: a sum over the batch, hardest negatives
             "contrastive": (contrastive_loss, True, 1),  # LightningDOT's CMR: a mean
             "accumulated": (MAX_VIOLATION, True, 2),  # two micro-batches per step (DDP's no_sync)
             "open_clip": (MAX_VIOLATION, False, 1)}  # without the factor: gradients 1/N

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread


@functools.lru_cache(maxsize=1)
def _data():
    bench = make_benchmark(SyntheticConfig.smoke(n_train=12, n_val=2, n_test=2, n_pretrain=0,
                                                 n_compositional=1), seed=0)
    return bench["train"], build_word_tokenizer(bench["train"].captions)


def _model() -> nn.Module:
    """The course's VSE++ dual encoder (region transformer, bi-GRU), small, every dropout off."""
    split, tokenizer = _data()
    torch.manual_seed(0)
    config = VsePPConfig(hidden=16, embed_dim=16, layers=1)
    model = build_dual_encoder(config, split, tokenizer)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, SelfAttention):
            module.dropout = 0.0  # attention dropout is a float argument of the fused kernel
    return model


def train(scenario: str, batch_size: int, checkpoint_path=None) -> dict:
    """Two steps of one scenario on this process: losses, gradients (as the optimizer sees them),
    grad norms, weights after training, and what loss_fn and evaluate were given.

    The warm-up makes the first step's lr 0, so both steps' gradients are taken at the initial
    weights, on two different global batches. With lr > 0 they would not stay within 1e-5: Adam
    divides by sqrt(v) + eps, which turns float noise in gradients that are 0 in exact arithmetic
    (the attention's key bias) into updates of up to lr, in directions the two runs do not share."""
    score_loss, match_one_process, accum = SCENARIOS[scenario]
    split, tokenizer = _data()
    loss = distributed.gathered_loss(score_loss, match_one_process)
    seen = {"loss_fn_models": set(), "evaluated_on_ranks": []}

    def loss_fn(model, batch, step):
        seen["loss_fn_models"].add(type(model).__name__)  # the plain model, never DDP's wrapper
        return loss(model, batch, step)

    def evaluate(model):
        seen["evaluated_on_ranks"].append(distributed.get_rank())
        return {"rank": distributed.get_rank()}

    config = TrainConfig(max_steps=2, batch_size=batch_size, lr=1e-2, warmup_fraction=0.5,
                         grad_clip=1e9, grad_accum_steps=accum, log_every=1, progress=False,
                         device="cpu", checkpoint_path=checkpoint_path)
    trainer = Trainer(_model(), loss_fn, PairDataset(split), config,
                      collate_fn=PairCollate(tokenizer), evaluate=evaluate)
    grads = []
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(
        {name: p.grad.clone() for name, p in trainer.model.named_parameters()
         if p.grad is not None}))
    history = trainer.fit()
    return {"loss": history.column("loss", eval=False), "grad_norm": history.column("grad_norm"),
            "grads": grads,
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "eval_rows": history.rows(eval=True), "loss_fn_models": sorted(seen["loss_fn_models"]),
            "evaluated_on_ranks": seen["evaluated_on_ranks"]}


def worker(out_dir: str) -> None:
    """Each torchrun process: every scenario on B pairs, then gather_features on known values."""
    torch.set_num_threads(1)
    assert distributed.init_distributed(timeout_s=60)  # a stuck collective fails, never hangs
    try:
        rank = distributed.get_rank()
        results = {name: train(name, B,
                               os.path.join(out_dir, "hinge.pt") if name == "hinge" else None)
                   for name in SCENARIOS}
        x = (torch.arange(6.0).view(3, 2) + 10 * rank).requires_grad_()  # (3, 2), rank-dependent
        (gathered,) = distributed.gather_features(x)  # (6, 2)
        (gathered * torch.arange(12.0).view(6, 2)).sum().backward()
        results["gather"] = {"values": gathered.detach(), "grad": x.grad}
        try:
            Trainer(_model(), lambda m, b, s: None, PairDataset(_data()[0]),
                    TrainConfig(drop_last=False))
            results["drop_last_error"] = None
        except ValueError as error:
            results["drop_last_error"] = str(error)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.destroy_distributed()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each rank's results of `worker`, from one `torchrun --nproc_per_node=2` (killed at 120 s)."""
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COURSE_DEVICE": "cpu"}  # gloo even where CUDA is
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={PROCESSES}", __file__, str(out)]
    # its own session, so a timeout kills torchrun and both workers, nothing else
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in 120 s:\n{log[-3000:]}")
    assert proc.returncode == 0, f"torchrun failed (exit {proc.returncode}):\n{log[-3000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(PROCESSES)], out


@pytest.mark.parametrize("scenario", ["hinge", "contrastive", "accumulated"])
def test_two_processes_of_b_train_like_one_of_2b(two_processes, scenario):
    ranks, _ = two_processes
    reference = train(scenario, PROCESSES * B)  # one process, no group: the batches of 2B
    for got in (rank[scenario] for rank in ranks):
        assert got["loss"] == pytest.approx(reference["loss"], **APPROX)
        assert got["grad_norm"] == pytest.approx(reference["grad_norm"], **APPROX)
        assert len(got["grads"]) == len(reference["grads"]) == 2  # both steps
        for step_got, step_ref in zip(got["grads"], reference["grads"], strict=True):
            assert step_got.keys() == step_ref.keys() == dict(_model().named_parameters()).keys()
            for name in step_ref:
                torch.testing.assert_close(step_got[name], step_ref[name], **TOLERANCE, msg=name)
        assert got["loss_fn_models"] == ["DualEncoder"]
    for name, value in ranks[0][scenario]["weights"].items():  # DDP keeps the replicas identical
        assert torch.equal(ranks[1][scenario]["weights"][name], value), name


def test_without_the_factor_the_gradients_are_averaged_over_processes(two_processes):
    # open_clip's convention: the same loss values, gradients 1/N of the one-process ones
    ranks, _ = two_processes
    reference = train("hinge", PROCESSES * B)
    for got in (rank["open_clip"] for rank in ranks):
        assert got["loss"] == pytest.approx(reference["loss"], **APPROX)
        for step_got, step_ref in zip(got["grads"], reference["grads"], strict=True):
            for name, grad in step_ref.items():
                torch.testing.assert_close(step_got[name], grad / PROCESSES, **TOLERANCE, msg=name)


def test_gather_features_values_and_gradient(two_processes):
    ranks, _ = two_processes
    every_rank = torch.cat([torch.arange(6.0).view(3, 2) + 10 * r
                            for r in range(PROCESSES)])  # (6, 2)
    weights = torch.arange(12.0).view(6, 2)  # d(sum(gathered * weights)) / d gathered
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["gather"]["values"], every_rank)
        # the local slice's gradient only: the other rank's rows arrived without a graph
        torch.testing.assert_close(got["gather"]["grad"], weights[3 * rank:3 * rank + 3])


def test_rank_0_alone_evaluates_and_saves(two_processes):
    (first, second), out = two_processes[0], two_processes[1]
    first, second = first["hinge"], second["hinge"]
    assert first["evaluated_on_ranks"] == [0] and first["eval_rows"][0]["rank"] == 0
    assert second["evaluated_on_ranks"] == [] and second["eval_rows"] == []
    saved = torch.load(out / "hinge.pt", weights_only=True)
    assert saved["step"] == 2
    for name, value in second["weights"].items():  # every rank ends with rank 0's saved weights
        torch.testing.assert_close(saved["model"][name], value)


def test_several_processes_need_drop_last(two_processes):
    for got in two_processes[0]:
        assert "drop_last=True" in got["drop_last_error"]


def test_helpers_without_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.init_distributed()  # no torchrun: nothing to join
    assert (distributed.get_rank(), distributed.get_world_size()) == (0, 1)
    assert distributed.is_main_process() and not distributed.is_distributed()
    image, text = torch.randn(3, 4), torch.randn(3, 4)
    assert all(a is b for a, b in zip(distributed.gather_features(image, text), (image, text),
                                      strict=True))
    assert distributed.data_parallel_loss(nn.Linear(2, 2)) is None
    assert distributed.mean_over_ranks({"loss": 1.5}, torch.device("cpu")) == {"loss": 1.5}
    distributed.barrier()  # returns at once
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.init_distributed()


def test_gathered_loss_is_the_plain_loss_in_one_process():
    split, tokenizer = _data()
    model = _model()
    batch = PairCollate(tokenizer)([PairDataset(split)[t] for t in range(5)])
    loss = distributed.gathered_loss(contrastive_loss)(model, batch)
    (grad,) = torch.autograd.grad(loss, model.image_proj.weight)
    expected = contrastive_loss(model.encode_images(batch) @ model.encode_texts(batch).T)  # (5, 5)
    (expected_grad,) = torch.autograd.grad(expected, model.image_proj.weight)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


if __name__ == "__main__":
    worker(sys.argv[1])


def test_a_bad_option_is_reported_by_rank_zero_only(monkeypatch, capsys):
    # under torchrun, `--method nosuch` printed its error once per process,
    # buried in torchrun's output
    from course_lib import train_distributed

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stop:
        train_distributed.main(["--method", "nosuch"])
    assert stop.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        train_distributed.main(["--method", "nosuch"])
    assert stop.value.code == 2 and "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_the_command_line_trains_once():
    # main() ran twice (two `if __name__ == "__main__"` blocks): one process printed its summary
    # twice, and under torchrun the second run's rendezvous hung until notebook 07's 300 s timeout
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "course_lib.train_distributed", "--method",
                           "vsepp", "--steps", "2", "--global-batch", "8", "--smoke"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COURSE_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert sum(line.startswith("{") for line in done.stdout.splitlines()) == 1
