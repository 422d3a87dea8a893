"""Train U-BERT (§4.3) and retrieve with it in two stages (§4.2): the benchmark's methods.

    L1 = hinge on s1 (B x B intra cosines)   L2 = hinge on s2 (B x B enhanced cosines, B^2 passes)
    both bidirectional and in-batch (the paper: VSE++'s hardest negatives, margin 0.2)

    two_step  step 1: BERT_img, BERT_txt (and the input embeddings) with L1 only
              step 2: the towers frozen (weights and dropout), BERT_cross with L2 only
    joint     L1 + L2 on every weight at once ("not as competitive", the paper says, no numbers)

    model, histories = train_ubert(bench, tokenizer, UBERTConfig(), towers_checkpoint=...,
                                   checkpoint_path=...)

Methods: `ubert-embed` (stage 1: a FAISS index of I_intra), `ubert@20` (its top K re-scored by s2: K
= 20 per caption, 100 per image, the paper's defaults) and the paper's two-stage baseline
`ubert-embed+cross_encoder@20`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import numpy as np
import torch

from course_lib.core.checkpoints import finished_checkpoint, model_device
from course_lib.core.losses import batch_scores, hinge_triplet_loss
from course_lib.core.retrieval import build_index, search
from course_lib.core.serving import QueryTokenizer, Searcher
from course_lib.core.settings import seed_everything
from course_lib.core.stages import Stage, config_fields, config_with_defaults
from course_lib.data.datasets import ImageDataset
from course_lib.methods.base import DualEncoderMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator, similarity
from course_lib.methods.queries import TopK, query_indices
from course_lib.methods.registry import register_method
from course_lib.methods.rerank import Cascade, TwoStageMethod, two_stage_scores
from course_lib.methods.scan.method import SCANMethod
from course_lib.methods.scan.model import SCANConfig
from course_lib.methods.ubert.model import (
    STEP_TWO_PARTS,
    UBERT,
    UBERTConfig,
    UBERTStates,
    build_ubert,
    compute_states,
    rescore_candidates,
    score_cached_pairs,
)

TOP_K = {"t2i": 20, "i2t": 100}  # the paper's K: images re-scored per caption, captions per image
# fields only step 2 reads: left out of step 1's name and model, so BERT_cross variants share towers
CROSS_FIELDS = ("cross_layers", "alpha", "cross_towers", "training",
                "cross_batch_size", "cross_lr", "cross_steps")


def hinge(scores: torch.Tensor, config: UBERTConfig, step: int) -> torch.Tensor:
    """L1 or L2 on (B, B): every hinge for sum_warmup_steps, then (max_violation) the hardest."""
    hardest = config.max_violation and step >= config.sum_warmup_steps
    return hinge_triplet_loss(scores, margin=config.margin, max_violation=hardest)


def tower_loss(config: UBERTConfig):
    """Step 1's loss_fn: L1 on s1 (eq. 14)."""
    def loss_fn(model: UBERT, batch: dict, step: int = 0) -> torch.Tensor:
        return hinge(batch_scores(*model(batch)), config, step)

    return loss_fn


def cross_loss(config: UBERTConfig, with_l1: bool = False):
    """Step 2's loss_fn: L2 on the batch's (B, B) s2 (eq. 15); with_l1 adds L1 (joint)."""
    def loss_fn(model: UBERT, batch: dict, step: int = 0):
        image, text = model.image_states(batch), model.text_states(batch)
        l2 = hinge(model.pair_scores(image, text), config, step)
        if not with_l1:
            return l2
        l1 = hinge(batch_scores(image[2], text[2]), config, step)
        return {"loss": l1 + l2, "l1": l1, "l2": l2}

    return loss_fn


def tower_config(config: UBERTConfig) -> UBERTConfig:
    """Step 1's model config: step-2 fields at their defaults, no SCAN inputs."""
    return dataclasses.replace(config_with_defaults(config, CROSS_FIELDS), cross_towers="none")


def ubert_evaluator(split, tokenizer):
    """A Trainer `evaluate` hook (None -> None): retrieval_metrics of the dense (i2t, t2i) (N, T)
    scores, s1 with each query's top K re-scored by s2 above the rest."""
    def scores(model: UBERT, one) -> tuple[torch.Tensor, ...]:
        states = compute_states(model, one, tokenizer)
        first = states.image_intra @ states.text_intra.T  # (N, T) s1
        scorer = partial(score_cached_pairs, model, states)  # s2 (P,) of pairs (images, texts)
        return tuple(two_stage_scores(first, scorer, TOP_K[d], d) for d in ("i2t", "t2i"))

    return retrieval_evaluator(split, scores)


def train_ubert(bench: dict, tokenizer, config: UBERTConfig | None = None, *,
                towers_checkpoint=None, checkpoint_path=None,
                towers: tuple[UBERT, object] | None = None, scan=None, evaluate_on=None,
                eval_every: int | None = None, evaluate_cross: bool = True, progress: bool = True,
                device: str | None = None) -> tuple[UBERT, dict]:
    """Train U-BERT -> (model, histories "towers" and "cross", or "joint"). towers: (a trained
    U-BERT, its step-1 history) standing for step 1; evaluate_cross=False: stage 1's curve only."""
    c, train = config or UBERTConfig(), bench["train"]
    common = dict(log_every=25, progress=progress, device=device)  # every fit_pairs call's
    cross = dict(checkpoint_path=checkpoint_path, batch_size=c.cross_batch_size, lr=c.cross_lr,
                 **common)  # step 2's and joint training's
    if c.training == "joint":
        seed_everything(c.seed)
        model = build_ubert(c, train, tokenizer, scan)
        history = fit_pairs(model, cross_loss(c, with_l1=True), train, tokenizer, c,
                            evaluate=ubert_evaluator(evaluate_on, tokenizer),
                            max_steps=c.max_steps + c.cross_steps, lr_scales=c.lr_scales(), **cross)
        return model.eval(), {"joint": history}
    histories = {}
    finished = finished_checkpoint(checkpoint_path, c.cross_steps)
    seed_everything(c.seed + 1)  # BERT_cross's initial weights, whatever step 1 did
    model = build_ubert(c, train, tokenizer, scan)
    if towers is not None:  # step 1 is another U-BERT's: nothing of it to train
        towers, histories["towers"] = towers
    elif not finished or finished_checkpoint(towers_checkpoint, c.max_steps):  # else no step 1
        seed_everything(c.seed)
        towers = build_ubert(tower_config(c), train, tokenizer)
        stage1 = retrieval_evaluator(evaluate_on, lambda m, split: similarity(m, split, tokenizer))
        histories["towers"] = fit_pairs(towers, tower_loss(c), train, tokenizer, c, evaluate=stage1,
                                        eval_every=eval_every, checkpoint_path=towers_checkpoint,
                                        lr_scales=c.lr_scales(), **common)
    if towers is not None:  # its towers and embeddings; BERT_cross and its inputs stay fresh
        state = {k: v.cpu() for k, v in towers.state_dict().items()
                 if not k.startswith((*STEP_TWO_PARTS, "scan."))}
        model.load_state_dict(state, strict=False)
    model.freeze_towers()
    evaluate = ubert_evaluator(evaluate_on if evaluate_cross else None, tokenizer)
    histories["cross"] = fit_pairs(model, cross_loss(c), train, tokenizer, c, evaluate=evaluate,
                                   eval_every=eval_every, max_steps=c.cross_steps, **cross)
    return model.eval(), histories


# ----------------------------------------------------------------------------- methods
class UBERTMethod(DualEncoderMethod):
    """U-BERT's stage 1 (`ubert-embed`) and stage 2's scorer: Cascade([ubert, ubert]) retrieves."""

    checkpoint_prefix = "ubert"
    config_class = UBERTConfig

    def __init__(self, config: UBERTConfig | None = None, name: str = "ubert-embed",
                 progress: bool = True, towers_from: UBERTMethod | None = None,
                 scan: SCANMethod | None = None):
        """towers_from: a fitted two-step U-BERT with the same step 1 (only BERT_cross trains)."""
        super().__init__(config, name, progress)
        self.towers_checkpoint, self.towers_from = None, towers_from
        if self.config.cross_towers == "scan" and scan is None:
            scan = SCANMethod(SCANConfig.for_course(seed=self.config.seed), progress=progress)
        self.scan = scan if self.config.cross_towers == "scan" else None

    @property
    def notes(self) -> str:
        c, scale = self.config, self.config.text_encoder_lr_scale
        rate = "" if scale is None else f" at {scale:g}x the rate"
        towers = (f"2 towers x {c.tower_layers} layers" if c.text_encoder is None else
                  f"BERT_img {c.tower_layers} layers, BERT_txt {Path(c.text_encoder).name}" + rate)
        return (f"U-BERT stage 1: cosine of intra-modal vectors ({towers}, d={c.hidden}), "
                "FAISS IndexFlatIP")

    def towers_stage(self, bench: dict, tokenizer) -> Stage:
        """Step 1: every field but step 2's (CROSS_FIELDS), on bench["train"]."""
        return Stage("ubert-towers", reads=config_fields(self.config, without=CROSS_FIELDS),
                     data=bench["train"], vocabulary=tokenizer, version=self.format_version)

    def stage(self, bench: dict, tokenizer) -> Stage:
        """Step 2 (or joint): every field, bench["train"], step 1's towers and the SCAN model."""
        towers = self.towers_stage(bench, tokenizer) if self.config.training == "two_step" else None
        scan = self.scan and self.scan.stage(bench, tokenizer)
        return super().stage(bench, tokenizer, towers, scan)

    def build_model(self, bench: dict, tokenizer) -> UBERT:
        # the checkpoint holds its SCAN copy; two-step models are frozen, as train_ubert leaves them
        scan = self.scan.build_model(bench, tokenizer) if self.scan is not None else None
        model = build_ubert(self.config, bench["train"], tokenizer, scan)
        return model.freeze_towers() if self.config.training == "two_step" else model

    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        c, scan = self.config, None
        self.towers_checkpoint = (self.towers_stage(bench, tokenizer).path(cache_dir)
                                  if c.training == "two_step" else None)
        if self.scan is not None:  # trained SCAN for BERT_cross's inputs
            steps = c.max_steps + c.cross_steps if c.training == "joint" else c.cross_steps
            scan = self.trained_model_of(self.scan, bench, tokenizer, cache_dir,
                                         needed=not finished_checkpoint(checkpoint_path, steps))
        # stage 1's curve only: scoring stage 2 on two galleries costs a cross pass per candidate
        return train_ubert(bench, tokenizer, c, towers_checkpoint=self.towers_checkpoint,
                           checkpoint_path=checkpoint_path, scan=scan, evaluate_cross=False,
                           towers=self.shared_towers(bench, tokenizer), progress=self.progress,
                           **self.learning_curve(bench, c.max_steps))

    def shared_towers(self, bench: dict, tokenizer) -> tuple[UBERT, object] | None:
        """(model, step-1 history) of towers_from, checked to share this one's step 1."""
        other = self.towers_from
        if other is None:
            return None
        if other.model is None:
            raise RuntimeError(f"{self.name}: towers_from={other.name!r} is not fitted; call its "
                               "fit(bench, tokenizer, cache_dir) first")
        if self.config.training != "two_step" or other.config.training != "two_step":
            raise ValueError(f"{self.name}: only two-step U-BERTs share step 1 (training is "
                             f"{self.config.training!r} here, {other.config.training!r} in "
                             f"{other.name!r})")
        mine = self.towers_stage(bench, tokenizer)
        theirs = other.towers_stage(bench, other.tokenizer)
        if mine.file_name != theirs.file_name:
            differ = [f"{f} ({mine.reads[f]!r} vs {theirs.reads[f]!r})" for f in mine.reads
                      if mine.reads[f] != theirs.reads[f]]
            raise ValueError(f"{self.name}: towers_from={other.name!r} trained other towers: "
                             + (", ".join(differ) if differ else "other data or vocabulary")
                             + ". Give both the same step-1 fields, or leave towers_from out to "
                             "train step 1")
        return other.model, (other.history or {}).get("towers")

    def states(self, split) -> UBERTStates:
        """The split's stage-2 states, once per split and model."""
        return self.cached_states(split, compute_states)

    def rank(self, split, direction: str, top_k: int, queries=None) -> TopK:
        """Stage 1: exact top_k by s1 via a FAISS index of the cached intra vectors."""
        queries = torch.as_tensor(query_indices(split, direction, queries), dtype=torch.long)
        states = self.states(split)
        gallery, asked = ((states.image_intra, states.text_intra) if direction == "t2i"
                          else (states.text_intra, states.image_intra))
        scores, indices = search(build_index(gallery), asked[queries], min(top_k, len(gallery)))
        return torch.as_tensor(indices, dtype=torch.long), torch.as_tensor(scores)

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        """s2 (P,) of the pairs (image_indices[p], text_indices[p]): only BERT_cross runs."""
        return score_cached_pairs(self._fitted(), self.states(split), image_indices, text_indices)


class UBERTCascade(Cascade):
    """U-BERT's retrieval (§4.2): s1 keeps the top K per query, s2 alone re-orders them."""

    def __init__(self, ubert: UBERTMethod, top_k: int = TOP_K["t2i"],
                 top_k_i2t: int = TOP_K["i2t"], name: str | None = None):
        c = ubert.config
        reading = " with SCAN's reading of each token" if c.cross_towers == "scan" else ""
        super().__init__([ubert, ubert], [top_k], top_ms_i2t=[top_k_i2t],
                         name=name or f"ubert@{top_k}",
                         notes=(f"U-BERT: s1 keeps the top {top_k} images per caption ({top_k_i2t} "
                                f"captions per image), s2 re-orders them (BERT_cross, "
                                f"{c.cross_layers} layer(s), on cached states{reading})"))
        self.ubert = ubert

    def _online(self, split, direction: str, query_batch, top_k: int):
        """One query: its tower pass, a FAISS search of intra vectors, BERT_cross on the top K."""
        model, K = self.ubert._fitted().eval(), self.survivors(direction)[0]  # eval once
        device, states = model_device(model), self.ubert.states(split)  # offline: the gallery's
        t2i = direction == "t2i"
        searcher = Searcher(build_index(states.image_intra if t2i else states.text_intra), K)
        encode = model.text_states if t2i else model.image_states
        gallery_states = states.image if t2i else states.text

        @torch.inference_mode()
        def answer() -> np.ndarray:
            query = encode({k: v.to(device) for k, v in query_batch().items()})  # text/image_states
            candidates = torch.from_numpy(searcher(query[2].float().cpu().numpy())[1])  # (K,)
            gallery = [s.to(device) for s in gallery_states(candidates)]
            s2 = rescore_candidates(model, query, gallery, direction).cpu()  # (K,)
            return candidates[torch.argsort(s2, descending=True, stable=True)][:top_k].numpy()

        return answer

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        tokenizer = QueryTokenizer(self.ubert.tokenizer, self.ubert.config.max_text_length)  # once
        caption = split.captions[caption_index]

        def caption_batch() -> dict:
            ids, mask = tokenizer(caption)  # (1, T) each
            return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}

        return self._online(split, "t2i", caption_batch, top_k)

    def image_query_fn(self, split, image_index: int = 0, top_k: int = 10):
        """The same for an image query -> (top_k,) caption indices."""
        image = {k: v for k, v in ImageDataset(split)[image_index].items() if torch.is_tensor(v)}
        return self._online(split, "i2t", lambda: {k: v[None] for k, v in image.items()}, top_k)


register_method("ubert-embed", order=4.0)(
    lambda build: UBERTMethod(build.config(UBERTConfig), scan=build.method("scan")))
register_method(f"ubert@{TOP_K['t2i']}", order=4.1)(
    lambda build: UBERTCascade(build.method("ubert-embed")))
register_method(f"ubert-embed+cross_encoder@{TOP_K['t2i']}", order=4.2)(
    lambda build: TwoStageMethod(build.method("ubert-embed"), build.method("cross_encoder"),
                                 TOP_K["t2i"], name=f"ubert-embed+cross_encoder@{TOP_K['t2i']}",
                                 top_m_i2t=TOP_K["i2t"]))
