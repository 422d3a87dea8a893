"""Train one course dual encoder on N processes: the command line over course_lib.core.distributed.

In-batch negatives are gathered across processes, so N processes of batch B train exactly like
one of batch N·B; without torchrun it runs the same on one process.

    torchrun --standalone --nproc_per_node=2 -m course_lib.train_distributed --method vsepp --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from course_lib.core import distributed
from course_lib.core.losses import contrastive_loss, hinge_triplet_loss
from course_lib.core.settings import seed_everything, smoke_mode
from course_lib.core.train import Trainer
from course_lib.core.train_config import train_config
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.encoding import retrieval_evaluator, similarity
from course_lib.methods.lightningdot.method import build_lightningdot
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.methods.vsepp import VsePPConfig, build_dual_encoder


def _build(method: str, smoke: bool, seed: int):
    """(bench, tokenizer, model, loss_fn, method config, training lr, default steps) of a method."""
    bench = make_benchmark(SyntheticConfig.smoke() if smoke else SyntheticConfig(), seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions)
    seed_everything(seed)  # the initial weights (DDP copies rank 0's to the others anyway)
    if method == "vsepp":
        c = VsePPConfig.smoke(seed=seed) if smoke else VsePPConfig(seed=seed)
        if c.sum_warmup_steps:
            raise ValueError("sum_warmup_steps is not supported here: gathered_loss uses one hinge")
        loss = partial(hinge_triplet_loss, margin=c.margin, max_violation=c.max_violation)
        return (bench, tokenizer, build_dual_encoder(c, bench["train"], tokenizer),
                distributed.gathered_loss(loss), c, c.lr, c.max_steps)
    c = LightningDOTConfig.smoke(seed=seed) if smoke else LightningDOTConfig(seed=seed)
    return (bench, tokenizer, build_lightningdot(c, bench["train"], tokenizer),
            distributed.gathered_loss(contrastive_loss), c, c.finetune_lr, c.finetune_steps)


def _summary(args, trainer, bench, tokenizer, seconds: float, cpu: float) -> dict:
    """Rank 0's printed result: sizes, timing, the last loss, the test split's recalls."""
    model, world = trainer.model.eval(), distributed.get_world_size()
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


class _RankZeroParser(argparse.ArgumentParser):
    """Only rank 0 reports a bad command line; the others leave quietly with the same status."""

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(2)
        super().error(message)


def main(argv: list[str] | None = None) -> dict | None:
    """Train on every process torchrun started; rank 0 prints and returns a summary, others None."""
    parser = _RankZeroParser(
        prog="torchrun --nproc_per_node=N -m course_lib.train_distributed",
        description="Contrastive training of a course dual encoder on N processes (DDP, gathered "
                    "in-batch negatives); without torchrun, one process.")
    add = parser.add_argument
    add("--method", choices=("vsepp", "lightningdot"), default="vsepp",
        help="VSE++ (sum of hinges) or LightningDOT's CMR fine-tuning, from random weights")
    add("--steps", type=int, default=None, help="optimizer steps (default: the method's)")
    add("--global-batch", type=int, default=None, help="pairs per step over all processes "
        "(default: the method's batch_size, 128); each process takes global-batch / N")
    add("--smoke", action="store_true", help="tiny benchmark and schedule (or COURSE_SMOKE=1)")
    add("--checkpoint", default=None, help="Trainer checkpoint path (rank 0 writes it)")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    distributed.init_distributed()
    try:
        world, smoke = distributed.get_world_size(), args.smoke or smoke_mode()
        bench, tokenizer, model, loss_fn, c, lr, steps = _build(args.method, smoke, args.seed)
        global_batch = args.global_batch or c.batch_size
        if global_batch % world:
            raise ValueError(f"--global-batch {global_batch} does not split over {world} "
                             f"processes: pick a multiple of {world}")
        train = train_config(c, max_steps=args.steps or steps, lr=lr,
                             batch_size=global_batch // world, log_every=10,
                             checkpoint_path=args.checkpoint)
        pairs = PairDataset(bench["train"], modality=model.modality)
        trainer = Trainer(model, loss_fn, pairs, train, collate_fn=PairCollate(tokenizer))
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.fit()
        seconds = time.perf_counter() - start
        own_cpu = {"cpu": time.process_time() - cpu_start}
        cpu = distributed.mean_over_ranks(own_cpu, trainer.device)["cpu"] * world
        summary = (_summary(args, trainer, bench, tokenizer, seconds, cpu)
                   if distributed.is_main_process() else None)
        distributed.barrier()  # the others wait for rank 0's evaluation: all leave the group as one
        return summary
    finally:
        distributed.destroy_distributed()


if __name__ == "__main__":
    main()
