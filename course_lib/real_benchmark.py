"""The benchmark on real photographs: `python -m course_lib.real_benchmark --features DIR`.

DIR is a feature folder of data_scripts/extract_features.py (a pretrained CNN's grid cells, used as
regions). Lessons 01-06's methods (REAL_METHODS) are trained with captions in the pretrained text
encoder's WordPiece, beside the linear probe and chance (real data has no oracle); nothing ships
for real data. Writes OUT's results.json, results.md, pareto.png and curves.png."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS, finished_checkpoint
from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path
from course_lib.core.shipped import without_shipped_models
from course_lib.core.split_cache import release_split_caches
from course_lib.data.features import extracted_images, load_feature_bench
from course_lib.data.split import concatenate
from course_lib.data.tokenizer import tokenizer_for
from course_lib.evaluation import evaluate, query_latency, results_row
from course_lib.methods.lightningdot.method import LightningDOTMethod
from course_lib.methods.linear_probe import LinearProbeConfig, LinearProbeMethod
from course_lib.methods.registry import available_methods
from course_lib.methods.rerank import Cascade, weighted_sum
from course_lib.notebook import chance_recall
from course_lib.published import published_rows
from course_lib.results import results_dict, results_markdown, update_readme, write_outputs

SETTINGS = ("test", "full")
KS = {"test": (1, 5, 10), "full": (5, 10, 20)}
NO_ORACLE = ("no oracle row: real data has no generator whose likelihood would give the best "
             "possible ranking; chance (a random ranking's expected recall) and the linear probe "
             "frame the learned rows")
REFERENCE_NOTES = {"oracle": NO_ORACLE, "chance": "a random ranking's expected recall"}
# pairs a pairwise scorer may score per setting and direction (docs/tuning_notes.md)
REAL_PAIR_CAP = 100_000
SMOKE_PHOTOS = {"train": 48, "val": 16, "test": 16}  # photos of each split in smoke mode

# the registry's methods on real features, in course order (cascades bring their first stages)
REAL_METHODS = ("vsepp", "scan", "cross_encoder", "lightningdot", "lightningdot+rerank@20",
                "ubert-embed", "ubert@20", "ubert-embed+cross_encoder@20", "hivlp-regions", "slow",
                "fast", "fast-distilled", "fast_slow@10", "fast_slow@50")

# real photos only: LightningDOT's top FUSED_TOP_M re-scored by SCAN, ordered by
# FUSED_WEIGHT * LightningDOT + SCAN (Fast & Slow eq. 9); both numbers chosen on val
FUSED = "lightningdot+scan@10"
FUSED_TOP_M = 10
FUSED_WEIGHT = 0.01

# an ablation arm, trained only with --ablations (it doubles LightningDOT's fit): LightningDOT's
# own pre-training (§3.1) on the training pairs before the preset's fine-tuning, at its rate,
# without SMRC-KL (grid cells have no detector's soft labels); lesson 08's pre-training verdict
PRETRAINED = "lightningdot-pretrained"
PRETRAINING = dict(pretrain_steps=150, pretrain_lr=3e-4,
                   pretrain_tasks={"cmr": 2, "vmlm": 2, "smrfr": 1})

# methods whose captions are words seen WORD_MIN_FREQ times in train, not wordpieces: Slow's output
# softmax costs with the vocabulary, and lesson 06's methods share one tokenizer
WORD_METHODS = ("slow", "fast", "fast-distilled", "fast_slow@10", "fast_slow@50")
WORD_MIN_FREQ = 5

# smoke mode's steps and batches where real photos make a model costlier than its config's SMOKE
# allows for: MiniLM fine-tuned, 49 cells of 1,280 numbers a photo, SCAN's B x B attention
SMOKE_SIZES = {"UBERTConfig": dict(max_steps=6, cross_steps=6, batch_size=16, cross_batch_size=8),
               "LightningDOTConfig": dict(finetune_steps=6, batch_size=16),
               "CrossEncoderConfig": dict(max_steps=20), "SCANConfig": dict(batch_size=32),
               "VsePPConfig": dict(batch_size=16), "HiVLPConfig": dict(batch_size=16)}


def real_sizes(text_encoder: str = MINILM_NAME, smoke: bool = False) -> dict:
    """registry.Build.sizes for REAL_METHODS: the switches real data needs (a pretrained text side,
    grid cells for pixels, no fresh scenes); smoke also shrinks steps and batches (SMOKE_SIZES)."""
    from transformers import AutoConfig

    width = AutoConfig.from_pretrained(pretrained_text_path(text_encoder)).hidden_size
    grid = dict(image_input="regions", image_init="scratch")  # a pretrained CNN's cells: no stem
    bert = dict(text_encoder=text_encoder, hidden=width, heads=max(1, width // 64),
                text_encoder_lr_scale=0.1)  # fine-tuned at a tenth of the rate of the new layers
    switches = {
        # a pretrained BERT, whose own pre-training stands in for VMLM
        "LightningDOTConfig": dict(bert, layers=1, pretrain_steps=0),
        # BERT_txt from the same BERT (the paper's towers start from BERT-base); BERT_img one block
        "UBERTConfig": dict(bert, tower_layers=1),
        # SCAN's text side: the same BERT's token states, frozen, in place of the bi-GRU
        "SCANConfig": dict(text_encoder=text_encoder),
        "HiVLPConfig": dict(fresh_scenes=0),  # no generator behind real photos
        "SlowConfig": grid,
        "FastConfig": dict(grid, image_pool="mean", fresh_scenes=0),
    }
    if not smoke:
        return switches
    return {name: {**switches.get(name, {}), **SMOKE_SIZES.get(name, {})}
            for name in dict.fromkeys([*switches, *SMOKE_SIZES])}


def real_methods(text_encoder: str = MINILM_NAME, smoke: bool = False, seed: int = 0,
                 names=REAL_METHODS, ablations: bool = False) -> list:
    """The linear probe, then `names` built with real_sizes (HiVLP's flat model before it), FUSED
    after lesson 03's rows where lightningdot and scan both are, and with `ablations` PRETRAINED
    after lightningdot."""
    probe_config = LinearProbeConfig.smoke if smoke else LinearProbeConfig
    methods = [LinearProbeMethod(probe_config(text_encoder=text_encoder, seed=seed))]
    sizes = real_sizes(text_encoder, smoke)
    for method in available_methods(seed, smoke, names, sizes=sizes, real_photos=True):
        flat = getattr(method, "hivlp", None)  # HiVLP's cascade: its flat model first
        methods += [flat, method] if flat is not None else [method]
    built = [m.name for m in methods]
    if {"lightningdot", "scan"} <= set(built):
        stages = [methods[built.index("lightningdot")], methods[built.index("scan")]]
        notes = (f"lightningdot keeps the top {FUSED_TOP_M}, scan re-scores them; ordered by "
                 f"{FUSED_WEIGHT:g} x lightningdot + scan (fused, Fast & Slow eq. 9)")
        fused = Cascade(stages, [FUSED_TOP_M], combine=weighted_sum([FUSED_WEIGHT, 1.0]),
                        name=FUSED, notes=notes)
        lesson_03 = ("lightningdot", "lightningdot+rerank@20")
        after = max(built.index(n) for n in lesson_03 if n in built)
        methods.insert(after + 1, fused)
    if ablations:
        if "lightningdot" not in built:
            raise ValueError(f"the ablation {PRETRAINED!r} is LightningDOT's: add 'lightningdot' "
                             "to names")
        plain = methods[built.index("lightningdot")]
        steps = {"pretrain_steps": plain.config.finetune_steps} if smoke else {}
        arm = LightningDOTMethod(replace(plain.config, **(PRETRAINING | steps)), name=PRETRAINED)
        methods.insert(methods.index(plain) + 1, arm)
    return methods


def fit_real_methods(bench: dict, text_encoder: str = MINILM_NAME, smoke: bool = False,
                     seed: int = 0, checkpoints=CHECKPOINTS, names=REAL_METHODS,
                     ablations: bool = False) -> tuple[list, dict]:
    """Fit (or load) every method on bench["train"]: (methods, {name: seconds to fit})."""
    settings.seed_everything(seed)
    wordpieces = tokenizer_for(bench["train"], name=pretrained_text_path(text_encoder))
    words = tokenizer_for(bench["train"], min_freq=WORD_MIN_FREQ)
    methods, seconds = real_methods(text_encoder, smoke, seed, names, ablations), {}
    with without_shipped_models():  # nothing ships for real data
        for method in methods:
            start = time.perf_counter()
            tokenizer = words if method.name in WORD_METHODS else wordpieces
            method.fit(bench, tokenizer, cache_dir=checkpoints)
            seconds[method.name] = round(time.perf_counter() - start, 1)
    return methods, seconds


def ablations_trained(bench: dict, text_encoder: str = MINILM_NAME, smoke: bool = False,
                      seed: int = 0, checkpoints=CHECKPOINTS) -> bool:
    """Whether checkpoints holds this run's ablation arm, finished (the benchmark's --ablations
    trains it): lesson 08 adds it to its rows then, rather than spend its own budget on it."""
    arm = real_methods(text_encoder, smoke, seed, ("lightningdot",), ablations=True)[-1]
    wordpieces = tokenizer_for(bench["train"], name=pretrained_text_path(text_encoder))
    path = arm.stage(bench, wordpieces).path(checkpoints)
    return finished_checkpoint(path, arm.config.finetune_steps)


def training_curves(methods) -> dict:
    """{name: {"step", "val_r1", "train_r1"}}: t2i R@1 along training, per model and stage."""
    curves = {}
    for method in methods:
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
    """A random ranking's expected recalls: t2i one true image; i2t an image's 5 of all captions."""
    captions = np.bincount(split.txt2img, minlength=split.n_images)  # (n_images,)
    per_image = captions[np.asarray(split.image_queries)]
    out = {f"t2i_r{k}": chance_recall(split.n_images, k) for k in ks}
    return out | {f"i2t_r{k}": float(np.mean([chance_recall(split.n_texts, k, int(c))
                                               for c in per_image])) for k in ks}


def evaluate_real(methods, bench: dict, smoke: bool = False, seed: int = 0, progress: bool = True,
                  setting_names=SETTINGS) -> list[dict]:
    """The results rows: chance, then every method's recalls and ms per query on every setting."""
    repeats = 5 if smoke else 20
    rows = [results_row("chance", name, bench[name], chance_metrics(bench[name], KS[name]),
                        KS[name], None, "expected recall of a random ranking; not trained")
            for name in setting_names]
    for done, method in enumerate(tqdm(methods, desc="evaluating", disable=not progress)):
        release_finished(methods, done)
        for setting in setting_names:
            split, ks, start = bench[setting], KS[setting], time.perf_counter()
            metrics, how = evaluate(method, split, ks, smoke, seed, pair_cap=REAL_PAIR_CAP)
            query = query_latency(method, split, (split.n_images,), smoke, repeats)[-1]
            notes = f"{how}; ms: one text query (its text encoder included), median of {repeats}"
            rows.append(results_row(method.name, setting, split, metrics, ks, query["ms_per_query"],
                                    notes, ms_measured=query["measured"],
                                    ms_spread=(query["p25_ms"], query["p75_ms"])))
            rows[-1]["eval_s"] = round(time.perf_counter() - start, 1)  # recalls and timing
    return rows


def release_finished(methods, evaluated: int) -> None:
    """Empty the split caches of methods[:evaluated] (and their stages) no later method reads:
    every model's full-setting states at once would not fit in memory."""
    later = methods[evaluated:]
    needed = {id(m) for m in later} | {id(s) for m in later for s in getattr(m, "stages", ())}
    for method in methods[:evaluated]:
        for owner in (method, *getattr(method, "stages", ())):
            if id(owner) not in needed:
                release_split_caches(owner)


def smoke_bench(bench: dict) -> dict:
    """The first few photos of each split (SMOKE_PHOTOS), and their full setting."""
    small = {name: bench[name].subset(range(min(n, bench[name].n_images)), name=name)
             for name, n in SMOKE_PHOTOS.items()}
    small["full"] = concatenate([small["train"], small["val"], small["test"]], "full",
                                queries_from=small["test"])
    small["pretrain"] = small["train"]  # as load_feature_bench's
    return small


def run_features(features_dir, out="outputs/benchmark-real", text_encoder: str = MINILM_NAME,
                 smoke: bool = False, seed: int = 0, checkpoints=CHECKPOINTS,
                 progress: bool = True, ablations: bool = False) -> dict:
    """Fit, evaluate and time every method on a feature folder, and write OUT's outputs."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # float16: half the memory; the photos' paths as lesson 08's, so the same checkpoint names
    bench = load_feature_bench(features_dir, regions_dtype=np.float16,
                               image_root=extracted_images(features_dir))
    if missing := [s for s in ("train", "val", "test") if s not in bench]:
        raise ValueError(f"{features_dir} has no {', '.join(missing)} split: extract every split "
                         "(train, val and test: drop --splits) to train, choose and report")
    if smoke:
        bench = smoke_bench(bench)
    methods, train_seconds = fit_real_methods(bench, text_encoder, smoke, seed, checkpoints,
                                              ablations=ablations)
    rows = evaluate_real(methods, bench, smoke, seed, progress)
    info = bench["test"].info
    results = results_dict(rows, methods, smoke=smoke, seed=seed,
                           seconds=time.perf_counter() - start, references=REFERENCE_NOTES,
                           data="real", features=str(features_dir),
                           backbone=info.get("features", {}), text_encoder=text_encoder,
                           sizes={name: [s.n_images, s.n_texts] for name, s in bench.items()},
                           train_seconds=train_seconds, shipped_models=[])
    results |= {"latency": [], "curves": training_curves(methods),
                "published": published_rows(info.get("dataset"))}  # on their own gallery
    write_outputs(results, out)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--features", required=True, metavar="DIR", help="a feature folder written by "
        "data_scripts/extract_features.py, every split of it (train, val and test)")
    add("--out", default=None, help="folder for results.json/.md, pareto.png and curves.png "
        "(default: outputs/benchmark-real, or outputs/benchmark-real-smoke with --smoke)")
    add("--checkpoints", default=CHECKPOINTS,
        help="folder of cached trained models, shared with lesson 08 (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of every method and of the sampled queries")
    add("--ablations", action="store_true", help=f"also train {PRETRAINED}, LightningDOT "
        "pre-trained on the training pairs before its fine-tuning (lesson 08's pre-training "
        "verdict; about 25 more minutes on two cores)")
    add("--smoke", action="store_true", help="the first few photos of each split and tiny models "
        "(also on when COURSE_SMOKE=1): the same code path in minutes")
    add("--text-encoder", default=MINILM_NAME, metavar="NAME_OR_FOLDER", help="the pretrained "
        "text encoder the text side starts from (default: the offline %(default)s; on Colab e.g. "
        "bert-base-uncased)")
    add("--readme", default=None,
        help="also write the test table into this README's real-results block, the full setting "
             "into docs/results.md's beside it and the frontier picture to docs/pareto-real.png")
    args = parser.parse_args(argv)
    smoke = args.smoke or settings.smoke_mode()
    out = Path(args.out or "outputs/benchmark-real" + ("-smoke" if smoke else ""))
    try:
        if args.readme:
            update_readme(None, args.readme, check_only=True, real=True)
        results = run_features(args.features, out, args.text_encoder, smoke=smoke, seed=args.seed,
                               checkpoints=args.checkpoints, ablations=args.ablations)
    except (OSError, ValueError) as error:  # an unfinished feature folder, missing weights
        parser.error(str(error))
    if args.readme:
        update_readme(results, args.readme)
    print(results_markdown(results))
    print(f"wrote {out / 'results.json'}, results.md, pareto.png and curves.png")
    return results


if __name__ == "__main__":
    main()
