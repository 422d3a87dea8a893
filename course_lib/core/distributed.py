"""Training on several processes (torch.distributed): N processes of batch B train like one of
batch N·B. Without a process group the helpers answer rank 0 of 1, so the same code runs alone.
In-batch negatives are the batch itself, so every process all-gathers the others' features and
scores its queries against the whole global batch (open_clip's `gather_features`).

The gradient factor: autograd reaches the parameters only through a process's own slice f_r of the
features (all_gather's copies have no graph), so process r gets g_r = dL/df_r · df_r/dθ. One
process of batch N·B would get Σ_r g_r, but DDP *averages*: (1/N) Σ_r g_r. So `gathered_loss`
multiplies the gradient (not the value) by N; open_clip leaves the 1/N in (Adam absorbs it, but
not its eps, nor clipping at a fixed norm). The command line: course_lib.train_distributed."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course_lib.core.losses import batch_scores
from course_lib.core.settings import get_device

# the variables torchrun sets for every process it starts (env:// rendezvous)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
    """Join the group torchrun describes in the environment; True when this is one of several
    processes. backend None: "nccl" on CUDA (a process per cuda:LOCAL_RANK), else "gloo"."""
    if is_distributed():
        return get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE is set but {missing} are not: start every process with "
                           "torchrun (torchrun --nproc_per_node=N -m ...), which sets all of them")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: install the standard wheel")
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = backend or ("nccl" if get_device().type == "cuda" else "gloo")
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                               "GPUs: start at most one process per GPU (--nproc_per_node)")
        torch.cuda.set_device(local_rank)  # so "cuda" means this process's own GPU from now on
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return True


def destroy_distributed() -> None:
    """Leave the process group, if any (call once training is done, on every process)."""
    if is_distributed():
        dist.destroy_process_group()


def gather_features(*features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every process's features in rank order, each (B, E) -> (N·B, E); the gradient flows through
    this process's own slot only (open_clip's gather_with_grad=False)."""
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


def gathered_loss(score_loss: Callable[[torch.Tensor], torch.Tensor],
                  match_one_process: bool = True):
    """A Trainer loss_fn for a model whose forward gives (image (B, E), text (B, E)) features:
    score_loss of the gathered (N·B, N·B) scores, its gradient x N if match_one_process."""
    def loss_fn(model: nn.Module, batch, step: int = 0) -> torch.Tensor:
        scores = batch_scores(*gather_features(*model(batch)))  # (N·B, N·B), positives diagonal
        loss, world = score_loss(scores), get_world_size()
        if world == 1 or not match_one_process:
            return loss
        # loss - loss.detach() is 0 with gradient 1: the value stays, the gradient is x world
        return loss + (world - 1) * (loss - loss.detach())

    return loss_fn


class _LossOfModel(nn.Module):
    """The module DDP wraps: its forward is the whole loss_fn(model, batch, step), since DDP syncs
    only work inside its forward and loss_fns call model methods (model.encode_images)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, loss_fn, batch, step: int):
        return loss_fn(self.model, batch, step)


def data_parallel_loss(model: nn.Module) -> nn.Module | None:
    """DDP around `model`, called as ddp(loss_fn, batch, step); None without several processes.
    find_unused_parameters: some heads get no gradient (LightningDOT's, one task per batch)."""
    if get_world_size() == 1:
        return None
    return nn.parallel.DistributedDataParallel(_LossOfModel(model), find_unused_parameters=True)


def mean_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value averaged over the processes (every process passes the same keys)."""
    world = get_world_size()
    if world == 1:
        return values
    keys = sorted(values)  # the same order on every process
    total = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)  # (K,)
    dist.all_reduce(total)
    mean = dict(zip(keys, (total / world).tolist(), strict=True))
    return {k: mean[k] for k in values}
