"""Pre-train, then fine-tune, LightningDOT (§3.1, appendix A.1), and its benchmark method.

    pre-train   on bench["pretrain"] (terse, noisy captions: the course's Conceptual Captions),
                one objective per batch drawn with config.pretrain_tasks' ratios, CMR among them
    fine-tune   on bench["train"] with CMR only

Both use core.train.Trainer (AdamW (0.9, 0.98), weight decay 0.01, 10% warm-up then linear decay, as
A.1), each stage with its own checkpoint.

    model, histories = train_lightningdot(bench, tokenizer, LightningDOTConfig(),
                                          pretrain_checkpoint=..., checkpoint_path=...)
"""

from __future__ import annotations

import numpy as np
import torch

from course_lib.core.checkpoints import finished_checkpoint
from course_lib.core.settings import seed_everything
from course_lib.core.stages import Stage, config_fields
from course_lib.core.tokens import SpecialTokens
from course_lib.methods.base import DualEncoderMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator, similarity
from course_lib.methods.lightningdot.model import OBJECTIVES, LightningDOT, LightningDOTConfig
from course_lib.methods.registry import register_method
from course_lib.methods.rerank import TwoStageMethod

# fields only fine-tuning reads: left out of pre-training's name, so it stays cached
FINETUNE_FIELDS = ("finetune_steps", "finetune_lr")


def task_schedule(tasks: dict, steps: int, seed: int = 0) -> list[str]:
    """Each pre-training step's objective, i.i.d. from a seeded generator (resumable)."""
    names = [name for name in OBJECTIVES if tasks.get(name, 0) > 0]
    if not names:
        raise ValueError(f"no objective has a positive ratio in {tasks}")
    weights = np.array([tasks[name] for name in names], dtype=float)
    picks = np.random.default_rng(seed).choice(len(names), size=steps, p=weights / weights.sum())
    return [names[i] for i in picks]


def pretrain_loss(schedule: list[str]):
    """A Trainer loss_fn: the objective schedule[step] on the batch; logs it under "<task>_loss"."""
    def loss_fn(model: LightningDOT, batch: dict, step: int) -> dict:
        task = schedule[step]
        loss = model.objective(task, batch)
        return {"loss": loss, f"{task}_loss": loss}

    return loss_fn


def cmr_loss(model: LightningDOT, batch: dict, step: int = 0) -> torch.Tensor:
    """Fine-tuning's loss: CMR (eq. 6) on the batch's (B, B) scores."""
    return model.objective("cmr", batch)


def build_lightningdot(config: LightningDOTConfig, split, tokenizer) -> LightningDOT:
    """A fresh model sized for the split's regions and detector classes and the tokenizer."""
    if not split.has_regions:
        raise ValueError(f"LightningDOT reads detector regions, and split {split.name!r} has none: "
                         "extract region features first (data_scripts/) or use the synthetic "
                         "benchmark")
    n_classes = split.region_classes.shape[-1] if split.region_classes is not None else 1
    return LightningDOT(config, len(tokenizer), split.regions.shape[-1], n_classes,
                        special=SpecialTokens.of(tokenizer))


def train_lightningdot(bench: dict, tokenizer, config: LightningDOTConfig | None = None, *,
                       pretrain_checkpoint=None, checkpoint_path=None, evaluate_on=None,
                       eval_every: int | None = None, progress: bool = True,
                       device: str | None = None) -> tuple[LightningDOT, dict]:
    """Pre-train (unless pretrain_steps = 0), then fine-tune with CMR -> (model.eval(), {"pretrain":
    History | None, "finetune": History})."""
    c = config or LightningDOTConfig()
    seed_everything(c.seed)  # the initial weights; each Trainer seeds its own data order
    model = build_lightningdot(c, bench["train"], tokenizer)
    histories = {"pretrain": None, "finetune": None}
    common = dict(max_text_length=c.max_text_length, lr_scales=c.lr_scales(), progress=progress,
                  device=device)  # both stages'
    # a finished fine-tuning checkpoint holds the final weights: pre-train only for its history
    finetuned = finished_checkpoint(checkpoint_path, c.finetune_steps)
    if c.pretrain_steps > 0 and (
            not finetuned or finished_checkpoint(pretrain_checkpoint, c.pretrain_steps)):
        schedule = task_schedule(c.pretrain_tasks, c.pretrain_steps, c.seed)
        histories["pretrain"] = fit_pairs(
            model, pretrain_loss(schedule), bench["pretrain"], tokenizer, c,
            max_steps=c.pretrain_steps, lr=c.pretrain_lr, log_every=max(1, c.pretrain_steps // 100),
            checkpoint_path=pretrain_checkpoint, **common)
    evaluate = retrieval_evaluator(evaluate_on, lambda m, split: similarity(m, split, tokenizer))
    if c.finetune_steps > 0:
        histories["finetune"] = fit_pairs(
            model, cmr_loss, bench["train"], tokenizer, c, evaluate=evaluate, eval_every=eval_every,
            max_steps=c.finetune_steps, lr=c.finetune_lr, log_every=max(1, c.finetune_steps // 100),
            checkpoint_path=checkpoint_path, **common)
    return model.eval(), histories


class LightningDOTMethod(DualEncoderMethod):
    """LightningDOT as a benchmark method; its stage names the pre-training it starts from."""

    checkpoint_prefix = "lightningdot"
    config_class = LightningDOTConfig
    pretrain_checkpoint = None  # where train() finds or writes the pre-trained model

    @property
    def notes(self) -> str:
        c = self.config
        tasks = ("+".join(k for k, v in c.pretrain_tasks.items() if v > 0) if c.pretrain_steps
                 else "none")
        fusion = "fused [CLS]" if c.fuse else "no fusion (MLM/MRM)"
        rate = ("" if c.text_encoder_lr_scale is None
                else f", the text encoder at {c.text_encoder_lr_scale:g}x the rate")
        return (f"two {c.layers}-layer transformers (d={c.hidden}), S = <z0, h0>; pre-training "
                f"{tasks} ({c.pretrain_steps} steps, {fusion}), CMR fine-tuning{rate}; "
                "FAISS IndexFlatIP")

    def pretrain_stage(self, bench: dict, tokenizer) -> Stage | None:
        """Pre-training (None without it): every field but fine-tuning's, on bench["pretrain"]."""
        return None if self.config.pretrain_steps <= 0 else Stage(
            "lightningdot-pretrain", reads=config_fields(self.config, without=FINETUNE_FIELDS),
            data=bench["pretrain"], vocabulary=tokenizer, version=self.format_version)

    def stage(self, bench: dict, tokenizer) -> Stage:
        """Fine-tuning: every field, bench["train"], from the pre-trained model's file."""
        return super().stage(bench, tokenizer, self.pretrain_stage(bench, tokenizer))

    def build_model(self, bench: dict, tokenizer) -> LightningDOT:
        return build_lightningdot(self.config, bench["train"], tokenizer)

    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        pretrain = self.pretrain_stage(bench, tokenizer)
        self.pretrain_checkpoint = None if pretrain is None else pretrain.path(cache_dir)
        return train_lightningdot(bench, tokenizer, self.config,
                                  pretrain_checkpoint=self.pretrain_checkpoint,
                                  checkpoint_path=checkpoint_path, progress=self.progress,
                                  **self.learning_curve(bench, self.config.finetune_steps))


register_method("lightningdot", order=3.0)(
    lambda build: LightningDOTMethod(build.config(LightningDOTConfig)))
RERANK_TOP_M = (20, 50)  # LightningDOT A.1: "for re-ranking, we choose k from {20, 50}"
for _m in RERANK_TOP_M:
    register_method(f"lightningdot+rerank@{_m}", order=3.1)(lambda build, m=_m: TwoStageMethod(
        build.method("lightningdot"), build.method("cross_encoder"), m))
