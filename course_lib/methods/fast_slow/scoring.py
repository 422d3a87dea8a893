"""Slow over a cached gallery (Miech et al. 2021, §3.3): the cross-attention keys and values depend
on the image only, so a split's are computed once offline and a pair costs the decoders alone.

    states = compute_states(slow_model, bench["test"], tokenizer)      # offline: CNN + K/V
    h = score_cached_pairs(slow_model, states, image_rows, text_rows)  # (P,) log-likelihoods
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.core.checkpoints import inference, model_device
from course_lib.data.datasets import ImageDataset, make_loader, text_fields
from course_lib.methods.encoding import encode_batches
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
    def keys_values(batch: dict) -> dict:  # per decoder, per block (2, b, h, M, d) on the CPU
        kvs = model.keys_values(model.visual_tokens(image_inputs(model, batch)))
        return {d: [kv.cpu() for kv in layers] for d, layers in kvs.items()}

    loader = make_loader(ImageDataset(split, modality=model.modality), batch_size)
    parts = encode_batches(model, loader, keys_values, device, progress, "slow gallery")
    kvs = {d: [torch.cat(layer, dim=1) for layer in zip(*(p[d] for p in parts), strict=True)]
           for d in ("fwd", "bwd")}
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
    device = model_device(model, device)
    # checkpoints.inference, minus its model.to walk when the model is there in eval mode already
    ready = not model.training and model_device(model) == device
    with torch.no_grad() if ready else inference(model, device):
        for rows in length_blocks(states.attention_mask.sum(1)[texts], batch_size):  # (b,) each
            kvs = {d: [kv.to(device) for kv in layers]
                   for d, layers in states.image(images[rows]).items()}
            words = {k: v.to(device) for k, v in states.text(texts[rows]).items()}
            out[rows] = model.log_likelihood(kvs, words).cpu()
    return out
