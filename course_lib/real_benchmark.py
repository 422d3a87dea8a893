"""The methods of the benchmark on real photographs (`python -m course_lib.benchmark --features DIR --out OUT`).

DIR is a feature folder of data_scripts/extract_features.py (EfficientNet-Lite0's 7x7 grid of a
Karpathy-format dataset: flickr8k_800 offline, Flickr30k / COCO on Colab). Two groups of methods,
trained on train, reported on test and on the full setting (test queries against every split's images):

- light heads on frozen features (course_lib.methods.frozen_heads), each kept at its best val point:
  the linear probe, VSE++'s and LightningDOT's losses, a text side from scratch, a re-ranker;
- the course's own methods that read regions (COURSE_METHODS, from the registry: lessons 01-05's
  VSE++, SCAN, the cross-encoder, LightningDOT and its re-ranker, U-BERT, HiVLP over regions), the grid
  cells as their regions, tokenised with the pretrained text encoder's WordPiece vocabulary, at sizes
  for 600 training photos (course_sizes). LightningDOT's language encoder and U-BERT's BERT_txt start from
  that encoder, as the papers' from BERT-base; the others learn their word embeddings from nothing, as on
  the synthetic data.

Nothing ships for real data, and the synthetic shipped models are never looked at. There is no oracle
row, because real data has no generator: chance and a linear probe frame the learned rows instead.

`real_methods(...)` builds the heads in the order they train, `fit_all(...)` fits both groups;
course_lib.benchmark's `run_features` evaluates and times them with the synthetic benchmark's own
`evaluate` and latency code (`evaluate_real`) and writes the same results.json, results.md and pareto.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path
from course_lib.core.shipped import without_shipped_models
from course_lib.data.tokenizer import tokenizer_for
from course_lib.methods.registry import available_methods
from course_lib.methods.frozen_heads.cross import CrossConfig, CrossHeadsMethod
from course_lib.methods.frozen_heads.dual import DualHeadsMethod, HeadsConfig
from course_lib.methods.frozen_heads.features import TextStates
from course_lib.methods.frozen_heads.rerank import RerankMethod
from course_lib.methods.frozen_heads.scan import SCANHeadsConfig, SCANHeadsMethod
from course_lib.methods.frozen_heads.training import recalls
from course_lib.notebook import chance_recall

SETTINGS = ("test", "full")
KS = {"test": (1, 5, 10), "full": (5, 10, 20)}
SURVIVORS = 10  # the dual encoder's top M that a re-ranker re-scores
BETAS = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)  # weights of the dual logit beside the re-ranker's logit, chosen on val
NO_ORACLE = ("no oracle row: real data has no generator whose likelihood would give the best possible "
             "ranking; chance (a random ranking's expected recall) and the linear probe frame the learned rows")

# sizes from the learning curves of lesson 08 (val t2i R@1 against train[:100], docs/tuning_notes.md)
# (every run keeps the weights of its best val point: each fits its 600 training photos within ~50 steps)
DUALS = {
    "linear-probe": dict(image_head="mean", text_head="mean", steps=200),
    "vsepp-heads": dict(image_head="mlp", text_head="mlp", loss="hinge", steps=200),
    "lightningdot-heads": dict(image_head="mlp", text_head="mlp", steps=200, weight_decay=0.1, dropout=0.3),
    "lightningdot-heads-scratch-text": dict(image_head="mlp", text_head="mlp", text_tower="scratch", steps=300,
                                      weight_decay=0.1, dropout=0.3),
}


# the registry's methods that read region features (the pixel-reading HiVLP and Fast & Slow need photos
# at training time, not a feature folder); the cascades bring the methods they start from
COURSE_METHODS = ("vsepp", "scan", "cross_encoder", "lightningdot", "lightningdot+rerank@20", "ubert-embed",
                  "ubert@20", "hivlp-regions")


# smoke mode's steps where a switch makes a model costlier than its config's SMOKE allows for: U-BERT at
# MiniLM's width 384 costs ~25 times the synthetic smoke step (both stages; B^2 cross passes in step 2)
SMOKE_STEPS = {"UBERTConfig": dict(max_steps=10, cross_steps=10, cross_batch_size=8)}


def course_sizes(text_encoder: str = MINILM_NAME, smoke: bool = False) -> dict:
    """registry.Build.sizes for COURSE_METHODS on real features. The synthetic defaults train thousands of
    steps on 10k scenes; 600 photos (3,000 captions: about 24 batches of 128 an epoch) get about six epochs
    of each training stage, more where the learning curve (the benchmark's curves.png) was still rising there.
    The switches (LightningDOT's and U-BERT's pretrained text side and its width, no fresh synthetic scenes
    for HiVLP, no in-domain pre-training on the same 600 photos) hold in smoke mode too:
    smoke shrinks only the steps (the configs' SMOKE, and SMOKE_STEPS)."""
    from transformers import AutoConfig

    width = AutoConfig.from_pretrained(pretrained_text_path(text_encoder)).hidden_size
    switches = {
        # the paper's text side: a pretrained BERT, [CLS] as z0; its width is h0's and z0's. BERT's own
        # pre-training stands in for VMLM: 600 photos are the fine-tuning data, not a pre-training corpus
        "LightningDOTConfig": dict(text_encoder=text_encoder, hidden=width, heads=max(1, width // 64), layers=1,
                                   pretrain_steps=0),
        # U-BERT's BERT_txt from the same BERT (the paper's towers start from BERT-base), BERT_img one block
        "UBERTConfig": dict(text_encoder=text_encoder, hidden=width, heads=max(1, width // 64), tower_layers=1),
        "HiVLPConfig": dict(fresh_scenes=0),  # no generator behind real photos
    }
    if smoke:
        return {name: {**fields, **SMOKE_STEPS.get(name, {})} for name, fields in switches.items()}
    steps = {
        "VsePPConfig": dict(max_steps=150, batch_size=128),  # 400 steps: val flat at 7-9 from step 50
        "SCANConfig": dict(max_steps=150),
        "CrossEncoderConfig": dict(max_steps=300),
        # one rate for MiniLM and the region tower trained from nothing: BERT's 5e-5 (the paper's) left the
        # tower barely trained (val t2i R@1 6.6), 1e-4 gave 11.8, 3e-4 14.8 at 150 steps, still rising there;
        # 300 steps: 20.2, flat from ~220 (docs/tuning_notes.md)
        "LightningDOTConfig": dict(finetune_steps=300, finetune_lr=3e-4, batch_size=64),
        # BERT_txt from MiniLM at the course's step-1 rate: val t2i R@1 flat at 19-20 from step ~70 of 150 (3e-4:
        # 16.2); step 2 at width 384 costs ~3 s a step on one thread, so 150 of them (docs/tuning_notes.md)
        "UBERTConfig": dict(max_steps=150, cross_steps=150, batch_size=128),
        "HiVLPConfig": dict(max_steps=150, batch_size=128),
    }
    return {name: {**switches.get(name, {}), **steps.get(name, {})} for name in switches | steps}


def course_methods(text_encoder: str = MINILM_NAME, smoke: bool = False, seed: int = 0) -> list:
    """COURSE_METHODS built for real features (course_sizes), in course order."""
    return available_methods(seed, smoke, COURSE_METHODS, sizes=course_sizes(text_encoder, smoke))


def real_methods(smoke: bool = False, seed: int = 0, progress: bool = True) -> tuple[list, list]:
    """(every head method in training order, the re-rankers: the dual encoder's top SURVIVORS re-scored by
    the cross-encoder and by SCAN, each then fused with the dual's logit at a beta chosen on val)."""
    pick = (lambda cls, **kw: cls.smoke(seed=seed, **kw)) if smoke else (lambda cls, **kw: cls(seed=seed, **kw))
    duals = {name: DualHeadsMethod(name, pick(HeadsConfig, **kw), progress) for name, kw in DUALS.items()}
    first = duals["lightningdot-heads"]
    scorers = [CrossHeadsMethod("cross-heads", pick(CrossConfig), first, progress),
               SCANHeadsMethod("scan-heads", pick(SCANHeadsConfig), progress)]
    rerankers = [RerankMethod(f"{first.name}+{'rerank' if s.name == 'cross-heads' else s.name}@{SURVIVORS}", first,
                              s, SURVIVORS) for s in scorers]
    return [*duals.values(), *scorers], rerankers


def choose_beta(rerank: RerankMethod, val) -> tuple[float, dict]:
    """The dual logit's weight beside the re-ranker's logit with the best val t2i R@1 (ties: the smaller beta)."""
    scores = {}
    for beta in BETAS:
        rerank.beta = beta
        scores[beta] = recalls(rerank, val)["t2i_r1"]
    rerank.beta = max(BETAS, key=lambda b: (scores[b], -b))
    return rerank.beta, scores


def fit_all(bench: dict, text_encoder: str = MINILM_NAME, smoke: bool = False, seed: int = 0,
            checkpoints=CHECKPOINTS, progress: bool = True, course: bool = True) -> tuple[list, dict]:
    """Fit every method on bench["train"] (or load it from `checkpoints`), the fused re-ranker's beta
    chosen on val; course=False: the heads only (lesson 08). Returns (methods, {"train_seconds": {name: s},
    "betas": {fused re-ranker: {beta: val t2i R@1}}, "beta": {fused re-ranker: the beta chosen}})."""
    settings.seed_everything(seed)
    text = TextStates(text_encoder)
    scratch = TextStates(scratch=True, train_captions=bench["train"].captions)
    methods, rerankers = real_methods(smoke, seed, progress)
    seconds = {}
    for method in methods:
        start = time.perf_counter()
        uses = scratch if getattr(method.config, "text_tower", "pretrained") == "scratch" else text
        method.fit(bench, uses, cache_dir=checkpoints)
        seconds[method.name] = round(method.curve.seconds if method.curve else time.perf_counter() - start, 1)
    on_val, chosen = {}, {}
    for rerank in rerankers:
        fused = RerankMethod(f"{rerank.name}+fused", rerank.dual, rerank.cross, SURVIVORS)
        chosen[fused.name], on_val[fused.name] = choose_beta(fused, bench["val"])
        methods += [rerank.fit(bench, text), fused.fit(bench, text)]
    if course:
        wordpieces = tokenizer_for(bench["train"], name=pretrained_text_path(text_encoder))
        with without_shipped_models():
            for method in course_methods(text_encoder, smoke, seed):
                start = time.perf_counter()
                method.fit(bench, wordpieces, cache_dir=checkpoints)
                seconds[method.name] = round(time.perf_counter() - start, 1)
                methods.append(method)
    return methods, {"train_seconds": seconds, "betas": on_val, "beta": chosen}


def training_curves(methods) -> dict:
    """{name: {"step", "val_r1", "train_r1"}}: t2i R@1 on val and train[:n] along training, of every model
    that trained (a head's Curve; a course method's evaluation rows, one entry per training stage, e.g.
    "lightningdot (finetune)"). The re-rankers and cascades train nothing of their own and have none."""
    curves = {}
    for method in methods:
        curve = getattr(method, "curve", None)
        if curve is not None and curve.step:
            curves[method.name] = {"step": curve.step, "val_r1": curve.val_r1, "train_r1": curve.train_r1}
            continue
        history = getattr(method, "history", None)
        stages = history.items() if isinstance(history, dict) else [(None, history)]
        for stage, one in stages:
            rows = [r for r in one.rows(eval=True) if "val_t2i_r1" in r] if one is not None else []
            if rows:
                curves[method.name if stage is None else f"{method.name} ({stage})"] = {
                    "step": [r["step"] for r in rows], "val_r1": [r["val_t2i_r1"] for r in rows],
                    "train_r1": [r.get("train_t2i_r1") for r in rows]}
    return curves


def chance_metrics(split, ks=(1, 5, 10)) -> dict:
    """A random ranking's expected recalls: t2i one true image among the gallery's; i2t an image's captions
    (5 here) among every caption."""
    per_image = np.bincount(split.txt2img, minlength=split.n_images)[np.asarray(split.image_queries)]
    out = {f"t2i_r{k}": chance_recall(split.n_images, k) for k in ks}
    return out | {f"i2t_r{k}": float(np.mean([chance_recall(split.n_texts, k, int(c)) for c in per_image])) for k in ks}


__all__ = ["chance_metrics", "training_curves", "fit_all", "real_methods", "course_methods", "course_sizes",
           "COURSE_METHODS", "choose_beta", "SMOKE_STEPS", "SETTINGS", "KS", "SURVIVORS", "BETAS", "DUALS", "NO_ORACLE"]
