"""Slow over a cached gallery (Miech et al. 2021, §3.3): the cross-attention keys and values depend
on the image only, so a split's are computed once offline and a pair costs the decoders alone.

    states = compute_states(slow_model, bench["test"], tokenizer)      # offline: CNN + K/V
    h = score_cached_pairs(slow_model, states, image_rows, text_rows)  # (P,) log-likelihoods
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from course_lib.core.checkpoints import inference, model_device
from course_lib.core.train import move_to_device
from course_lib.data.datasets import ImageDataset, collate_images, text_fields
from course_lib.methods.fast_slow.model import SlowModel, image_inputs
from course_lib.methods.queries import checked_pairs, length_blocks

LOGITS_PER_BLOCK = 1 << 24  # logits a direction per block of pairs (64 MB): memory, not the result


@dataclass
class SlowStates:
    """A split's image keys / values and tokenised captions (T, L): 131 MB for the 1k test split."""

    kvs: dict  # {"fwd": [(2, N, h, M, d)] * layers, "bwd": ...}
    input_ids: torch.Tensor  # (T, L)
    attention_mask: torch.Tensor  # (T, L)

    def image(self, rows) -> dict:
        """Keys / values of images `rows` (P,), as log_likelihood takes them."""
        return {d: [kv[:, rows] for kv in kvs] for d, kvs in self.kvs.items()}  # contiguous copies

    def text(self, rows) -> dict:
        mask = self.attention_mask[rows]
        length = int(mask.sum(1).max()) if len(mask) else 1  # drop the padding every row has
        return {"input_ids": self.input_ids[rows][:, :length], "attention_mask": mask[:, :length]}


def compute_states(model: SlowModel, split, tokenizer, *, batch_size: int = 256, device=None,
                   progress: bool = False) -> SlowStates:
    """Run the CNN and the K/V projections once over a split's images; tokenise its captions."""
    dataset = ImageDataset(split, modality=model.modality)
    parts = {"fwd": [], "bwd": []}
    starts = range(0, len(dataset), batch_size)
    with inference(model, device) as device:
        for start in tqdm(starts, desc="slow gallery", disable=not progress, leave=False):
            stop = min(start + batch_size, len(dataset))
            block = image_inputs(model, collate_images([dataset[i] for i in range(start, stop)]))
            kvs = model.keys_values(model.visual_tokens(move_to_device(block, device)))
            for d in parts:
                parts[d].append([kv.cpu() for kv in kvs[d]])  # (2, b, h, M, d) each
    kvs = {d: [torch.cat(layer, dim=1) for layer in zip(*blocks, strict=True)]
           for d, blocks in parts.items()}
    texts = text_fields(split.captions, tokenizer, model.config.max_text_length)
    return SlowStates(kvs, texts["input_ids"], texts["attention_mask"])


def score_cached_pairs(model: SlowModel, states: SlowStates, image_indices, text_indices, *,
                       batch_size: int = 512, device=None) -> torch.Tensor:
    """h (P,) of the pairs (image_indices[p], text_indices[p]) from cached states."""
    images, texts = checked_pairs(image_indices, text_indices)
    out = torch.empty(len(images))
    # each pair's logits are (T, V) a direction: a WordPiece vocabulary of 30k makes 2.4 MB a pair
    vocab, length = model.output.out_features, states.input_ids.shape[1]
    batch_size = max(1, min(batch_size, LOGITS_PER_BLOCK // (vocab * length)))
    with _scoring(model, device) as device:
        for rows in length_blocks(states.attention_mask.sum(1)[texts], batch_size):  # (b,) each
            kvs = {d: [kv.to(device) for kv in layers]
                   for d, layers in states.image(images[rows]).items()}
            words = {k: v.to(device) for k, v in states.text(texts[rows]).items()}
            out[rows] = model.log_likelihood(kvs, words).cpu()
    return out


@contextmanager
def _scoring(model: nn.Module, device=None):
    """checkpoints.inference, minus its model.to walk when already there in eval mode."""
    device = model_device(model, device)
    if model.training or model_device(model) != device:
        with inference(model, device) as device:
            yield device
    else:
        with torch.no_grad():
            yield device
