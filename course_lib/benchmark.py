"""The headless main job: `python -m course_lib.benchmark [--smoke] [--out DIR] [--retrain]`.

With `--features DIR` it runs on real photographs instead (`run_features`: the course's own methods,
course_lib.real_benchmark, trained on the grid features of DIR); the synthetic benchmark and its shipped
models are not touched.

Builds the synthetic benchmark, fits every registered method (course_lib.methods.registry), evaluates it
on the test, full and compositional settings (docs/data.md, docs/results.md), times one text query against each
gallery, and writes DIR/results.json, DIR/results.md (every table) and DIR/pareto.png; --readme README.md also
writes the test table into the README and the rest into docs/results.md.
Each setting also gets two reference rows: `oracle`, the expected recall of the Bayes-optimal ranking
under the generator's own caption likelihood, the best any model can reach (course_lib.data.oracle),
and `bag-of-objects`, what one hand-built vector per image reaches with perfect perception
(course_lib.studies.single_vector): the limit of the dual encoders' form on this data.

A method follows course_lib.methods.base.Method: `fit`, `rank(split, direction, top_k, queries)`,
`query_fn(split, caption_index, top_k)`, `pairs_per_query`, and its own budgets `eval_pairs` and
`timed_sizes`. Each is measured by course_lib.evaluation, and the full setting's queries are the
test split's (split.text_queries).

Trained models: the shipped ones (shipped_models/, course_lib.core.shipped) where they match, else
the cache folder's (--checkpoints), else trained there. --retrain never loads a shipped model (nor
does --smoke: its tiny models always train); --refresh-shipped rewrites shipped_models/ instead of
running the benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.shipped import MANIFEST, SHIPPED_MODELS
from course_lib.core.offline_weights import MINILM_NAME
from course_lib.data.features import extracted_images, load_feature_bench
from course_lib.data.oracle import oracle_ceiling
from course_lib.evaluation import Galleries, evaluate, query_latency, results_row
from course_lib.real_benchmark import (KS as REAL_KS, REFERENCE_NOTES as REAL_REFERENCE_NOTES,
                                      SETTINGS as REAL_SETTINGS, chance_metrics, fit_real_methods,
                                      training_curves)
from course_lib.published import published_rows
from course_lib.methods.registry import available_methods, registered_names
from course_lib.shipping import SEED, benchmark_data, own_models, refresh
from course_lib.training_lanes import train_in_parallel, usable_cores
from course_lib.studies import single_vector
from course_lib.results import (PARTIAL, SETTINGS, cascade_timing_problems, check_outputs, merge_results,
                                partial_key, read_partial, read_results, results_dict,
                                results_markdown, run_mode, save_partial, update_readme,
                                write_outputs)

KS = {"test": (1, 5, 10), "full": (5, 10, 20), "compositional": (1, 5, 10)}
# the most training processes by default: each holds its own copy of the benchmark's data
MAX_JOBS = 4
# pairs a pairwise scorer may score per setting and direction on real features: the course's cross-encoder
# reads about 1,700 pairs a second on two CPU cores, so its budget for the synthetic benchmark (600k) would
# take it six minutes a direction; 100k samples 200 of the 500-photo test split's 2,500 caption queries, and
# leaves a direction with fewer than MIN_SAMPLED_QUERIES (i2t's 2,500 captions, the full 7,000 photos) unmeasured
REAL_PAIR_CAP = 100_000
LATENCY_SIZES = (1_000, 5_000)  # gallery sizes of the latency table (docs/results.md: ms/query at 1k and 5k)


ORACLE_NOTE = ("Bayes-optimal ranking under the generator's own caption likelihood: the best expected "
               "recall any model can reach (course_lib.data.oracle)")
REFERENCE_NOTES = {"oracle": ORACLE_NOTE, single_vector.NAME: single_vector.NOTE}


def run(smoke: bool = False, out: str | Path = "outputs/benchmark", seed: int = 0, progress: bool = True,
        methods=None, checkpoints: str | Path = CHECKPOINTS, every_pair=(), write: bool = True,
        retrain: bool = False, jobs: int = 1) -> dict:
    """Run the whole benchmark and write its three outputs; returns the results dict.

    checkpoints: the folder of trained models, shared with the notebooks (their `.fit(...,
    cache_dir="../outputs/checkpoints")`): a checkpoint's name hashes its config, data and
    vocabulary, so one folder serves every size and seed, and a model trained once is reused.
    methods: method names (course_lib.methods.registry), Method objects, or None for every registered one.
    every_pair: the settings (e.g. ("test",)) where every method ranks every query, whatever its
    budget; True = test and compositional (the full setting's 60M cross-encoder pairs per direction
    would take hours on a CPU, so it is never the default). write=False: return the results without
    writing them (the caller merges them with an earlier run first). retrain: train (or load from
    `checkpoints`) every model instead of loading the shipped ones; smoke always does. jobs > 1: the
    models that must train are trained first in that many processes (course_lib.training_lanes), and
    each method's fit then loads its finished checkpoint (with method names only, not Method objects)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    settings.seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench, tokenizer = benchmark_data(smoke, seed)
    training = []  # the models trained side by side, with their times
    if methods is None or all(isinstance(m, str) for m in methods):  # names, or every method
        if jobs > 1:
            training = train_in_parallel(methods, seed=seed, smoke=smoke, checkpoints=checkpoints, jobs=jobs,
                                         retrain=smoke or retrain, progress=progress, data=(bench, tokenizer))
        methods = available_methods(seed, smoke, names=methods)
    repeats = 5 if smoke else 20
    rows, latency = [], []
    for setting in SETTINGS:
        split = bench[setting]
        ks = KS[setting]
        rows.append(results_row("oracle", setting, split, oracle_ceiling(split, ks), ks, None,
                                "expected recall, computed from the generator's ground truth"))
        rows.append(results_row(single_vector.NAME, setting, split,
                                single_vector.reference_metrics(split, ks), ks, None,
                                "expected recall, ties broken at random; not trained"))
    # each finished method's rows are kept as the run goes: an interrupted run, started again with the
    # same mode, seed and settings, continues where it stopped
    partial, key = out / PARTIAL, partial_key(smoke, seed, every_pair)
    kept = read_partial(partial, key)
    steps = tqdm(total=len(methods) * (len(SETTINGS) + 2), desc="benchmark", disable=not progress)
    galleries = Galleries()
    for method in methods:
        if method.name in kept:
            rows += kept[method.name]["rows"]
            latency += kept[method.name]["latency"]
            steps.update(len(SETTINGS) + 2)
            continue
        first_row, first_point = len(rows), len(latency)
        steps.set_postfix(method=method.name, step="fit")
        with settings.retraining(smoke or retrain):
            method.fit(bench, tokenizer, cache_dir=Path(checkpoints))
        steps.update()
        # the latency table's galleries first: the settings after them leave the method's cached states
        # on test, full and compositional (base.CACHED_SPLITS), the splits the cascades built on it use first
        steps.set_postfix(method=method.name, step="latency")
        for point in query_latency(method, bench["full"], LATENCY_SIZES, smoke, repeats, galleries):
            if point["n"] in LATENCY_SIZES:
                latency.append({"method": method.name, "n": point["n"],
                                "ms_per_query": round(point["ms_per_query"], 4), "measured": point["measured"]})
        steps.update()
        for setting in SETTINGS:
            split = bench[setting]
            steps.set_postfix(method=method.name, step=setting)
            metrics, how = evaluate(method, split, KS[setting], smoke, seed,
                                    every_pair=setting in (("test", "compositional") if every_pair is True
                                                           else every_pair))
            query = query_latency(method, split, (split.n_images,), smoke, repeats, galleries)[-1]
            timed = "measured" if query["measured"] else "extrapolated linearly from smaller galleries"
            rows.append(results_row(method.name, setting, split, metrics, KS[setting],
                                    query["ms_per_query"],
                                    f"{how}; ms: one text query, median of {repeats}, {timed}",
                                    ms_measured=query["measured"],
                                    ms_spread=(query["p25_ms"], query["p75_ms"])))
            steps.update()
        # the models it loaded from shipped_models/ are kept with its rows: a continued run names them too
        shipped = [m.name for m in own_models([method]) if m.from_shipped]
        kept[method.name] = {"rows": rows[first_row:], "latency": latency[first_point:], "shipped": shipped}
        save_partial(partial, key, kept)
    steps.close()
    noisy = cascade_timing_problems(methods, rows)
    if noisy:
        print(f"note: {noisy}", file=sys.stderr)
    # the models loaded from shipped_models/, each once, in the order the methods met them
    shipped_models = dict.fromkeys(n for m in methods for n in kept[m.name].get("shipped", []))
    results = results_dict(rows, methods, smoke=smoke, seed=seed,
                           seconds=time.perf_counter() - start, references=REFERENCE_NOTES,
                           sizes={name: [s.n_images, s.n_texts] for name, s in bench.items()},
                           timing_note=noisy, jobs=jobs, trained_in_parallel=training,
                           shipped_models=list(shipped_models))
    results["latency"] = latency
    if write:
        write_outputs(results, out)
    partial.unlink(missing_ok=True)  # the run is complete
    return results




def real_reference_rows(split, setting: str) -> list[dict]:
    """The untrained row of a real-data setting: chance (real data has no oracle)."""
    ks = REAL_KS[setting]
    return [results_row("chance", setting, split, chance_metrics(split, ks), ks, None,
                        "expected recall of a random ranking; not trained")]


def evaluate_real(methods, bench: dict, smoke: bool = False, seed: int = 0, progress: bool = True,
                  setting_names=REAL_SETTINGS) -> list[dict]:
    """The results rows: chance, then every method on every setting, its recalls
    (evaluation.evaluate: a fixed sample of queries where a method's pair budget runs out) and ms
    per text query."""
    from tqdm.auto import tqdm

    repeats = 5 if smoke else 20
    rows = [row for setting in setting_names for row in real_reference_rows(bench[setting], setting)]
    for method in tqdm(methods, desc="evaluating", disable=not progress):
        for setting in setting_names:
            split, start = bench[setting], time.perf_counter()
            metrics, how = evaluate(method, split, REAL_KS[setting], smoke, seed, pair_cap=REAL_PAIR_CAP)
            query = query_latency(method, split, (split.n_images,), smoke, repeats)[-1]
            notes = f"{how}; ms: one text query (its text encoder included), median of {repeats}"
            rows.append(results_row(method.name, setting, split, metrics, REAL_KS[setting],
                                    query["ms_per_query"], notes, ms_measured=query["measured"],
                                    ms_spread=(query["p25_ms"], query["p75_ms"])))
            rows[-1]["eval_s"] = round(time.perf_counter() - start, 1)  # recalls and timing: the budget's parts
    return rows


# photos of each split in smoke mode: a few dozen, the same code path
SMOKE_PHOTOS = {"train": 48, "val": 16, "test": 16}


def smoke_bench(bench: dict) -> dict:
    """The first few photos of each split (SMOKE_PHOTOS), and their full setting."""
    from course_lib.data.split import concatenate

    small = {name: bench[name].subset(range(min(n, bench[name].n_images)), name=name)
             for name, n in SMOKE_PHOTOS.items()}
    small["full"] = concatenate([small["train"], small["val"], small["test"]], "full", queries_from=small["test"])
    small["pretrain"] = small["train"]  # as load_feature_bench's
    return small


def run_features(features_dir, out="outputs/benchmark-real", text_encoder: str = MINILM_NAME, smoke: bool = False,
                 seed: int = 0, checkpoints=CHECKPOINTS, progress: bool = True) -> dict:
    """`--features DIR`: fit (course_lib.real_benchmark.fit_real_methods), evaluate and time every method on a
    feature folder of data_scripts/extract_features.py; write OUT's results.json, results.md, pareto.png and
    curves.png."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # float16: half the memory (batches are float32); the photos' paths, as lesson 08 loads them: the same
    # training data, so the same checkpoint names
    bench = load_feature_bench(features_dir, regions_dtype=np.float16, image_root=extracted_images(features_dir))
    missing = [s for s in ("train", "val", "test") if s not in bench]
    if missing:
        raise ValueError(f"{features_dir} has no {', '.join(missing)} split: extract every split (train, val and "
                         "test: drop --splits) to train, choose and report")
    if smoke:
        bench = smoke_bench(bench)
    methods, train_seconds = fit_real_methods(bench, text_encoder, smoke, seed, checkpoints)
    rows = evaluate_real(methods, bench, smoke, seed, progress)
    info = bench["test"].info
    results = results_dict(rows, methods, smoke=smoke, seed=seed,
                           seconds=time.perf_counter() - start, references=REAL_REFERENCE_NOTES,
                           data="real", features=str(features_dir),
                           backbone=info.get("features", {}), text_encoder=text_encoder,
                           sizes={name: [s.n_images, s.n_texts] for name, s in bench.items()},
                           train_seconds=train_seconds, shipped_models=[])
    results |= {"latency": [], "curves": training_curves(methods),
                # the papers' rows, on their own gallery
                "published": published_rows(info.get("dataset"))}
    write_outputs(results, out)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (also on when COURSE_SMOKE=1): minutes become seconds")
    parser.add_argument("--out", default=None,
                        help="folder for results.json/.md and pareto.png (default: outputs/benchmark, or "
                             "outputs/benchmark-smoke with --smoke)")
    parser.add_argument("--checkpoints", default=CHECKPOINTS,
                        help="folder of cached trained models, shared with the notebooks (default: %(default)s)")
    parser.add_argument("--retrain", action="store_true",
                        help="train every model (or load it from --checkpoints) instead of loading the shipped "
                             "models of shipped_models/ (also on when COURSE_RETRAIN=1)")
    parser.add_argument("--refresh-shipped", action="store_true",
                        help="instead of the benchmark: train the default models (or load them from --checkpoints) "
                             f"and rewrite {SHIPPED_MODELS.name}/ with their weights and manifest; with --methods, only "
                             "those methods' models are refreshed and the other shipped models that are still "
                             "current stay")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
    parser.add_argument("--jobs", type=int, default=min(usable_cores(), MAX_JOBS),
                        help="processes that train the models that must train, side by side (course_lib."
                             f"training_lanes; default: this machine's usable cores, at most {MAX_JOBS}, here "
                             "%(default)s); 1 = one after another in this process")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the methods to run, e.g. 'vsepp,scan' "
                             "('' = only the reference rows); default: every method")
    parser.add_argument("--every-pair", nargs="*", choices=SETTINGS, default=None, metavar="SETTING",
                        help="rank every query of these settings, whatever a method's budget (no names: test "
                             "and compositional; the cross-encoder on test: about 8 min on one CPU thread)")
    parser.add_argument("--merge", default=None, metavar="RESULTS_JSON",
                        help="keep the rows of an earlier results.json for every method this run does not run "
                             "(e.g. --methods of new methods only, --merge outputs/benchmark/results.json)")
    parser.add_argument("--readme", default=None,
                        help="also write the test table into this README's results block (README.md), the other "
                             "tables into docs/results.md beside it and the accuracy-latency picture to docs/pareto.png "
                             "(with --features: their real-results blocks and docs/pareto-real.png)")
    parser.add_argument("--replace", action="store_true",
                        help="overwrite --out's results.json even if it holds methods this run drops, or "
                             "another mode or seed (without it, such a run stops before any work)")
    parser.add_argument("--features", default=None, metavar="DIR",
                        help="instead of the synthetic benchmark: real photographs, a feature folder written by "
                             "data_scripts/extract_features.py (course_lib.real_benchmark; default --out "
                             "outputs/benchmark-real); the synthetic shipped models are not touched")
    parser.add_argument("--text-encoder", default=None, metavar="NAME_OR_FOLDER",
                        help="with --features: the pretrained text encoder the text side starts from (default: "
                             "the offline all-MiniLM-L6-v2; on Colab e.g. bert-base-uncased)")
    args = parser.parse_args(argv)
    if args.text_encoder and not args.features:
        parser.error("--text-encoder goes with --features (the synthetic benchmark's text sides train from scratch)")
    if args.features and (args.methods is not None or args.merge or args.every_pair is not None
                          or args.refresh_shipped):
        parser.error("--methods, --merge, --every-pair and --refresh-shipped go with the synthetic benchmark; "
                     "--features runs every real-photo method (each trained model is loaded from --checkpoints)")
    if args.features:
        smoke = args.smoke or settings.smoke_mode()
        out = Path(args.out or "outputs/benchmark-real" + ("-smoke" if smoke else ""))
        try:
            if args.readme:
                update_readme(None, args.readme, check_only=True, real=True)
            results = run_features(args.features, out, args.text_encoder or MINILM_NAME, smoke=smoke,
                                   seed=args.seed, checkpoints=args.checkpoints)
        except (OSError, ValueError) as error:  # a missing or unfinished feature folder, missing weights
            parser.error(str(error))
        if args.readme:
            update_readme(results, args.readme)
        print(results_markdown(results))
        print(f"wrote {out / 'results.json'}, results.md and pareto.png")
        return results
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    settings.plain_course_notes()  # a noisy timing reads "note: ...", not a UserWarning with a file path
    smoke = args.smoke or settings.smoke_mode()
    if args.refresh_shipped:
        if smoke or args.seed != SEED:
            parser.error(f"--refresh-shipped makes the default models of seed {SEED}: drop --smoke "
                         "(and COURSE_SMOKE) and --seed")
        only = None if args.methods is None else [name for name in args.methods.split(",") if name]
        if args.jobs > 1:
            train_in_parallel(only, seed=SEED, checkpoints=args.checkpoints, jobs=args.jobs, retrain=True)
        manifest = refresh(SHIPPED_MODELS, checkpoints=args.checkpoints, only=only)
        total = sum(entry["bytes"] for entry in manifest["files"].values())
        print(f"wrote {len(manifest['files'])} models ({total / 1e6:.1f} MB) and {MANIFEST} to {SHIPPED_MODELS}"
              + (f"; not shipped (trained on first use): {', '.join(manifest['not_shipped'])}"
                 if manifest["not_shipped"] else ""))
        return manifest
    mode = run_mode(smoke)
    out = Path(args.out or ("outputs/benchmark-smoke" if smoke else "outputs/benchmark"))
    methods = None
    if args.methods is not None:
        methods = [name for name in args.methods.split(",") if name]
        unknown = sorted(set(methods) - set(registered_names()))
        if unknown:
            parser.error(f"unknown method(s) {unknown}; choose from {registered_names()}")
    # every input is checked before any work: a mistyped command must not cost a run, nor its results
    old = None
    try:
        if args.merge:
            old = read_results(args.merge)  # read before run() overwrites it
            if (old["meta"]["mode"], old["meta"]["seed"]) != (mode, args.seed):
                raise ValueError(f"--merge {args.merge} holds a {old['meta']['mode']} run of seed "
                                 f"{old['meta']['seed']}, and this is a {mode} run of seed {args.seed}: merge "
                                 "only runs of the same mode and seed (--smoke and --seed)")
        if args.readme:
            update_readme(None, args.readme, check_only=True)
        if not args.replace:
            check_outputs(out, mode, args.seed, methods if methods is not None else registered_names(), old)
    except ValueError as error:
        parser.error(str(error))
    every_pair = () if args.every_pair is None else (args.every_pair or True)
    try:
        results = run(smoke=smoke, out=out, seed=args.seed, methods=methods, checkpoints=args.checkpoints,
                      every_pair=every_pair, write=old is None, retrain=args.retrain, jobs=args.jobs)
    except KeyboardInterrupt:
        done = read_partial(out / PARTIAL, partial_key(smoke, args.seed, every_pair))
        print(f"\ninterrupted. {len(done)} method(s) finished ({', '.join(done) or 'none'}): their rows are kept in "
              f"{out / PARTIAL}, and the model being trained saved its progress every tenth of its steps in "
              f"{args.checkpoints}. Run the same command again to continue where it stopped; "
              f"{out / 'results.json'} was not touched.", file=sys.stderr)
        raise SystemExit(130) from None
    if old is not None:
        results = merge_results(results, old)
        write_outputs(results, out)
    if args.readme:
        update_readme(results, args.readme)
    print(results_markdown(results))
    print(f"wrote {out / 'results.json'}, results.md and pareto.png")
    return results


if __name__ == "__main__":
    main()
