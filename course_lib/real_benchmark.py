"""The benchmark on real photographs: `python -m course_lib.benchmark --features DIR --out OUT`.

DIR is a feature folder of data_scripts/extract_features.py (EfficientNet-Lite0's 7x7 grid of a
Karpathy-format dataset: flickr8k_800 offline, Flickr30k / COCO on Colab). Every method here is light
heads on frozen features (course_lib.methods.frozen_heads), trained on train, chosen on val, reported
on test and on the full setting (test queries against every split's images); nothing ships for real
data, and the synthetic shipped models are never touched. There is no oracle row, because real data
has no generator: chance and a linear probe frame the learned rows instead.

`real_methods(...)` builds the methods in the order they train; `run_features(...)` fits, evaluates
and times them (with the synthetic benchmark's own `evaluate` and latency code) and writes the same
results.json, results.md and pareto.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.offline_weights import MINILM_NAME
from course_lib.data.features import load_feature_bench
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


def reference_rows(split, setting: str) -> list[dict]:
    """The untrained row of a setting: chance."""
    from course_lib.benchmark import _row

    return [_row("chance", setting, split, chance_metrics(split, KS[setting]), KS[setting], None,
                 "expected recall of a random ranking; not trained")]


def evaluate_all(methods, bench: dict, smoke: bool = False, seed: int = 0, progress: bool = True) -> list[dict]:
    """The results rows: chance, then every method on every setting, its recalls (course_lib.benchmark's
    evaluate: a fixed sample of queries where a method's pair budget runs out) and ms per text query."""
    from tqdm.auto import tqdm

    from course_lib.benchmark import _latency, _row, evaluate  # the synthetic benchmark's own evaluation

    repeats = 5 if smoke else 20
    rows = [row for setting in SETTINGS for row in reference_rows(bench[setting], setting)]
    for method in tqdm(methods, desc="evaluating", disable=not progress):
        for setting in SETTINGS:
            split = bench[setting]
            metrics, how = evaluate(method, split, KS[setting], smoke, seed)
            query = _latency(method, split, (split.n_images,), smoke, repeats)[-1]
            rows.append(_row(method.name, setting, split, metrics, KS[setting], query["ms_per_query"],
                             f"{how}; ms: one text query (its text encoder included), median of {repeats}",
                             ms_measured=query["measured"], ms_spread=(query["p25_ms"], query["p75_ms"])))
    return rows


def run_features(features_dir, out="outputs/benchmark-real", text_encoder: str = MINILM_NAME, smoke: bool = False,
                 seed: int = 0, checkpoints=CHECKPOINTS, progress: bool = True) -> dict:
    """Fit, evaluate and time every real-data method on a feature folder; write OUT's three files."""
    from course_lib.results import write_outputs

    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench = load_feature_bench(features_dir)
    missing = [s for s in ("train", "val", "test") if s not in bench]
    if missing:
        raise ValueError(f"{features_dir} has no {', '.join(missing)} split: extract every split (train, val and "
                         "test: drop --splits) to train, choose and report")
    if smoke:  # a few dozen photos: the same code path
        bench = {name: bench[name].subset(range(min(n, bench[name].n_images)), name=name)
                 for name, n in (("train", 48), ("val", 16), ("test", 16))}
        from course_lib.data.split import concatenate

        bench["full"] = concatenate([bench["train"], bench["val"], bench["test"]], "full", queries_from=bench["test"])
    methods, fitted = fit_all(bench, text_encoder, smoke, seed, checkpoints, progress)
    rows = evaluate_all(methods, bench, smoke, seed, progress)
    env = settings.describe_environment()
    features = bench["test"].info.get("features", {})
    results = {
        "meta": {"device": env["device"], "torch": env["torch"], "mode": "smoke" if smoke else "default",
                 "seconds": round(time.perf_counter() - start, 1), "seed": seed, "data": "real",
                 "features": str(features_dir), "backbone": features, "text_encoder": text_encoder,
                 "sizes": {name: [s.n_images, s.n_texts] for name, s in bench.items()}, **fitted,
                 "betas": {str(k): v for k, v in fitted["betas"].items()}, "shipped_models": []},
        "methods": {"oracle": NO_ORACLE, "chance": "a random ranking's expected recall"}
                   | {m.name: m.notes for m in methods},
        "rows": rows,
        "latency": [],
        "curves": {m.name: {"step": m.curve.step, "loss": m.curve.loss, "val_r1": m.curve.val_r1,
                            "train_r1": m.curve.train_r1} for m in methods if getattr(m, "curve", None)},
    }
    write_outputs(results, out)
    return results


__all__ = ["run_features", "evaluate_all", "chance_metrics", "fit_all", "real_methods", "choose_beta", "reference_rows", "SETTINGS", "KS",
           "SURVIVORS", "BETAS", "DUALS", "NO_ORACLE"]
