"""The methods of the benchmark on real photographs (`python -m course_lib.benchmark --features DIR --out OUT`).

DIR is a feature folder of data_scripts/extract_features.py (EfficientNet-Lite0's 7x7 grid of a
Karpathy-format dataset: flickr8k_800 offline, Flickr30k / COCO on Colab). Every method here is light
heads on frozen features (course_lib.methods.frozen_heads), trained on train, chosen on val, reported
on test and on the full setting (test queries against every split's images); nothing ships for real
data, and the synthetic shipped models are never touched. There is no oracle row, because real data
has no generator: chance and a linear probe frame the learned rows instead.

`real_methods(...)` builds the methods in the order they train, `fit_all(...)` fits them;
course_lib.benchmark's `run_features` evaluates and times them with the synthetic benchmark's own
`evaluate` and latency code (`evaluate_real`) and writes the same results.json, results.md and pareto.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.offline_weights import MINILM_NAME
from course_lib.methods.frozen_heads import (CrossConfig, CrossHeadsMethod, DualHeadsMethod, HeadsConfig,
                                             RerankMethod, TextStates, recalls)
from course_lib.notebook import chance_recall

SETTINGS = ("test", "full")
KS = {"test": (1, 5, 10), "full": (5, 10, 20)}
SURVIVORS = 10  # the dual encoder's top M that the cross-encoder re-scores
BETAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)  # weights of the dual logit beside the cross logit, chosen on val
NO_ORACLE = ("no oracle row: real data has no generator whose likelihood would give the best possible "
             "ranking; chance (a random ranking's expected recall) and the linear probe frame the learned rows")

# sizes from the learning curves of lesson 08 (val t2i R@1 against train[:100], docs/tuning_notes.md)
# (every run keeps the weights of its best val point: each fits its 600 training photos within ~50 steps)
DUALS = {
    "linear-probe": dict(image_head="mean", text_head="mean", steps=200),
    "vsepp": dict(image_head="mlp", text_head="mlp", loss="hinge", steps=200),
    "lightningdot": dict(image_head="mlp", text_head="mlp", steps=200, weight_decay=0.1, dropout=0.3),
    "lightningdot-scratch-text": dict(image_head="mlp", text_head="mlp", text_tower="scratch", steps=300,
                                      weight_decay=0.1, dropout=0.3),
}


def real_methods(smoke: bool = False, seed: int = 0, progress: bool = True) -> tuple[list, DualHeadsMethod]:
    """(every method in training order, the dual encoder that the re-rankers start from)."""
    pick = (lambda cls, **kw: cls.smoke(seed=seed, **kw)) if smoke else (lambda cls, **kw: cls(seed=seed, **kw))
    duals = {name: DualHeadsMethod(name, pick(HeadsConfig, **kw), progress) for name, kw in DUALS.items()}
    first = duals["lightningdot"]
    cross = CrossHeadsMethod("cross_encoder", pick(CrossConfig), first, progress)
    rerank = RerankMethod(f"lightningdot+rerank@{SURVIVORS}", first, cross, SURVIVORS)
    return [*duals.values(), cross, rerank], first


def choose_beta(rerank: RerankMethod, val) -> tuple[float, dict]:
    """The dual logit's weight beside the cross logit with the best val t2i R@1 (ties: the smaller beta)."""
    scores = {}
    for beta in BETAS:
        rerank.beta = beta
        scores[beta] = recalls(rerank, val)["t2i_r1"]
    rerank.beta = max(BETAS, key=lambda b: (scores[b], -b))
    return rerank.beta, scores


def fit_all(bench: dict, text_encoder: str = MINILM_NAME, smoke: bool = False, seed: int = 0,
            checkpoints=CHECKPOINTS, progress: bool = True) -> tuple[list, dict]:
    """Fit every method on bench["train"] (or load it from `checkpoints`), the fused re-ranker's beta
    chosen on val. Returns (methods, {"train_seconds": {name: s}, "betas": {beta: val R@1}})."""
    settings.seed_everything(seed)
    text = TextStates(text_encoder)
    scratch = TextStates(scratch=True, train_captions=bench["train"].captions)
    methods, first = real_methods(smoke, seed, progress)
    seconds = {}
    for method in methods:
        start = time.perf_counter()
        uses = scratch if getattr(method.config, "text_tower", "pretrained") == "scratch" else text
        method.fit(bench, uses, cache_dir=checkpoints)
        seconds[method.name] = round(method.curve.seconds if method.curve else time.perf_counter() - start, 1)
    rerank = methods[-1]
    fused = RerankMethod(f"{rerank.name}+fused", rerank.dual, rerank.cross, SURVIVORS)
    beta, on_val = choose_beta(fused, bench["val"])
    methods.append(fused.fit(bench, text))
    return methods, {"train_seconds": seconds, "betas": on_val, "beta": beta}


def chance_metrics(split, ks=(1, 5, 10)) -> dict:
    """A random ranking's expected recalls: t2i one true image among the gallery's; i2t an image's captions
    (5 here) among every caption."""
    per_image = np.bincount(split.txt2img, minlength=split.n_images)[np.asarray(split.image_queries)]
    out = {f"t2i_r{k}": chance_recall(split.n_images, k) for k in ks}
    return out | {f"i2t_r{k}": float(np.mean([chance_recall(split.n_texts, k, int(c)) for c in per_image])) for k in ks}


__all__ = ["chance_metrics", "fit_all", "real_methods", "choose_beta", "SETTINGS", "KS",
           "SURVIVORS", "BETAS", "DUALS", "NO_ORACLE"]
