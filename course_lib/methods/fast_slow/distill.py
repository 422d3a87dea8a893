"""Distilling the Slow teacher into the Fast student (Miech et al. 2021, §3.2, eq. 5-8), over two
sets of candidate images per caption (FastConfig.distill_candidates):

    "batch"  the paper's: every caption against the batch's B images; the teacher scores all B^2
             pairs (`teacher_scores`), and eq. 5-7 match the two softmaxes over those B images
    "mined"  eq. 4 over the full batch (as the plain model trains), and for its first
             distill_batch_size captions each one's own image and the plain Fast model's top K - 1
             others of the training split, mined once (`mine_candidates`): the images the student
             confuses, where the teacher's order is what it lacks. So later retrieval distillation
             works (RocketQA, ColBERTv2: the teacher re-scores the retriever's own top
             candidates); the paper is silent on which images its batches hold

In both, the loss is distillation_loss(student, teacher, tau) + alpha * eq. 4 (eq. 8).
`mined_distill_loss(None, ...)` is the mined variant's hard-negative control: the same candidates,
the student's softmax trained towards the caption's own image alone, telling what the teacher adds
apart from what the mined images give.

    candidates = mine_candidates(fast_model, bench["train"], tokenizer, k=16)  # (T, 16), own first
    loss_fn = mined_distill_loss(slow_model, config, candidates, bench["train"])  # for fit_pairs
"""

from __future__ import annotations

import numpy as np
import torch

from course_lib.core.checkpoints import inference
from course_lib.core.losses import batch_scores, distillation_loss, joint_nce_loss
from course_lib.core.train import move_to_device
from course_lib.data.datasets import ImageDataset, collate_images
from course_lib.methods.cross_encoder.mining import mine_negatives_from_embeddings
from course_lib.methods.encoding import encode_split
from course_lib.methods.fast_slow.model import FastConfig, FastModel, SlowModel, image_inputs


def teacher_pair_scores(teacher: SlowModel, images: dict, image_rows: torch.Tensor,
                        texts: dict, text_rows: torch.Tensor) -> torch.Tensor:
    """h (P,) of the pairs (image image_rows[p] of `images`, texts row text_rows[p]): the visual
    tokens and keys / values run once per image of `images` (U: pixels (U, 3, H, W) or regions
    (U, R, D) with boxes), the two decoders once per pair. No gradient, the teacher in eval mode."""
    with inference(teacher) as device:
        kvs = teacher.keys_values(teacher.visual_tokens(move_to_device(images, device)))  # by image
        image_rows, text_rows = image_rows.to(device), text_rows.to(device)
        pairs = {d: [kv[:, image_rows] for kv in layers]  # (2, P, h, M, d)
                 for d, layers in kvs.items()}
        words = {k: texts[k].to(device)[text_rows]  # (P, T)
                 for k in ("input_ids", "attention_mask")}
        return teacher.log_likelihood(pairs, words)


def teacher_scores(teacher: SlowModel, batch: dict) -> torch.Tensor:
    """h of every image of the batch with every caption: (B, B), rows images, columns captions;
    B^2 decoder passes."""
    B = batch["input_ids"].shape[0]
    rows = torch.arange(B).repeat_interleave(B)  # (B*B,) image of each pair
    cols = torch.arange(B).repeat(B)  # (B*B,) caption of each pair
    return teacher_pair_scores(teacher, image_inputs(teacher, batch), rows, batch, cols).view(B, B)


def distill_loss(teacher: SlowModel, config: FastConfig):
    """Eq. 8's loss_fn over the batch's images: distillation_loss(student, teacher, tau) + alpha *
    eq. 4, both means over the batch; logs both parts."""
    def loss_fn(model: FastModel, batch: dict, step: int = 0) -> dict:
        student = batch_scores(*model(batch))  # (B, B)
        distill = distillation_loss(student, teacher_scores(teacher, batch), tau=config.tau)
        nce = joint_nce_loss(student)
        return {"loss": distill + config.alpha * nce, "distill": distill, "nce": nce}

    return loss_fn


def mine_candidates(model: FastModel, split, tokenizer, k: int) -> torch.Tensor:
    """Per caption of `split`, its own image and the model's k - 1 highest-scoring other images:
    (T, k) image rows, own image first (mined once, from the plain Fast model)."""
    if not 2 <= k <= split.n_images:
        raise ValueError(f"distill_top_k={k} must be in [2, {split.n_images}]: the caption's own "
                         "image and at least one other")
    image_emb, text_emb = encode_split(model, split, tokenizer)  # (N, E), (T, E)
    mined = mine_negatives_from_embeddings(image_emb, text_emb, split.txt2img, k - 1)
    others = mined.images_for_text  # (T, k - 1)
    own = torch.from_numpy(np.asarray(split.txt2img, dtype=np.int64))[:, None]  # (T, 1)
    return torch.cat([own, others], dim=1)  # (T, k)


def mined_distill_loss(teacher: SlowModel | None, config: FastConfig, candidates: torch.Tensor,
                       split):
    """Eq. 8's loss_fn over mined candidates, for a batch of B pairs (eq. 4's): eq. 4 over the
    whole batch, and for its first S = config.distill_batch_size captions the softmax over each
    one's K candidate images (`mine_candidates`; rows `txt_index` of `split`) of the student's
    f.g / tau against the teacher's h / tau: S * K teacher pairs a step. loss = distillation +
    alpha * eq. 4. teacher None: the hard-negative control, all on the own image (candidate 0)."""
    images = None  # the split's images, as the student reads them (built at the first step)

    def loss_fn(model: FastModel, batch: dict, step: int = 0) -> dict:
        nonlocal images
        images = images or ImageDataset(split, modality=model.modality)
        image_all, text_all = model(batch)  # (B, E) each
        nce = joint_nce_loss(batch_scores(image_all, text_all))  # eq. 4 over the whole batch
        S = min(config.distill_batch_size, len(text_all))
        rows = candidates[batch["txt_index"][:S].cpu()]  # (S, K) image rows of the split
        K = rows.shape[1]
        unique, inverse = torch.unique(rows, return_inverse=True)  # (U,), (S, K)
        device = text_all.device
        picked = image_inputs(model, collate_images([images[int(i)] for i in unique]))
        picked = move_to_device(picked, device)  # pixels (U, 3, H, W) or regions (U, R, D), boxes
        image_emb = model.encode_images(picked)  # (U, E)
        inverse = inverse.to(device)
        student = (image_emb[inverse] * text_all[:S, None]).sum(-1)  # (S, K) f.g per candidate
        if teacher is None:
            target = torch.full((S, K), float("-inf"), device=device)
            target[:, 0] = 0.0  # all the probability on the caption's own image
        else:
            target = teacher_pair_scores(teacher, picked, inverse.flatten(), batch,
                                         torch.arange(S).repeat_interleave(K)).view(S, K)  # (S, K)
        distill = distillation_loss(student.T, target.T, tau=config.tau)  # softmax over K images
        return {"loss": distill + config.alpha * nce, "distill": distill, "nce": nce}

    return loss_fn


__all__ = ["teacher_pair_scores", "teacher_scores", "distill_loss", "mine_candidates",
           "mined_distill_loss"]
