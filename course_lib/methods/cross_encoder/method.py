"""Training the cross-encoder (model.py) with image-text matching (ITM) and hard negatives, as
ALBEF / BLIP. Two ITM losses (CrossEncoderConfig.loss):

- "listwise" (itm.py): a softmax cross-entropy per caption over the batch's images and per image
  over its captions (a ranking loss); with itc_weight > 0, ALBEF's image-text contrastive loss
  picks the grid from clusters of look-alike scenes (hard negatives).
- "binary" (below): one logit per pair thresholded by binary cross-entropy, with random or mined
  negatives.

Which loss and towers, and what each gave: docs/tuning_notes.md, "Cross-encoder".

Binary ITM: every positive (image, caption) pair of a batch brings a negative caption for its
image and a negative image for its caption, each labelled 0 (ALBEF's scheme). A negative is
"hard" with probability hard_negative_fraction, mined from a dual encoder (mining.py: what hard
negatives teach, and VSE++'s mined without forming its 2 GB matrix), else uniformly random. Two
more knobs of CrossEncoderConfig:
- hard_negative_after: a first share of the steps with random negatives only. A model from
  scratch must first learn that words and regions should agree at all: random negatives teach
  that sooner than mined ones.
- online_candidates: draw c negatives per slot and train on the one the current model scores
  highest (`keep_hardest`), the model's own hard-negative mining, at the price of scoring c times
  as many negative pairs (without gradient).

Our captions name two objects of a scene of four or five, so a mined "negative" is often true of
its pair: on the default train split 10% of a VSE++ top-16 (vs 0.5% of random pairs) satisfy the
caption (data.captions.satisfies). They are labelled negative all the same, as in ALBEF: one
reason why hard negatives help less here than in the papers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from course_lib.core.checkpoints import finished_checkpoint, inference
from course_lib.core.history import History
from course_lib.core.split_cache import SplitCache
from course_lib.core.stages import Stage, config_fields
from course_lib.core.train import Trainer
from course_lib.core.train_config import train_config
from course_lib.data.datasets import (
    IMAGE_KEYS,
    CaptionDataset,
    TextCollate,
    image_batch,
    image_fields,
    text_fields,
)
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

# the learning curve's galleries: val[:100] and train[:100], 500 captions each. Every pair costs a
# forward pass: 50k pairs a split, where the dual encoders' 1,000 images would be 5M
CURVE_IMAGES = 100


class ITMCollate:
    """CaptionDataset items (the positives' captions) -> ITM pairs with their labels.

    For B positives and n = negatives_per_positive the batch holds B * (1 + 2n) pairs, in order:
    the B positives, their images with n * B negative captions, their captions with n * B negative
    images. Output: {"images": regions/boxes/region_mask (P, ...), "texts": input_ids,
    attention_mask (P, T), "labels": (P,) float, 1 = match, "img_index", "txt_index": (P,) the
    split's rows of each pair}. Sampling uses torch's global RNG, which the Trainer checkpoints,
    so an interrupted run resumes with the same negatives. A negative may still be true of its
    pair (the module docstring); as ALBEF, we ignore it.
    """

    def __init__(self, split, tokenizer, max_length: int, negatives_per_positive: int = 1,
                 hard_fraction: float = 0.5, mined: MinedNegatives | None = None,
                 candidates: int = 1, hard_after_steps: int = 0,
                 step: Callable[[], int] | None = None):
        self.captions = split.captions
        self.images = image_fields(split)  # (N, R, ...) views, no copy
        self.txt2img = torch.from_numpy(split.txt2img)  # (T,)
        self.text_collate = TextCollate(tokenizer, max_length)
        self.n = negatives_per_positive
        self.hard_fraction = hard_fraction if mined is not None else 0.0
        self.mined = mined
        if candidates < 1:
            raise ValueError(f"candidates={candidates} must be >= 1")
        self.candidates = candidates
        # random negatives only while step() < hard_after_steps: see CrossEncoderConfig
        self.hard_after_steps, self.step = hard_after_steps, step or (lambda: 0)

    def current_hard_fraction(self) -> float:
        return 0.0 if self.step() < self.hard_after_steps else self.hard_fraction

    def negative_images(self, texts: torch.Tensor) -> torch.Tensor:
        """One image per caption index, never the caption's own. (P,) -> (P,)"""
        n_images = len(self.images["regions"])
        shift = torch.randint(1, n_images, texts.shape)  # uniform over the other images
        images = (self.txt2img[texts] + shift) % n_images
        hard = torch.rand(texts.shape) < self.current_hard_fraction()
        if hard.any():
            pool = self.mined.images_for_text[texts[hard]]  # (h, k)
            images[hard] = pool[torch.arange(len(pool)), torch.randint(pool.shape[1], (len(pool),))]
        return images

    def negative_texts(self, images: torch.Tensor) -> torch.Tensor:
        """One caption per image index, never one of the image's own. (P,) -> (P,)"""
        texts = torch.randint(len(self.captions), images.shape)
        while (own := self.txt2img[texts] == images).any():  # redraw the few own captions
            texts[own] = torch.randint(len(self.captions), (int(own.sum()),))
        hard = torch.rand(images.shape) < self.current_hard_fraction()
        if hard.any():
            pool = self.mined.texts_for_image[images[hard]]  # (h, k)
            texts[hard] = pool[torch.arange(len(pool)), torch.randint(pool.shape[1], (len(pool),))]
        return texts

    def __call__(self, items: list[dict]) -> dict:
        texts = torch.tensor([item["index"] for item in items], dtype=torch.long)  # (B,)
        images = self.txt2img[texts]  # (B,)
        m = self.n * self.candidates  # negatives drawn per positive and side: (mB,) below
        repeated_images, repeated_texts = images.repeat(m), texts.repeat(m)  # (mB,)
        image_rows = torch.cat([images, repeated_images, self.negative_images(repeated_texts)])
        text_rows = torch.cat([texts, self.negative_texts(repeated_images), repeated_texts])
        labels = torch.zeros(len(image_rows))
        labels[:len(texts)] = 1.0
        return {"images": image_batch({k: self.images[k] for k in IMAGE_KEYS}, image_rows),
                "texts": self.text_collate.encode([self.captions[t] for t in text_rows.tolist()]),
                "labels": labels, "img_index": image_rows, "txt_index": text_rows,
                "candidates": self.candidates}


def keep_hardest(model: CrossEncoder, batch: dict) -> dict:
    """An ITMCollate batch drawn with `candidates` = c > 1 -> the batch of c = 1 whose every
    negative is the highest-scoring (by the model as it is now, no gradient) of its c candidates.

    Candidates of one slot sit nB apart (ITMCollate repeats the B positives c * n times), so each
    side's (c * nB,) block reshapes to (c, nB). The scoring pass costs about a third of a training
    pass per pair: the online hard-negative step ALBEF does with in-batch similarities.
    """
    c = int(batch.get("candidates", 1))
    if c == 1:
        return batch
    labels = batch["labels"]  # (B + 2 * c * nB,)
    B = int(labels.sum())
    cnB = (len(labels) - B) // 2  # candidates per side
    negatives = torch.arange(B, len(labels), device=labels.device)  # (2 * c * nB,)
    with torch.no_grad():
        scores = model({k: v[negatives] for k, v in batch["images"].items()},
                       {k: v[negatives] for k, v in batch["texts"].items()})  # (2 * c * nB,)
    nB = cnB // c
    keep = [torch.arange(B, device=labels.device)]
    for side in range(2):  # negative captions, then negative images
        block = scores[side * cnB:(side + 1) * cnB].view(c, nB)
        best = block.argmax(0) * nB + torch.arange(nB, device=labels.device)  # (nB,) in the block
        keep.append(B + side * cnB + best)
    keep = torch.cat(keep)  # (B + 2 * nB,)
    images, texts = ({k: v[keep] for k, v in batch[side].items()} for side in ("images", "texts"))
    return {"images": images, "texts": texts, "labels": labels[keep],
            "img_index": batch["img_index"][keep], "txt_index": batch["txt_index"][keep],
            "candidates": 1}


def itm_loss(model: CrossEncoder, batch: dict, step: int = 0,
             balance_classes: bool = True) -> dict:
    """Binary cross-entropy of the matching logits, and the pair accuracy at threshold 0.
    balance_classes: weigh positives by (#negatives / #positives), so both classes count alike."""
    batch = keep_hardest(model, batch)  # a no-op unless negatives were drawn with candidates > 1
    logits = model(batch["images"], batch["texts"])  # (P,)
    labels = batch["labels"]  # (P,)
    positive_weight = (labels == 0).sum() / (labels == 1).sum() if balance_classes else None
    loss = F.binary_cross_entropy_with_logits(logits, labels, pos_weight=positive_weight)
    accuracy = ((logits > 0).float() == labels).float().mean()
    return {"loss": loss, "accuracy": accuracy}


def build_cross_encoder(config: CrossEncoderConfig, split, tokenizer, towers=None) -> CrossEncoder:
    """A fresh CrossEncoder sized for the split's region features and the tokenizer's vocabulary.
    towers: the trained SCAN model config.towers="scan" reads; the cross-encoder keeps a copy."""
    return CrossEncoder(split.regions.shape[-1], len(tokenizer), config,
                        pad_token_id=tokenizer.pad_token_id, towers=towers)


def train_cross_encoder(bench, tokenizer, config: CrossEncoderConfig | None = None, *, towers=None,
                        negatives_similarity=None, checkpoint_path=None, evaluate_on=None,
                        eval_every: int | None = None, progress: bool = True,
                        device: str | None = None) -> tuple[CrossEncoder, History]:
    """Train on bench["train"] with ITM. towers: the trained SCAN model that config.towers="scan"
    reads (copied, frozen). negatives_similarity (n_images, n_texts): a dual encoder's train-split
    scores to mine hard negatives from; None = all negatives random. evaluate_on: a split (or
    learning_curve_splits' dict) whose every pair is scored every eval_every steps and at the end.
    A finished checkpoint at checkpoint_path is loaded instead of training (Trainer's cache)."""
    cfg = config or CrossEncoderConfig()
    split = bench["train"]
    torch.manual_seed(cfg.seed)  # the initial weights
    model = build_cross_encoder(cfg, split, tokenizer, towers)
    trainer = None  # the collate reads trainer.step (the resumed one after a restart)
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
                             step=lambda: trainer.step)
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
    """The cross-encoder as a benchmark method: it scores every (image, caption) pair.

    towers: the SCANMethod whose trained encoders config.towers="scan" reads (fitted when the
    cross-encoder must train); None = a SCANMethod of SCANConfig.for_course(seed=config.seed). The
    benchmark passes its own "scan", so SCAN trains once. miner: optional `(bench, tokenizer,
    cache_dir) -> train similarity` for hard negatives, e.g. `dual_encoder_miner(VsePPMethod())`
    (VSE++ trained or loaded from cache_dir, its train-split embeddings), called only when a model
    must train with config.loss == "binary" and config.hard_negative_fraction > 0. Without one,
    every negative is random (or the batch's own, with the listwise loss).
    """

    checkpoint_prefix = "cross_encoder"
    config_class = CrossEncoderConfig
    # ~10k pairs/s on one CPU thread: 600k pairs = 600 t2i queries of test, about a minute
    eval_pairs = (600_000, 20_000)
    # one query against 5k images takes about 0.4 s on one CPU thread; bigger galleries extrapolate
    timed_sizes = ((1_000, 2_500, 5_000), (25, 50, 100))

    def __init__(self, config: CrossEncoderConfig | None = None, name: str = "cross_encoder",
                 miner: Callable | None = None, progress: bool = True,
                 towers: Method | None = None):
        super().__init__(config, name, progress)
        cfg = self.config
        # only the binary loss with hard negatives draws from a miner: otherwise nothing (the model,
        # its file, the models a --retrain trains before it) depends on one, so it is not kept
        self.miner = miner if cfg.loss == "binary" and cfg.hard_negative_fraction > 0 else None
        if cfg.towers == "scan" and towers is None:
            towers = SCANMethod(SCANConfig.for_course(seed=cfg.seed), progress=progress)
        self.towers = towers if cfg.towers == "scan" else None
        negatives = ("hard negatives mined by a dual encoder" if self._mines()
                     else "in-batch negatives (listwise)" if cfg.loss == "listwise"
                     else "random negatives")
        inputs = ", over SCAN's frozen word and region encoders" if self.towers is not None else ""
        self.notes = (f"single-stream cross-encoder ({cfg.layers} layers, d={cfg.hidden}{inputs}), "
                      f"ITM with {negatives}; scores every pair, so cost grows with the gallery")

    def _mines(self) -> bool:
        """Mined negatives are drawn by the binary ITM loss only."""
        cfg = self.config
        return self.miner is not None and cfg.loss == "binary" and cfg.hard_negative_fraction > 0

    def stage(self, bench, tokenizer) -> Stage:
        """Every config field, on bench["train"], from the SCAN model its towers come from; and,
        when it mines, the miner and the dual encoder it mines with (a model trained without mined
        negatives does not depend on them, so its name does not either)."""
        towers = self.towers and self.towers.stage(bench, tokenizer)
        mined_by = ()
        if self._mines():
            source = getattr(self.miner, "method", None)
            mined_by = (getattr(self.miner, "__qualname__", None),
                        source.stage(bench, tokenizer) if isinstance(source, Method) else None)
        return Stage(self.checkpoint_prefix, reads=config_fields(self.config), data=bench["train"],
                     vocabulary=tokenizer, version=self.format_version,
                     starts_from=(towers, *mined_by))

    def build_model(self, bench, tokenizer) -> CrossEncoder:
        towers = self.towers.build_model(bench, tokenizer) if self.towers is not None else None
        return build_cross_encoder(self.config, bench["train"], tokenizer, towers)

    def train(self, bench, tokenizer, checkpoint_path, cache_dir):
        sims, towers = None, None
        finished = finished_checkpoint(checkpoint_path, self.config.max_steps)
        if self._mines() and not finished:
            sims = self.miner(bench, tokenizer, cache_dir)  # only needed to train (or resume)
        if self.towers is not None:  # trained SCAN to start from
            towers = self.trained_model_of(self.towers, bench, tokenizer, cache_dir,
                                           needed=not finished)
        curve = self.learning_curve(bench, self.config.max_steps, n_images=CURVE_IMAGES)
        return train_cross_encoder(bench, tokenizer, self.config, towers=towers,
                                   negatives_similarity=sims, checkpoint_path=checkpoint_path,
                                   progress=self.progress, **curve)

    def embedded(self, split) -> Embedded:
        """The split through the fitted model's one-sided embeddings, kept per split and model
        (SplitCache): what every pair of the split shares, computed once."""
        if getattr(self, "_embedded", None) is None:
            self._embedded = SplitCache()
        return self._embedded.get(split, self.model,
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
        """A zero-argument callable answering one text query: the caption is embedded, then fused
        with every gallery image, whose embeddings are ready offline (`embedded`)."""
        model = self._fitted()
        gallery = self.embedded(split).images(slice(None))  # offline: (N, R, H), (N, R)
        caption = split.captions[caption_index]
        n = split.n_images

        def rows(start, stop):
            return torch.arange(start, stop), torch.zeros(stop - start, dtype=torch.long)

        def answer() -> np.ndarray:
            with inference(model) as device:
                text = text_fields([caption], self.tokenizer, self.config.max_text_length)  # (1, T)
                text_on_device = {k: v.to(device) for k, v in text.items()}
                tokens = model.embed_text(text_on_device).cpu()  # (1, T, H)
            scores = score_embedded(model, gallery, (tokens, text["attention_mask"]), n, rows,
                                    batch_size=BLOCK_PAIRS)  # (n,)
            return torch.topk(scores, min(top_k, n)).indices.numpy()

        return answer


@register_method("cross_encoder", order=2.5)
def _cross_encoder(build) -> CrossEncoderMethod:
    return CrossEncoderMethod(build.config(CrossEncoderConfig),
                              miner=dual_encoder_miner(build.method("vsepp")),
                              towers=build.method("scan"))
