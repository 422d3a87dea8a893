"""Distilling the Slow teacher into the Fast student (Miech et al. 2021, §3.2, eq. 5-8): eq. 8 =
distillation_loss(student, teacher, tau) + alpha * eq. 4, each caption's softmaxes over
(FastConfig.distill_candidates):

    "batch"  the batch's B images (the paper's)
    "mined"  its own image and the plain Fast model's top K - 1 others (`mine_candidates`), as
             RocketQA / ColBERTv2 distil; `mined_distill_loss(None, ...)`: all mass on it (control)

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
    """h (P,) of the pairs (images[image_rows[p]], texts[text_rows[p]]), no gradient."""
    with inference(teacher) as device:
        kvs = teacher.keys_values(teacher.visual_tokens(move_to_device(images, device)))  # by image
        image_rows, text_rows = image_rows.to(device), text_rows.to(device)
        pairs = {d: [kv[:, image_rows] for kv in layers] for d, layers in kvs.items()}  # (2, P, ..)
        words = {k: texts[k].to(device)[text_rows] for k in ("input_ids", "attention_mask")}
        return teacher.log_likelihood(pairs, words)  # words: (P, T) each


def teacher_scores(teacher: SlowModel, batch: dict) -> torch.Tensor:
    """(B, B) h of every image (rows) with every caption of a batch: B^2 decoder passes."""
    B = batch["input_ids"].shape[0]
    rows = torch.arange(B).repeat_interleave(B)  # (B*B,) image of each pair
    cols = torch.arange(B).repeat(B)  # (B*B,) caption of each pair
    return teacher_pair_scores(teacher, image_inputs(teacher, batch), rows, batch, cols).view(B, B)


def distill_loss(teacher: SlowModel, config: FastConfig):
    """Eq. 8's loss_fn over the batch's images; logs both parts."""
    def loss_fn(model: FastModel, batch: dict, step: int = 0) -> dict:
        student = batch_scores(*model(batch))  # (B, B)
        distill = distillation_loss(student, teacher_scores(teacher, batch), tau=config.tau)
        nce = joint_nce_loss(student)
        return {"loss": distill + config.alpha * nce, "distill": distill, "nce": nce}

    return loss_fn


def mine_candidates(model: FastModel, split, tokenizer, k: int) -> torch.Tensor:
    """(T, k) image rows per caption: its own, then the model's k - 1 best other images."""
    if not 2 <= k <= split.n_images:
        raise ValueError(f"distill_top_k={k} must be in [2, {split.n_images}]: the caption's own "
                         "image and at least one other")
    image_emb, text_emb = encode_split(model, split, tokenizer)  # (N, E), (T, E)
    mined = mine_negatives_from_embeddings(image_emb, text_emb, split.txt2img, k - 1)
    own = torch.from_numpy(np.asarray(split.txt2img, dtype=np.int64))[:, None]  # (T, 1)
    return torch.cat([own, mined.images_for_text], dim=1)  # (T, 1 + (k - 1))


def mined_distill_loss(teacher: SlowModel | None, config: FastConfig, candidates: torch.Tensor,
                       split):
    """Eq. 8's loss_fn: eq. 4 over the batch, plus for its first distill_batch_size captions the
    softmax of f.g / tau against h / tau over their K `candidates`."""
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
        device, inverse = text_all.device, inverse.to(text_all.device)
        picked = image_inputs(model, collate_images([images[int(i)] for i in unique]))
        picked = move_to_device(picked, device)  # pixels (U, 3, H, W) or regions (U, R, D), boxes
        image_emb = model.encode_images(picked)  # (U, E)
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
