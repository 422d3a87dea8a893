"""Listwise image-text matching for the cross-encoder: for B captions and the U <= B distinct images
they describe, score all U * B pairs (the "grid") and take `losses.listwise_loss`, a softmax
cross-entropy per caption over the U images and per image over the B captions. Binary ITM asks a
logit to cross a threshold; retrieval needs the own image to outscore the others, which this trains
directly, with U - 1 negatives a caption and ~B - 1 an image from the same forward passes. Against
binary ITM and the ITC-picked grid (`itc_itm_loss`): docs/tuning_notes.md, "Cross-encoder".

    collate = GridCollate(bench["train"], tokenizer, max_length=40)
    batch = collate([{"index": t} for t in caption_rows])  # B captions, their U images
    out = listwise_itm_loss(model, batch)  # scores the U * B grid: {"loss", "accuracy"}
"""

from __future__ import annotations

import torch

from course_lib.core.losses import listwise_loss
from course_lib.data.datasets import TextCollate, image_batch, image_fields


class GridCollate:
    """B captions -> {"images" (U, ...), "texts" (B, T), "text_image" (B,), "img_index", ...}."""

    def __init__(self, split, tokenizer, max_length: int):
        self.captions = split.captions
        self.images = image_fields(split)  # (N, R, ...) views, no copy
        self.txt2img = torch.from_numpy(split.txt2img)  # (n_texts,)
        self.text_collate = TextCollate(tokenizer, max_length)

    def encode(self, image_rows: torch.Tensor, text_rows: torch.Tensor) -> dict:
        """The rows' images (n, R, ...) and tokenised captions (m, T), with their indices."""
        texts = self.text_collate.encode([self.captions[t] for t in text_rows.tolist()])  # (m, T)
        return {"images": image_batch(self.images, image_rows), "texts": texts,
                "img_index": image_rows, "txt_index": text_rows}

    def __call__(self, items: list[dict]) -> dict:
        texts = torch.tensor([item["index"] for item in items], dtype=torch.long)  # (B,)
        images, text_image = torch.unique(self.txt2img[texts], return_inverse=True)  # (U,), (B,)
        return {**self.encode(images, texts), "text_image": text_image}


def grid_pairs(images: dict, texts: dict) -> tuple[dict, dict]:
    """U images and B texts -> their U * B pairs, image-major (pair u * B + b = image u, text b)."""
    U, B = len(images["regions"]), len(texts["input_ids"])
    return ({k: v.repeat_interleave(B, dim=0) for k, v in images.items()},  # (U * B, ...)
            {k: v.repeat(U, 1) for k, v in texts.items()})  # (U * B, T)


def listwise_itm_loss(model, batch: dict, step: int = 0) -> dict:
    """`losses.listwise_loss` of the (U, B) grid, and its accuracy (t2i R@1 among the U images)."""
    B = len(batch["texts"]["input_ids"])
    scores = model(*grid_pairs(batch["images"], batch["texts"])).view(-1, B)  # (U, B)
    return {"loss": listwise_loss(scores, batch["text_image"]),
            "accuracy": (scores.argmax(0) == batch["text_image"]).float().mean()}


def itc_hard_grid(similarity: torch.Tensor, text_image: torch.Tensor, size: int,
                  clusters: int) -> torch.Tensor:
    """Pick `size` of a batch's B captions as `clusters` groups of look-alike scenes (ALBEF's
    in-batch hard negatives): each an anchor caption plus images drawn without replacement from
    softmax(similarity[:, anchor]). similarity (U, B), text_image (B,) -> (G,) caption rows."""
    U, B = similarity.shape
    per = max(1, size // clusters)
    caption_of = torch.empty(U, dtype=torch.long)
    caption_of[text_image] = torch.arange(B)  # one caption per image (any)
    taken, chosen, count = torch.zeros(U, dtype=torch.bool), [], 0
    for anchor in range(B):
        if count >= size or int(taken.sum()) == U:
            break
        if taken[text_image[anchor]]:
            continue
        taken[text_image[anchor]] = True
        k = min(per - 1, size - count - 1, int((~taken).sum()))
        chosen.append(torch.tensor([anchor]))
        count += 1 + k
        if k > 0:
            logits = similarity[:, anchor].float().masked_fill(taken, float("-inf"))  # (U,)
            picked = torch.multinomial(torch.softmax(logits, 0), k)  # (k,) images, no replacement
            taken[picked] = True
            chosen.append(caption_of[picked])
    return torch.cat(chosen)


def itc_itm_loss(model, batch: dict, step: int = 0, *, grid_size: int, clusters: int,
                 itc_weight: float) -> dict:
    """ALBEF's ITC + listwise ITM on the `grid_size` captions ITC picks (`itc_hard_grid`)."""
    image_emb, text_emb = model.unimodal(batch["images"], batch["texts"])  # (U, H), (B, H)
    itc_logits = model.itc_log_scale.exp().clamp(max=100) * image_emb @ text_emb.T  # (U, B)
    itc = listwise_loss(itc_logits, batch["text_image"])
    with torch.no_grad():
        rows = itc_hard_grid(itc_logits.detach(), batch["text_image"], grid_size, clusters)  # (G,)
    images, text_image = torch.unique(batch["text_image"][rows], return_inverse=True)  # (Ug,), (G,)
    itm = listwise_itm_loss(model, {"images": {k: v[images] for k, v in batch["images"].items()},
                                    "texts": {k: v[rows] for k, v in batch["texts"].items()},
                                    "text_image": text_image})  # the (Ug, G) grid
    return {"loss": itm["loss"] + itc_weight * itc, "itm": itm["loss"], "itc": itc,
            "accuracy": itm["accuracy"]}
