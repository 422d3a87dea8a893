"""A frozen pretrained text encoder's token states, computed once per caption for the whole run.

On real photos several models hold a copy of the same frozen BERT: the linear probe, SCAN, and
through SCAN's towers the cross-encoder and U-BERT's BERT_cross. Each would read every caption of a
split through it again (the full setting's 35,000 captions take minutes on a CPU). A frozen BERT
without gradients is a fixed function of a caption's token ids, so `FROZEN_STATES(bert, input_ids,
attention_mask)` keys each caption's states by the weights' fingerprint and its ids, computes only
the captions it has not seen, and every copy of those weights reads the rest from here.

A caption computed in another batch than before may differ in the last float bits (its batch pads
to another length); its value is the first one computed, the same for every model after it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from torch import nn

# the most the states kept may hold (least recently used first out): the full setting's captions
# through a 384-wide BERT are about 1 GB in float32
FROZEN_STATES_BYTES = 2 * 1024**3


def weights_fingerprint(module: nn.Module) -> str:
    """A hash of every parameter and buffer of `module`, recomputed only when one of them was
    replaced or changed in place (its storage or version counter moved)."""
    tensors = [*module.parameters(), *module.buffers()]
    stamp = tuple((t.data_ptr(), t._version) for t in tensors)
    if getattr(module, "_fingerprint_stamp", None) != stamp:
        digest = hashlib.sha1(type(module).__name__.encode())
        config = getattr(module, "config", None)  # a transformers model: eps, activation, ...
        if hasattr(config, "to_json_string"):
            digest.update(config.to_json_string().encode())
        for t in tensors:
            digest.update(t.detach().float().cpu().numpy().tobytes())
        module._fingerprint_stamp, module._fingerprint = stamp, digest.hexdigest()
    return module._fingerprint


class FrozenStates:
    """Each caption's last hidden states (length, H), kept per (weights, token ids)."""

    def __init__(self, max_bytes: int = FROZEN_STATES_BYTES):
        self.max_bytes, self.bytes = max_bytes, 0
        self.kept: OrderedDict = OrderedDict()  # (fingerprint, ids) -> (length, H): LRU order

    def __call__(self, bert: nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """bert(input_ids, attention_mask).last_hidden_state, zero at padding: (B, T, H). The
        padding must follow the tokens (right padding), as the course's tokenizers put it."""
        lengths = attention_mask.sum(1)  # (B,)
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        if not torch.equal(attention_mask.bool(), positions < lengths[:, None]):
            raise ValueError("FrozenStates reads right-padded batches: every attention_mask row "
                             "must be ones, then zeros")
        weights = weights_fingerprint(bert)
        keys = [(weights, tuple(row[:n].tolist())) for row, n in zip(input_ids, lengths.tolist(),
                                                                     strict=True)]
        found = {key: self.kept[key] for key in keys if key in self.kept}
        missing = [i for i, key in enumerate(keys) if key not in found]
        if missing:
            width = int(lengths[missing].max())
            rows = torch.tensor(missing, device=input_ids.device)
            states = bert(input_ids=input_ids[rows, :width],
                          attention_mask=attention_mask[rows, :width]).last_hidden_state
            for j, i in enumerate(missing):  # (length, H) of each new caption
                found[keys[i]] = states[j, :len(keys[i][1])].clone()
        first = next(iter(found.values()))
        out = first.new_zeros(*input_ids.shape, first.shape[-1])  # (B, T, H)
        for i, key in enumerate(keys):
            out[i, :len(key[1])] = found[key]
        for key, states in found.items():
            self._keep(key, states)
        return out

    def _keep(self, key, states: torch.Tensor) -> None:
        if key in self.kept:
            self.kept.move_to_end(key)
            return
        self.kept[key] = states
        self.bytes += states.numel() * states.element_size()
        while self.bytes > self.max_bytes and len(self.kept) > 1:
            _, dropped = self.kept.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        self.kept.clear()
        self.bytes = 0


FROZEN_STATES = FrozenStates()  # the run's states, shared by every frozen BertTextEncoder

__all__ = ["FROZEN_STATES_BYTES", "FrozenStates", "FROZEN_STATES", "weights_fingerprint"]
