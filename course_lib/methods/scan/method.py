"""SCAN's training and its benchmark Method.

    model, history = train_scan(bench, tokenizer, SCANConfig())
    sims = scan_matrix(model, bench["test"], tokenizer)        # (n_images, n_texts)
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from course_lib.core.checkpoints import model_device
from course_lib.core.history import History
from course_lib.core.losses import hinge_name
from course_lib.core.settings import seed_everything
from course_lib.data.datasets import TextCollate
from course_lib.methods.base import PairwiseMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator
from course_lib.methods.registry import register_method
from course_lib.methods.scan.model import (
    SCANConfig,
    SCANModel,
    build_scan,
    encode_regions,
    encode_words,
    scan_loss,
    scan_matrix,
)


def train_scan(bench: dict, tokenizer, config: SCANConfig | None = None, *, checkpoint_path=None,
               evaluate_on=None, eval_every: int | None = None, progress: bool = True,
               device: str | None = None) -> tuple[SCANModel, History]:
    """Train a SCANModel (or load a finished checkpoint_path) -> (model.eval(), history)."""
    config = config or SCANConfig()
    seed_everything(config.seed)  # the model's initial weights; the Trainer seeds the rest
    model = build_scan(config, bench["train"], tokenizer)
    evaluate = retrieval_evaluator(
        evaluate_on, lambda m, split: scan_matrix(m, split, tokenizer, progress=False))
    history = fit_pairs(model, scan_loss(config.margin, config.max_violation), bench["train"],
                        tokenizer, config, modality=model.modality, evaluate=evaluate,
                        eval_every=eval_every, log_every=25, progress=progress,
                        checkpoint_path=checkpoint_path, device=device)
    return model.eval(), history


# ----------------------------------------------------------------------------- the method
class SCANMethod(PairwiseMethod):
    """Every query attends over every gallery item; encodings cached for the last split scored."""

    checkpoint_prefix = "scan"
    config_class = SCANConfig
    eval_pairs = (8_000_000, 400_000)  # ~1 s per 100k pairs on a CPU thread: test t2i in full
    _encoded: tuple = (None, None, None)  # (split, model, (regions, region_mask, {caption: words}))

    def _encodings(self, split, text_indices) -> tuple:
        """(regions (N, R, E), region_mask, words (m, L, E), word_mask) of text_indices, cached."""
        model = self._fitted()
        if self._encoded[0] is not split or self._encoded[1] is not model:
            show = self.progress and split.n_images > 20_000
            regions = encode_regions(model, split, progress=show)
            self._encoded = (split, model, (*regions, {}))  # {caption index: its words (L_t, E)}
        regions, region_mask, words = self._encoded[2]
        texts = [int(t) for t in text_indices]
        new = [t for t in dict.fromkeys(texts) if t not in words]
        if new:
            encoded, real = encode_words(model, split, self.tokenizer, texts=new,
                                         progress=self.progress and len(new) > 20_000)  # (n, L, E)
            # words come first: a caption's real ones are a prefix of its row
            words.update((t, w[m]) for t, w, m in zip(new, encoded, real, strict=True))
        chosen = [words[t] for t in texts]
        padded = pad_sequence(chosen, batch_first=True)  # (m, L, E), zero past each caption's words
        mask = torch.arange(padded.shape[1]) < torch.tensor([len(w) for w in chosen])[:, None]
        return regions, region_mask, padded, mask

    @torch.no_grad()
    def score_block(self, split, image_indices, text_indices) -> torch.Tensor:
        """(n, m) SCAN scores of the chosen images against the chosen captions, on the CPU."""
        model, device = self._fitted().eval(), model_device(self.model)
        regions, region_mask, words, word_mask_ = self._encodings(split, text_indices)
        img = torch.as_tensor(image_indices, dtype=torch.long)
        return model.score(regions[img].to(device), region_mask[img].to(device), words.to(device),
                           word_mask_.to(device)).cpu()  # (n, m)

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        """PairwiseRanking.score_pairs, the captions encoded first in batches, not singly."""
        self._encodings(split, np.unique(np.asarray(text_indices)))
        return super().score_pairs(split, image_indices, text_indices)

    @property
    def notes(self) -> str:
        c = self.config
        image = "Linear(region) + Linear(box)" if c.use_boxes else "Linear(region)"
        agg = f"lse {c.lambda_lse:g}" if c.agg == "lse" else c.agg
        loss = hinge_name(c.max_violation)
        words = "bi-GRU words" if c.text_encoder is None else (
            f"Linear({c.text_encoder}'s word states), its last {c.text_trainable_layers} layers "
            "fine-tuned" if c.text_trainable_layers
            else f"Linear(frozen {c.text_encoder}'s word states)")
        return (f"SCAN {c.direction} stacked cross attention ({image} / {words}, lambda_softmax "
                f"{c.lambda_softmax:g}, {agg}), {loss}; attends over every gallery image per query")

    def build_model(self, bench: dict, tokenizer) -> SCANModel:
        return build_scan(self.config, bench["train"], tokenizer)

    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        return train_scan(bench, tokenizer, self.config, checkpoint_path=checkpoint_path,
                          progress=self.progress)

    def similarity(self, split) -> torch.Tensor:
        return scan_matrix(self._fitted(), split, self.tokenizer, progress=self.progress)  # (N, T)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One text query: regions encoded here (offline), each call attends over every image."""
        model, device = self._fitted().eval(), model_device(self.model)
        regions, region_mask = (x.to(device) for x in encode_regions(model, split))  # offline
        collate, caption = TextCollate(self.tokenizer), split.captions[caption_index]

        @torch.no_grad()
        def answer() -> torch.Tensor:
            batch = {k: v.to(device) for k, v in collate.encode([caption]).items()}  # (1, T)
            scores = model.score(regions, region_mask, *model.encode_texts(batch))  # (N, 1)
            return torch.topk(scores[:, 0], min(top_k, len(scores))).indices.cpu().numpy()

        return answer


register_method("scan", order=2.0)(lambda build: SCANMethod(build.config(SCANConfig)))
