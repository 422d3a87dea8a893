"""Training on several processes (torch.distributed): N processes of batch B train like one of batch N·B.

A dual encoder's in-batch negatives are the batch itself (VSE++'s hinge, LightningDOT's CMR, CLIP),
so data parallelism must not shrink them: every process all-gathers the features of the others and
scores its queries against the whole global batch (open_clip's `gather_features`). Three pieces:

- the process group from torchrun's environment (`init_distributed` / `destroy_distributed`), and
  rank helpers that answer rank 0 of 1 when there is no group, so the same code runs un-distributed;
- `gather_features` and `gathered_loss`: the loss of the global batch on every process;
- what course_lib.train.Trainer uses to run under DistributedDataParallel (`data_parallel_loss`,
  `mean_over_ranks`, `barrier`): the Trainer wraps the model and shards the data itself.

The gradient factor. Let L be the loss of the gathered global batch; every process computes the same
value, but autograd reaches the parameters only through its own slice f_r of the features (the
others arrive through all_gather, without a graph), so process r's backward gives
g_r = dL/df_r · df_r/dθ. One process of batch N·B would get dL/dθ = Σ_r g_r. DDP all-reduces the
gradients and *averages* them, giving (1/N) Σ_r g_r: N times too small. So `gathered_loss`
multiplies the gradient (not the value) by N. open_clip leaves the 1/N in (Adam mostly absorbs a
constant factor, but not its eps, nor clipping at a fixed gradient norm); we keep the runs equal.

    # 2 CPU processes (gloo); `python -m course_lib.distributed ...` runs the same on one process
    torchrun --standalone --nproc_per_node=2 -m course_lib.distributed --method vsepp --steps 20 --smoke
    # one machine with 8 GPUs (NCCL, one process per GPU, 128 / 8 = 16 pairs each)
    torchrun --standalone --nproc_per_node=8 -m course_lib.distributed --method lightningdot
    # 2 machines x 8 GPUs: the same line on each; HOST:29500 = one of them, reachable by both
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-id=job42 --rdzv-backend=c10d
             --rdzv-endpoint=HOST:29500 -m course_lib.distributed --method lightningdot
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.losses import batch_scores, contrastive_loss, hinge_triplet_loss
from course_lib.settings import get_device, seed_everything, smoke_mode

# the variables torchrun sets for every process it starts (env:// rendezvous of init_process_group)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- the process group ------------------------------------------------------------------------
def is_distributed() -> bool:
    """True inside an initialised process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the group; 0 without one."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of processes in the group; 1 without one."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0: the process that logs, evaluates and saves."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every process (a no-op without a group)."""
    if get_world_size() > 1:
        dist.barrier()


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Join the process group that torchrun describes in the environment (TORCHRUN_VARIABLES).

    backend: None picks "nccl" when the course device (settings.get_device) is CUDA, with each
    process on cuda:LOCAL_RANK, else "gloo" (CPU). Without torchrun's variables, or with
    WORLD_SIZE=1, nothing is initialised and the run is an ordinary single process. Returns True
    when this process is one of several. timeout_s: how long a collective waits for the others.
    """
    if is_distributed():
        return get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE is set but {missing} are not: start every process with torchrun "
                           "(torchrun --nproc_per_node=N -m ...), which sets all of them")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: install the standard wheel")
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend is None:
        backend = "nccl" if get_device().type == "cuda" else "gloo"
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs: "
                               "start at most one process per GPU (--nproc_per_node)")
        torch.cuda.set_device(local_rank)  # so "cuda" means this process's own GPU from now on
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return True


def destroy_distributed() -> None:
    """Leave the process group, if any (call once training is done, on every process)."""
    if is_distributed():
        dist.destroy_process_group()


# ---- the global batch's loss ------------------------------------------------------------------
def gather_features(*features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every process's features concatenated in rank order: each (B, E) -> (N·B, E).

    all_gather's copies carry no gradient, so this process's own slot is replaced by the tensor
    it gave (open_clip's gather_features with gather_with_grad=False, local_loss=False): the
    gradient flows through the local part only, and `gathered_loss` restores the rest. Every
    process must pass the same shapes (the Trainer's equal shards do). Without a group: unchanged.
    """
    world = get_world_size()
    if world == 1:
        return features
    rank, gathered = get_rank(), []
    for local in features:
        parts = [torch.empty_like(local) for _ in range(world)]  # N x (B, E)
        dist.all_gather(parts, local.detach().contiguous())
        parts[rank] = local  # the live tensor, with its graph
        gathered.append(torch.cat(parts))  # (N·B, E)
    return tuple(gathered)


def gathered_loss(score_loss: Callable[[torch.Tensor], torch.Tensor], match_one_process: bool = True):
    """A Trainer `loss_fn(model, batch, step)` for a dual encoder whose forward gives (image (B, E),
    text (B, E)) features: score_loss on the (N·B, N·B) scores of the gathered global batch.

    score_loss: e.g. losses.contrastive_loss (LightningDOT's CMR) or
    functools.partial(losses.hinge_triplet_loss, margin=0.2, max_violation=False) (VSE++). Its
    value is the one-process loss of the global batch on every process; match_one_process
    multiplies its gradient by N (module docstring), so that after DDP's average the gradients
    are the one-process ones too. False: open_clip's convention, gradients 1/N of those.
    """
    def loss_fn(model: nn.Module, batch, step: int = 0) -> torch.Tensor:
        scores = batch_scores(*gather_features(*model(batch)))  # (N·B, N·B), positives on the diagonal
        loss, world = score_loss(scores), get_world_size()
        if world == 1 or not match_one_process:
            return loss
        # loss - loss.detach() is exactly 0 with gradient 1: the value stays, the gradient is x world
        return loss + (world - 1) * (loss - loss.detach())

    return loss_fn


# ---- what the Trainer needs --------------------------------------------------------------------
class _LossOfModel(nn.Module):
    """The module DDP wraps: its forward is the whole loss_fn(model, batch, step) on the plain model.

    DDP all-reduces only the gradients of work done inside its own forward, while course loss_fns
    call methods of the model (model.encode_images, model.objective): run inside this forward,
    they keep working unchanged and are all synchronised."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, loss_fn, batch, step: int):
        return loss_fn(self.model, batch, step)


def data_parallel_loss(model: nn.Module) -> nn.Module | None:
    """DistributedDataParallel around `model` (already on its device) for the Trainer; call it as
    ddp(loss_fn, batch, step). None without a group of several processes.

    Building it copies rank 0's parameters and buffers to every process. find_unused_parameters:
    LightningDOT's pre-training heads sit idle in fine-tuning, and pre-training uses one head per
    batch, so some parameters get no gradient; DDP would otherwise stop with an error. Where every
    parameter is used (VSE++), DDP warns once that the search (one graph walk per step) found none."""
    if get_world_size() == 1:
        return None
    return nn.parallel.DistributedDataParallel(_LossOfModel(model), find_unused_parameters=True)


def mean_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value averaged over the processes (one all_reduce; every process must pass the same keys).

    For a gathered loss every process holds the same value; for a per-sample mean it makes the mean
    of the global batch. Unchanged without a group."""
    world = get_world_size()
    if world == 1:
        return values
    keys = sorted(values)  # the same order on every process
    total = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)  # (K,)
    dist.all_reduce(total)
    mean = dict(zip(keys, (total / world).tolist()))
    return {k: mean[k] for k in values}


# ---- command line ------------------------------------------------------------------------------
def _build(method: str, smoke: bool, seed: int):
    """(bench, tokenizer, model, loss_fn, method config, training lr, default steps) of one method."""
    # imported here: the models import course_lib.train, which imports this module
    from course_lib.data.synthetic import SyntheticConfig, make_benchmark
    from course_lib.data.tokenizer import build_word_tokenizer

    bench = make_benchmark(SyntheticConfig.smoke() if smoke else SyntheticConfig(), seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions)
    seed_everything(seed)  # the initial weights (DDP copies rank 0's to the others anyway)
    if method == "vsepp":
        from course_lib.vsepp import VsePPConfig, build_dual_encoder

        c = VsePPConfig.smoke(seed=seed) if smoke else VsePPConfig(seed=seed)
        if c.sum_warmup_steps:
            raise ValueError("sum_warmup_steps is not supported here: gathered_loss uses one hinge")
        loss = partial(hinge_triplet_loss, margin=c.margin, max_violation=c.max_violation)
        return (bench, tokenizer, build_dual_encoder(c, bench["train"], tokenizer), gathered_loss(loss),
                c, c.lr, c.max_steps)
    from course_lib.lightningdot import LightningDOTConfig
    from course_lib.lightningdot_train import build_lightningdot

    c = LightningDOTConfig.smoke(seed=seed) if smoke else LightningDOTConfig(seed=seed)
    # CMR fine-tuning (eq. 6) from random weights: no pre-training stage here
    return (bench, tokenizer, build_lightningdot(c, bench["train"], tokenizer),
            gathered_loss(contrastive_loss), c, c.finetune_lr, c.finetune_steps)


def _summary(args, trainer, bench, tokenizer, seconds: float, cpu: float) -> dict:
    """Rank 0's printed result: sizes, timing, the last logged loss, the test split's recalls."""
    from course_lib.methods import retrieval_evaluator, similarity

    model, world = trainer.model.eval(), get_world_size()
    with torch.no_grad():
        test = retrieval_evaluator(bench["test"], lambda m, s: similarity(m, s, tokenizer))(model)
    summary = {"method": args.method, "processes": world, "backend": dist.get_backend() if world > 1
               else None, "device": str(trainer.device), "threads": torch.get_num_threads(),
               "batch_per_process": trainer.config.batch_size,
               "global_batch": trainer.config.batch_size * world, "steps": trainer.step,
               "fit_seconds": round(seconds, 2), "fit_cpu_seconds": round(cpu, 2),
               "final_loss": (trainer.history.column("loss", eval=False) or [None])[-1],
               "test": {k: round(float(v), 2) for k, v in test.items()}}
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    """Train one course dual encoder on the synthetic benchmark on every process torchrun started
    (or on one process without torchrun); rank 0 prints and returns a summary, the others None."""
    from course_lib.data.datasets import PairCollate, PairDataset
    from course_lib.train import Trainer

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m course_lib.distributed",
        description="Contrastive training of a course dual encoder on N processes (DDP, gathered "
                    "in-batch negatives); without torchrun, one process.")
    parser.add_argument("--method", choices=("vsepp", "lightningdot"), default="vsepp",
                        help="VSE++ (sum of hinges) or LightningDOT's CMR fine-tuning, from random weights")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the method's)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="pairs per step over all processes (default: the method's batch_size, "
                             "128); each process takes global-batch / N")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny benchmark and schedule (or COURSE_SMOKE=1)")
    parser.add_argument("--checkpoint", default=None, help="Trainer checkpoint path (rank 0 writes it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    init_distributed()
    try:
        world, smoke = get_world_size(), args.smoke or smoke_mode()
        bench, tokenizer, model, loss_fn, c, lr, steps = _build(args.method, smoke, args.seed)
        global_batch = args.global_batch or c.batch_size
        if global_batch % world:
            raise ValueError(f"--global-batch {global_batch} does not split over {world} processes: "
                             f"pick a multiple of {world}")
        train = c.train_config(max_steps=args.steps or steps, lr=lr, batch_size=global_batch // world,
                               log_every=10, checkpoint_path=args.checkpoint)
        trainer = Trainer(model, loss_fn, PairDataset(bench["train"], modality=model.modality), train,
                          collate_fn=PairCollate(tokenizer))
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.fit()
        seconds = time.perf_counter() - start
        # CPU seconds of all processes together: what the run costs, whatever else shares the cores
        cpu = mean_over_ranks({"cpu": time.process_time() - cpu_start}, trainer.device)["cpu"] * world
        summary = _summary(args, trainer, bench, tokenizer, seconds, cpu) if is_main_process() else None
        barrier()  # the others wait for rank 0's evaluation: every process leaves the group together
        return summary
    finally:
        destroy_distributed()


__all__ = ["init_distributed", "destroy_distributed", "is_distributed", "get_rank", "get_world_size",
           "is_main_process", "barrier", "gather_features", "gathered_loss", "data_parallel_loss",
           "mean_over_ranks", "main", "TORCHRUN_VARIABLES"]

if __name__ == "__main__":
    main()
