"""Lesson 06's measuring tools for Fast & Slow: the registered methods taken apart so that one
expensive pass serves many questions (Slow's dense scores once for every cascade; the teacher's
scores of a fixed pool of batches once for every distillation run)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.core.checkpoints import inference
from course_lib.core.encoders import word_mask
from course_lib.core.losses import batch_scores, distillation_loss, joint_nce_loss
from course_lib.core.settings import seed_everything
from course_lib.core.train import Trainer, move_to_device
from course_lib.core.train_config import train_config
from course_lib.data.captions import satisfies
from course_lib.data.datasets import PairCollate, PairDataset
from course_lib.methods.base import fit_pairs
from course_lib.methods.fast_slow import distill
from course_lib.methods.fast_slow.method import nce_loss
from course_lib.methods.fast_slow.model import FastConfig, FastModel, SlowModel
from course_lib.methods.fast_slow.scoring import SlowStates


def direction_log_likelihoods(model: SlowModel, kvs: dict,
                              texts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_fwd, h_bwd), each (B,), of B aligned pairs: eq. 3 per direction (their sum: h, eq. 2)."""
    forward, backward, reversed_ids = model.logits(kvs, texts)
    ids, mask = texts["input_ids"], texts["attention_mask"]
    words = word_mask(ids, mask, model.special)[:, 1:].float()  # (B, T-1) targets that are words
    out = []
    for logits, targets in ((forward, ids), (backward, reversed_ids)):
        log_p = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
        out.append((log_p.gather(2, targets[:, 1:, None]).squeeze(2) * words).sum(1))  # (B,)
    return out[0], out[1]


def slow_direction_scores(model: SlowModel, states: SlowStates, text_queries, *,
                          batch_size: int = 1024, device=None,
                          progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h_fwd and h_bwd (Q, N) of the captions text_queries (Q,) against every image."""
    queries = torch.as_tensor(np.asarray(text_queries), dtype=torch.long)  # (Q,)
    N = states.kvs["fwd"][0].shape[1]
    images = torch.arange(N).repeat(len(queries))  # (Q*N,) query-major
    texts = queries.repeat_interleave(N)  # (Q*N,)
    fwd, bwd = torch.empty(len(images)), torch.empty(len(images))
    with inference(model, device) as device:
        for start in tqdm(range(0, len(images), batch_size), desc="slow pairs",
                          disable=not progress, leave=False):
            rows = slice(start, start + batch_size)
            kvs = move_to_device(states.image(images[rows]), device)
            text = move_to_device(states.text(texts[rows]), device)
            f, b = direction_log_likelihoods(model, kvs, text)
            fwd[rows], bwd[rows] = f.cpu(), b.cpu()
    return fwd.view(len(queries), N), bwd.view(len(queries), N)


def cascade_ranks(first: torch.Tensor, second: torch.Tensor, truth, top_k: int,
                  beta: float = 0.0) -> np.ndarray:
    """0-based rank (Q,) of each query's true item under eq. 9 on dense scores (Q, N): the first
    stage's top_k re-ordered by second + beta * first, the rest after them in first-stage order."""
    first, second = torch.as_tensor(first).float(), torch.as_tensor(second).float()
    truth = torch.as_tensor(np.asarray(truth), dtype=torch.long)
    order = torch.argsort(first, dim=1, descending=True, stable=True)  # (Q, N) the first ranking
    top = order[:, :top_k]  # (Q, K)
    combined = second.gather(1, top) + beta * first.gather(1, top)  # (Q, K)
    top = top.gather(1, torch.argsort(combined, dim=1, descending=True, stable=True))
    ranked = torch.cat([top, order[:, top_k:]], dim=1)  # (Q, N)
    return (ranked == truth[:, None]).float().argmax(1).numpy()


def softmax_entropy(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Entropy (nats) of softmax(scores / tau) over the images: scores (N, T) -> (T,)."""
    log_p = torch.log_softmax(torch.as_tensor(scores).float() / tau, dim=0)  # (N, T)
    return -(log_p.exp() * log_p).sum(0)


def kl_to_teacher(model: FastModel, batches: list[dict], tau: float) -> float:
    """Mean over the captions of `batches` (teacher_batches) of
    KL(softmax(h / tau) || softmax(f.g / tau)) over each batch's images, in nats."""
    total, captions = 0.0, 0
    with inference(model) as device:
        for batch in batches:
            # (B, B) rows images, columns captions
            student = batch_scores(*model(move_to_device(batch, device))).cpu()
            cross = distillation_loss(student, batch["teacher"], tau=tau, reduction="sum")
            total += float(cross - softmax_entropy(batch["teacher"], tau).sum())
            captions += student.shape[1]
    return total / captions


def teacher_batches(teacher: SlowModel, split, tokenizer, n_batches: int, batch_size: int, *,
                    seed: int = 0, progress: bool = False) -> list[dict]:
    """PairCollate batches of distinct captions, each with "teacher": h (B, B), rows images."""
    dataset, collate = PairDataset(split, modality="pixels"), PairCollate(tokenizer)
    rows = np.random.default_rng(seed).permutation(len(dataset))
    if n_batches * batch_size > len(rows):
        raise ValueError(f"{n_batches} batches of {batch_size} need {n_batches * batch_size} "
                         f"pairs; the split has {len(rows)}")
    out = []
    for b in tqdm(range(n_batches), desc="teacher batches", disable=not progress, leave=False):
        batch = collate([dataset[int(i)] for i in rows[b * batch_size:(b + 1) * batch_size]])
        out.append({**batch, "teacher": distill.teacher_scores(teacher, batch).cpu()})  # (B, B)
    return out


def cached_distill_loss(config: FastConfig, with_teacher: bool = True):
    """Eq. 8, the teacher's matrix read from batch["teacher"]; with_teacher=False: eq. 4 alone."""
    def loss_fn(model: FastModel, batch: dict, step: int = 0) -> dict:
        student = batch_scores(*model(batch))  # (B, B)
        nce = joint_nce_loss(student)
        if not with_teacher:
            return {"loss": nce, "nce": nce}
        soft = distillation_loss(student, batch["teacher"], tau=config.tau)
        return {"loss": soft + config.alpha * nce, "distill": soft, "nce": nce}

    return loss_fn


def distill_from_cache(init: FastModel, batches: list[dict], config: FastConfig, *, steps: int,
                       lr: float, with_teacher: bool = True, progress: bool = False, device=None):
    """(model in eval mode, history): a copy of `init` after `steps` of cached_distill_loss."""
    seed_everything(config.seed)
    model = copy.deepcopy(init).train()
    train = train_config(config, batch_size=1, max_steps=steps, lr=lr, log_every=25,
                         progress=progress, device=device)
    history = Trainer(model, cached_distill_loss(config, with_teacher), batches, train,
                      collate_fn=lambda items: items[0]).fit()
    return model.eval(), history


def perfect_teacher_loss(split, config: FastConfig):
    """Eq. 8 with a perfect teacher: each caption's target spread evenly over the batch images it
    is true of (ground truth), at tau 1. `split`: the one whose rows the batches index."""
    truth = torch.from_numpy(satisfies(split.meanings, split.scenes))

    def loss_fn(model: FastModel, batch: dict, step: int = 0) -> dict:
        student = batch_scores(*model(batch))  # (B, B) rows images, columns captions
        nce = joint_nce_loss(student)
        texts, images = batch["txt_index"].cpu(), batch["img_index"].cpu()  # (B,) rows of split
        true = truth[texts][:, images].T.clone()  # (B images, B captions)
        true.fill_diagonal_(True)  # its own image, whatever the generator says of a noisy caption
        target = torch.zeros(true.shape).masked_fill(~true, float("-inf")).to(student.device)
        soft = distillation_loss(student, target, tau=1.0)
        return {"loss": soft + config.alpha * nce, "distill": soft, "nce": nce}

    return loss_fn


MINED_RUNS = ("teacher", "perfect teacher", "own image", "eq. 4 alone")


def mined_students(init: FastModel, teacher: SlowModel, split, tokenizer, config: FastConfig, *,
                   steps: int, progress: bool = False, device=None) -> dict:
    """{name of MINED_RUNS: a copy of `init` after `steps` more steps on `split`}: eq. 8 over
    candidates mined once from init, a perfect teacher, the own image as the only target, eq. 4."""
    candidates = distill.mine_candidates(init, split, tokenizer, config.distill_top_k)  # (T, K)
    losses = {"teacher": distill.mined_distill_loss(teacher.eval(), config, candidates, split),
              "perfect teacher": perfect_teacher_loss(split, config),
              "own image": distill.mined_distill_loss(None, config, candidates, split),
              "eq. 4 alone": nce_loss}
    students = {}
    for name in MINED_RUNS:
        seed_everything(config.seed)
        model = copy.deepcopy(init).train()
        fit_pairs(model, losses[name], split, tokenizer, config, modality="pixels", log_every=25,
                  progress=progress, device=device, batch_size=config.batch_size, max_steps=steps,
                  lr=config.distill_lr)
        students[name] = model.eval()
    return students
