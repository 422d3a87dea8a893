"""Training the cross-encoder with image-text matching (ITM), as ALBEF / BLIP, and its Method.
CrossEncoderConfig.loss is "listwise" (itm.py, the default) or "binary": per-pair BCE, each positive
bringing a negative caption and a negative image (ALBEF's scheme), each "hard" (mined by a dual
encoder) with probability hard_negative_fraction after hard_negative_after, or the hardest of
online_candidates draws (`keep_hardest`). Our captions name two objects of four or five, so 10% of
a VSE++ top-16 satisfy the caption yet count as negatives, as in ALBEF. What each loss and tower
gave: docs/tuning_notes.md, "Cross-encoder".
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from course_lib.core.checkpoints import finished_checkpoint, inference
from course_lib.core.history import History
from course_lib.core.stages import Stage, config_fields
from course_lib.core.train import Trainer
from course_lib.core.train_config import train_config
from course_lib.data.datasets import CaptionDataset, text_fields
from course_lib.methods.base import Method, PairwiseMethod
from course_lib.methods.cross_encoder.itm import GridCollate, itc_itm_loss, listwise_itm_loss
from course_lib.methods.cross_encoder.mining import (
    MinedNegatives,
    dual_encoder_miner,
    mine_negatives,
)
from course_lib.methods.cross_encoder.model import (
    BLOCK_PAIRS,
    CrossEncoder,
    CrossEncoderConfig,
    Embedded,
    score_embedded,
    score_index_pairs,
    score_matrix,
)
from course_lib.methods.encoding import retrieval_evaluator
from course_lib.methods.registry import register_method
from course_lib.methods.scan.method import SCANMethod
from course_lib.methods.scan.model import SCANConfig

# the learning curve's galleries: val[:100], train[:100] (50k pairs a split, each a forward pass)
CURVE_IMAGES = 100


class ITMCollate(GridCollate):
    """B positives' captions -> B * (1 + 2n) ITM pairs (n = negatives_per_positive): the positives,
    their images with nB negative captions, their captions with nB negative images; "labels" (P,), 1
    = match. Sampling uses torch's global RNG, which the Trainer checkpoints."""

    def __init__(self, split, tokenizer, max_length: int, negatives_per_positive: int = 1,
                 hard_fraction: float = 0.5, mined: MinedNegatives | None = None,
                 candidates: int = 1, hard_after_steps: int = 0, step: Callable | None = None):
        if candidates < 1:
            raise ValueError(f"candidates={candidates} must be >= 1")
        super().__init__(split, tokenizer, max_length)
        self.n, self.mined, self.candidates = negatives_per_positive, mined, candidates
        self.hard_fraction = hard_fraction if mined is not None else 0.0
        self.hard_after_steps, self.step = hard_after_steps, step or (lambda: 0)

    def current_hard_fraction(self) -> float:
        return 0.0 if self.step() < self.hard_after_steps else self.hard_fraction

    def _harden(self, drawn: torch.Tensor, keys: torch.Tensor, mined: str) -> torch.Tensor:
        """Each of drawn (P,) at chance current_hard_fraction -> a pick from its key's mined row."""
        hard = torch.rand(keys.shape) < self.current_hard_fraction()
        if hard.any():
            pool = getattr(self.mined, mined)[keys[hard]]  # (h, k)
            drawn[hard] = pool[torch.arange(len(pool)), torch.randint(pool.shape[1], (len(pool),))]
        return drawn

    def negative_images(self, texts: torch.Tensor) -> torch.Tensor:
        """(P,) captions -> (P,) images, never the caption's own."""
        n_images = len(self.images["regions"])
        shift = torch.randint(1, n_images, texts.shape)  # uniform over the other images
        return self._harden((self.txt2img[texts] + shift) % n_images, texts, "images_for_text")

    def negative_texts(self, images: torch.Tensor) -> torch.Tensor:
        """(P,) images -> (P,) captions, never one of the image's own."""
        texts = torch.randint(len(self.captions), images.shape)
        while (own := self.txt2img[texts] == images).any():  # redraw the few own captions
            texts[own] = torch.randint(len(self.captions), (int(own.sum()),))
        return self._harden(texts, images, "texts_for_image")

    def __call__(self, items: list[dict]) -> dict:
        texts = torch.tensor([item["index"] for item in items], dtype=torch.long)  # (B,)
        images = self.txt2img[texts]  # (B,)
        m = self.n * self.candidates  # negatives drawn per positive and side: (mB,) below
        repeated_images, repeated_texts = images.repeat(m), texts.repeat(m)  # (mB,)
        image_rows = torch.cat([images, repeated_images, self.negative_images(repeated_texts)])
        text_rows = torch.cat([texts, self.negative_texts(repeated_images), repeated_texts])
        return {**self.encode(image_rows, text_rows), "candidates": self.candidates,
                "labels": (torch.arange(len(image_rows)) < len(texts)).float()}  # positives lead


def keep_hardest(model: CrossEncoder, batch: dict) -> dict:
    """An ITMCollate batch of c candidates per negative slot (nB apart) -> each slot's top one."""
    c = int(batch.get("candidates", 1))
    if c == 1:
        return batch
    labels = batch["labels"]  # (B + 2 * c * nB,)
    B, device = int(labels.sum()), labels.device
    cnB = (len(labels) - B) // 2  # candidates per side
    with torch.no_grad():  # rows B onwards: the (2 * c * nB,) negatives
        scores = model(*({k: v[B:] for k, v in batch[side].items()}
                         for side in ("images", "texts")))  # (2 * c * nB,)
    nB = cnB // c
    best = scores.view(2, c, nB).argmax(1)  # (2, nB): per side (negative captions, then images)
    slots = B + torch.arange(2, device=device)[:, None] * cnB + torch.arange(nB, device=device)
    keep = torch.cat([torch.arange(B, device=device), (slots + best * nB).flatten()])  # (B + 2nB,)
    return {**{side: {k: v[keep] for k, v in batch[side].items()} for side in ("images", "texts")},
            **{k: batch[k][keep] for k in ("labels", "img_index", "txt_index")}, "candidates": 1}


def itm_loss(model: CrossEncoder, batch: dict, step: int = 0, balance_classes: bool = True) -> dict:
    """BCE of the matching logits (positives weighted as the negatives with balance_classes)."""
    batch = keep_hardest(model, batch)  # a no-op unless negatives were drawn with candidates > 1
    logits = model(batch["images"], batch["texts"])  # (P,)
    labels = batch["labels"]  # (P,)
    positive_weight = (labels == 0).sum() / (labels == 1).sum() if balance_classes else None
    return {"loss": F.binary_cross_entropy_with_logits(logits, labels, pos_weight=positive_weight),
            "accuracy": ((logits > 0).float() == labels).float().mean()}


def build_cross_encoder(config: CrossEncoderConfig, split, tokenizer, towers=None) -> CrossEncoder:
    """A fresh CrossEncoder; towers: the trained SCAN model it copies."""
    return CrossEncoder(split.regions.shape[-1], len(tokenizer), config,
                        pad_token_id=tokenizer.pad_token_id, towers=towers)


def train_cross_encoder(bench, tokenizer, config: CrossEncoderConfig | None = None, *, towers=None,
                        negatives_similarity=None, checkpoint_path=None, evaluate_on=None,
                        eval_every: int | None = None, progress: bool = True,
                        device: str | None = None) -> tuple[CrossEncoder, History]:
    """Train with ITM; negatives_similarity (n_images, n_texts): a dual encoder's, to mine from."""
    cfg = config or CrossEncoderConfig()
    split = bench["train"]
    torch.manual_seed(cfg.seed)  # the initial weights
    model = build_cross_encoder(cfg, split, tokenizer, towers)
    if cfg.loss == "listwise":
        collate = GridCollate(split, tokenizer, cfg.max_text_length)
        loss_fn = (partial(itc_itm_loss, grid_size=cfg.grid_size, clusters=cfg.grid_clusters,
                           itc_weight=cfg.itc_weight) if cfg.itc_weight > 0 else listwise_itm_loss)
    elif cfg.loss == "binary":
        mined = (None if negatives_similarity is None
                 else mine_negatives(negatives_similarity, split.txt2img, cfg.hard_negative_k))
        collate = ITMCollate(split, tokenizer, cfg.max_text_length, cfg.negatives_per_positive,
                             cfg.hard_negative_fraction, mined, cfg.online_candidates,
                             hard_after_steps=round(cfg.hard_negative_after * cfg.max_steps),
                             step=lambda: trainer.step)  # the resumed step after a restart
        loss_fn = partial(itm_loss, balance_classes=cfg.balance_classes)
    else:
        raise ValueError(f"loss={cfg.loss!r}: 'listwise' or 'binary'")
    train = train_config(cfg, log_every=max(1, cfg.max_steps // 100), progress=progress,
                         device=device, checkpoint_path=checkpoint_path, eval_every=eval_every)
    evaluate = retrieval_evaluator(
        evaluate_on, lambda m, one: score_matrix(m, one, tokenizer, progress=False))
    trainer = Trainer(model, loss_fn, CaptionDataset(split), train, collate_fn=collate,
                      evaluate=evaluate)
    history = trainer.fit()
    return model.eval(), history


# ----------------------------------------------------------------------------- the method
class CrossEncoderMethod(PairwiseMethod):
    """The cross-encoder as a benchmark method: it scores every (image, caption) pair. towers: the
    SCANMethod it reads (default SCANConfig.for_course's); miner: `(bench, tokenizer, cache_dir) ->
    train similarity`, used only by the binary loss with hard_negative_fraction > 0."""

    checkpoint_prefix = "cross_encoder"
    config_class = CrossEncoderConfig
    eval_pairs = (600_000, 20_000)  # ~10k pairs/s on a CPU thread: 600 t2i test queries, ~1 min
    timed_sizes = ((1_000, 2_500, 5_000), (25, 50, 100))  # a query, 5k images: ~0.4 s (a thread)

    def __init__(self, config: CrossEncoderConfig | None = None, name: str = "cross_encoder",
                 miner: Callable | None = None, progress: bool = True,
                 towers: Method | None = None):
        super().__init__(config, name, progress)
        cfg = self.config
        # only mining draws from the miner; otherwise nothing depends on it, so it is not kept
        self.miner = miner if cfg.loss == "binary" and cfg.hard_negative_fraction > 0 else None
        if cfg.towers == "scan" and towers is None:
            towers = SCANMethod(SCANConfig.for_course(seed=cfg.seed), progress=progress)
        self.towers = towers if cfg.towers == "scan" else None
        negatives = ("hard negatives mined by a dual encoder" if self.miner is not None
                     else "in-batch negatives (listwise)" if cfg.loss == "listwise"
                     else "random negatives")
        inputs = ", over SCAN's frozen word and region encoders" if self.towers is not None else ""
        self.notes = (f"single-stream cross-encoder ({cfg.layers} layers, d={cfg.hidden}{inputs}), "
                      f"ITM with {negatives}; scores every pair, so cost grows with the gallery")

    def stage(self, bench, tokenizer) -> Stage:
        """Every field, bench["train"], the SCAN towers and (when mining) the miner's model."""
        towers = self.towers and self.towers.stage(bench, tokenizer)
        mined_by = ()
        if self.miner is not None:
            source = getattr(self.miner, "method", None)
            mined_by = (getattr(self.miner, "__qualname__", None),
                        source.stage(bench, tokenizer) if isinstance(source, Method) else None)
        return Stage(self.checkpoint_prefix, reads=config_fields(self.config), data=bench["train"],
                     vocabulary=tokenizer, version=self.format_version,
                     starts_from=(towers, *mined_by))

    def build_model(self, bench, tokenizer) -> CrossEncoder:
        towers = self.towers and self.towers.build_model(bench, tokenizer)
        return build_cross_encoder(self.config, bench["train"], tokenizer, towers)

    def train(self, bench, tokenizer, checkpoint_path, cache_dir):
        finished = finished_checkpoint(checkpoint_path, self.config.max_steps)
        # mined negatives are only needed to train (or resume); towers: the trained SCAN
        sims = self.miner(bench, tokenizer, cache_dir) if self.miner and not finished else None
        towers = self.towers and self.trained_model_of(self.towers, bench, tokenizer, cache_dir,
                                                       needed=not finished)
        curve = self.learning_curve(bench, self.config.max_steps, n_images=CURVE_IMAGES)
        return train_cross_encoder(bench, tokenizer, self.config, towers=towers,
                                   negatives_similarity=sims, checkpoint_path=checkpoint_path,
                                   progress=self.progress, **curve)

    def embedded(self, split) -> Embedded:
        """The split through the fitted model's one-sided embeddings, once per split and model."""
        return self._kept("_embedded").get(split, self.model,
                                           lambda: Embedded(self._fitted(), split, self.tokenizer))

    def score_block(self, split, image_indices, text_indices) -> torch.Tensor:
        """(n, m) logits of the chosen images against the chosen captions: n * m fused pairs."""
        return score_matrix(self._fitted(), split, self.tokenizer, image_indices, text_indices,
                            progress=False, embedded=self.embedded(split))

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        """(P,) logits of the pairs (image_indices[p], text_indices[p]): the re-ranker API."""
        return score_index_pairs(self._fitted(), split, self.tokenizer, image_indices, text_indices,
                                 embedded=self.embedded(split))

    def similarity(self, split) -> torch.Tensor:
        """(n_images, n_texts) logits of every pair: O(n_images * n_texts) fused pairs."""
        return score_matrix(self._fitted(), split, self.tokenizer, progress=self.progress,
                            embedded=self.embedded(split))

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One text query: the caption embedded, then fused with every pre-embedded image."""
        model = self._fitted()
        gallery = self.embedded(split).images(slice(None))  # offline: (N, R, H), (N, R)
        caption = split.captions[caption_index]
        n = split.n_images

        def rows(start, stop):  # every image with the one caption
            return torch.arange(start, stop), torch.zeros(stop - start, dtype=torch.long)

        def answer() -> np.ndarray:
            with inference(model) as device:
                text = text_fields([caption], self.tokenizer, self.config.max_text_length)  # (1, T)
                tokens = model.embed_text({k: v.to(device) for k, v in text.items()})  # (1, T, H)
            scores = score_embedded(model, gallery, (tokens.cpu(), text["attention_mask"]), n, rows,
                                    batch_size=BLOCK_PAIRS)  # (n,)
            return torch.topk(scores, min(top_k, n)).indices.numpy()

        return answer


@register_method("cross_encoder", order=2.5)
def _cross_encoder(build) -> CrossEncoderMethod:
    return CrossEncoderMethod(build.config(CrossEncoderConfig),
                              miner=dual_encoder_miner(build.method("vsepp")),
                              towers=build.method("scan"))
