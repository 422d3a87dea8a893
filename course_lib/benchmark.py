"""The synthetic benchmark: `python -m course_lib.benchmark [--smoke] [--out DIR] [--retrain]`.

Fits every registered method, evaluates it on the test, full and compositional settings, times
one text query against each gallery, and writes DIR/results.json, results.md and pareto.png, with
two reference rows per setting: `oracle` (course_lib.data.oracle) and `bag-of-objects`
(course_lib.studies.single_vector). Models: the shipped ones, else --checkpoints', else trained."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from course_lib import results as results_io
from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.shipped import REFRESH_COMMAND
from course_lib.data.oracle import oracle_ceiling
from course_lib.evaluation import Galleries, evaluate, query_latency, results_row
from course_lib.methods.registry import available_methods, registered_names
from course_lib.results import SETTINGS, results_markdown
from course_lib.shipping import benchmark_data, own_models
from course_lib.studies import single_vector
from course_lib.training_lanes import add_jobs_option, checked_options, train_in_parallel

KS = {"test": (1, 5, 10), "full": (5, 10, 20), "compositional": (1, 5, 10)}
LATENCY_SIZES = (1_000, 5_000)  # gallery sizes of docs/results.md's latency table
# the settings a bare --every-pair ranks whole (the full setting's would take hours on a CPU)
EVERY_PAIR_SETTINGS = ("test", "compositional")
REAL_COMMAND = "python -m course_lib.real_benchmark --features DIR"
# options of the two other commands: given here, the user is told which command to type instead
OTHER_COMMANDS = {"--features": REAL_COMMAND, "--text-encoder": REAL_COMMAND,
                  "--refresh-shipped": REFRESH_COMMAND}
REFERENCE_NOTES = {"oracle": "Bayes-optimal ranking under the generator's own caption likelihood: "
                   "the best expected recall any model can reach (course_lib.data.oracle)",
                   single_vector.NAME: single_vector.NOTE}


def run(*, smoke: bool = False, seed: int = 0, methods=None, out: str | Path = "outputs/benchmark",
        checkpoints: str | Path = CHECKPOINTS, retrain: bool = False, jobs: int = 1,
        every_pair: tuple[str, ...] = (), merge: dict | None = None, progress: bool = True) -> dict:
    """Run the whole benchmark, write its outputs and return the results dict. methods: names
    (None: every one) or Method objects. retrain: train (or load from `checkpoints`), not load the
    shipped models (smoke always does). jobs > 1: the models that must train train first, in that
    many processes (names only). every_pair: the settings where every method ranks every query.
    merge: an earlier results.json of the same mode and seed: its other methods' rows are kept."""
    start = time.perf_counter()
    settings.seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench, tokenizer = benchmark_data(smoke, seed)
    training = []  # the models trained side by side, with their times
    if methods is None or all(isinstance(m, str) for m in methods):  # names, or every method
        if jobs > 1:
            training = train_in_parallel(methods, seed=seed, smoke=smoke, checkpoints=checkpoints,
                                         jobs=jobs, retrain=smoke or retrain, progress=progress,
                                         data=(bench, tokenizer))
        methods = available_methods(seed, smoke, names=methods)
    repeats = 5 if smoke else 20
    rows, latency = [], []
    for setting in SETTINGS:
        split, ks = bench[setting], KS[setting]
        rows += [results_row("oracle", setting, split, oracle_ceiling(split, ks), ks, None,
                             "expected recall, computed from the generator's ground truth"),
                 results_row(single_vector.NAME, setting, split,
                             single_vector.reference_metrics(split, ks), ks, None,
                             "expected recall, ties broken at random; not trained")]
    # each finished method's rows are kept as the run goes, so a rerun continues where it stopped
    partial, key = out / results_io.PARTIAL, results_io.partial_key(smoke, seed, every_pair)
    kept = results_io.read_partial(partial, key)
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
        # the latency galleries first: the settings then leave the cached states its cascades use
        steps.set_postfix(method=method.name, step="latency")
        points = query_latency(method, bench["full"], LATENCY_SIZES, smoke, repeats, galleries)
        latency += [{"method": method.name, "n": p["n"],
                     "ms_per_query": round(p["ms_per_query"], 4), "measured": p["measured"]}
                    for p in points if p["n"] in LATENCY_SIZES]
        steps.update()
        for setting in SETTINGS:
            split = bench[setting]
            steps.set_postfix(method=method.name, step=setting)
            metrics, how = evaluate(method, split, KS[setting], smoke, seed,
                                    every_pair=setting in every_pair)
            query = query_latency(method, split, (split.n_images,), smoke, repeats, galleries)[-1]
            timed = ("measured" if query["measured"]
                     else "extrapolated linearly from smaller galleries")
            notes = f"{how}; ms: one text query, median of {repeats}, {timed}"
            rows.append(results_row(method.name, setting, split, metrics, KS[setting],
                                    query["ms_per_query"], notes, ms_measured=query["measured"],
                                    ms_spread=(query["p25_ms"], query["p75_ms"])))
            steps.update()
        shipped = [m.name for m in own_models([method]) if m.from_shipped]
        kept[method.name] = {"rows": rows[first_row:], "latency": latency[first_point:],
                             "shipped": shipped}
        results_io.save_partial(partial, key, kept)
    steps.close()
    if noisy := results_io.cascade_timing_problems(methods, rows):
        print(f"note: {noisy}", file=sys.stderr)
    shipped_models = dict.fromkeys(n for m in methods for n in kept[m.name].get("shipped", []))
    sizes = {name: [s.n_images, s.n_texts] for name, s in bench.items()}
    results = results_io.results_dict(
        rows, methods, smoke=smoke, seed=seed, seconds=time.perf_counter() - start,
        references=REFERENCE_NOTES, sizes=sizes, timing_note=noisy, jobs=jobs,
        trained_in_parallel=training, shipped_models=list(shipped_models))
    results["latency"] = latency
    if merge is not None:
        results = results_io.merge_results(results, merge)
    results_io.write_outputs(results, out)
    partial.unlink(missing_ok=True)  # the run is complete
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny sizes: seconds, not minutes (or COURSE_SMOKE=1)")
    add("--out", default=None, help="folder for results.json/.md and pareto.png (default: "
        "outputs/benchmark, or outputs/benchmark-smoke with --smoke)")
    add("--checkpoints", default=CHECKPOINTS,
        help="folder of cached trained models, shared with the notebooks (default: %(default)s)")
    add("--retrain", action="store_true", help="train every model (or load it from --checkpoints), "
        "not the shipped_models/ ones (also on when COURSE_RETRAIN=1)")
    add("--seed", type=int, default=0, help="seed of the data and of every method")
    add_jobs_option(parser)
    add("--methods", default=None, help="comma-separated methods to run, e.g. 'vsepp,scan' ('': "
        "only the reference rows; default: every method)")
    add("--every-pair", nargs="*", choices=SETTINGS, default=None, metavar="SETTING",
        help="rank every query of these settings, whatever a method's budget (no names: "
             f"{' and '.join(EVERY_PAIR_SETTINGS)}; the cross-encoder on test: about 8 min on one "
             "CPU thread)")
    add("--merge", default=None, metavar="RESULTS_JSON", help="keep an earlier results.json's rows "
        "of every method not run here (e.g. --merge outputs/benchmark/results.json)")
    add("--readme", default=None,
        help="also write the test table into this README's results block, the other tables into "
             "docs/results.md beside it and the accuracy-latency picture to docs/pareto.png")
    add("--replace", action="store_true", help="overwrite --out's results.json even if it holds "
        "methods this run drops, or another mode or seed (else such a run stops before any work)")
    for option in OTHER_COMMANDS:  # accepted only to say which command they belong to
        add(option, nargs="?", const="", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for option, command in OTHER_COMMANDS.items():
        if getattr(args, option[2:].replace("-", "_")) is not None:
            parser.error(f"{option} belongs to another command: {command} (its --help lists "
                         "its options)")
    methods = checked_options(parser, args)
    settings.plain_course_notes()  # a noisy timing reads "note: ...", not a UserWarning
    smoke = args.smoke or settings.smoke_mode()
    mode = results_io.run_mode(smoke)
    out = Path(args.out or ("outputs/benchmark-smoke" if smoke else "outputs/benchmark"))
    # every input is checked before any work: a mistyped command must not cost a run or its results
    old = None
    try:
        if args.merge:
            old = results_io.read_results(args.merge)  # read before run() overwrites it
            if (old["meta"]["mode"], old["meta"]["seed"]) != (mode, args.seed):
                raise ValueError(f"--merge {args.merge} holds a {old['meta']['mode']} run of seed "
                                 f"{old['meta']['seed']}, and this is a {mode} run of seed "
                                 f"{args.seed}: merge only runs of the same mode and seed (--smoke "
                                 "and --seed)")
        if args.readme:
            results_io.update_readme(None, args.readme, check_only=True)
        if not args.replace:
            names = registered_names() if methods is None else methods
            results_io.check_outputs(out, mode, args.seed, names, old)
    except ValueError as error:
        parser.error(str(error))
    every_pair = () if args.every_pair is None else tuple(args.every_pair or EVERY_PAIR_SETTINGS)
    try:
        results = run(smoke=smoke, seed=args.seed, methods=methods, out=out,
                      checkpoints=args.checkpoints, retrain=args.retrain, jobs=args.jobs,
                      every_pair=every_pair, merge=old)
    except KeyboardInterrupt:
        partial = out / results_io.PARTIAL
        key = results_io.partial_key(smoke, args.seed, every_pair)
        done = results_io.read_partial(partial, key)
        print(f"\ninterrupted. {len(done)} method(s) finished ({', '.join(done) or 'none'}): their "
              f"rows are kept in {partial}, and the model being trained saved its progress "
              f"every tenth of its steps in {args.checkpoints}. Run the same command again to "
              f"continue where it stopped; {out / 'results.json'} was not touched.",
              file=sys.stderr)
        raise SystemExit(130) from None
    if args.readme:
        results_io.update_readme(results, args.readme)
    print(results_markdown(results))
    print(f"wrote {out / 'results.json'}, results.md and pareto.png")
    return results


if __name__ == "__main__":
    main()
