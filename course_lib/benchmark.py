"""The headless main job: `python -m course_lib.benchmark [--smoke] [--out DIR]`.

Builds the synthetic benchmark, fits every registered method (course_lib.methods.registry), evaluates it
on the test, full and compositional settings (README, "Data" and "Results"), times one text query against each
gallery, and writes DIR/results.json, DIR/results.md (the README's table) and DIR/pareto.png.
Each setting also gets two reference rows: `oracle`, the expected recall of the Bayes-optimal ranking
under the generator's own caption likelihood, the best any model can reach (course_lib.data.oracle),
and `bag-of-objects`, what one hand-built vector per image reaches with perfect perception
(course_lib.studies.single_vector): the limit of the dual encoders' form on this data.

A method follows course_lib.methods.base.Method: `fit`, `rank(split, direction, top_k, queries)`,
`query_fn(split, caption_index, top_k)`, `pairs_per_query`, and its own budgets `eval_pairs` and
`timed_sizes`. Recalls come from each query's top-K list (metrics.ranks_from_top_k), so no dense
matrix is formed, and the full setting's queries are the test split's (split.text_queries).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.metrics import ranks_from_top_k, recall_at_k
from course_lib.core.timing import latency_vs_gallery
from course_lib.data.oracle import oracle_ceiling
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.base import ground_truth
from course_lib.methods.registry import available_methods, registered_names
from course_lib.studies import single_vector

SETTINGS = ("test", "full", "compositional")
KS = {"test": (1, 5, 10), "full": (5, 10, 20), "compositional": (1, 5, 10)}
LATENCY_SIZES = (1_000, 5_000)  # gallery sizes of the latency table (README: ms/query at 1k and 5k)
EXTRAPOLATED = "*"  # marks a time extrapolated linearly from smaller galleries, in every table
SAMPLED = "†"  # marks recalls from a sample of the queries


REFERENCES = ("oracle", single_vector.NAME)  # untrained rows every run writes, whatever its methods
ORACLE_NOTE = ("Bayes-optimal ranking under the generator's own caption likelihood: the best expected "
               "recall any model can reach (course_lib.data.oracle)")


def evaluate(method, split, ks, smoke: bool = False, seed: int = 0, every_pair: bool = False) -> tuple[dict, str]:
    """Recalls of a method on a split from its rankings, per direction: every query of the split,
    or a fixed random sample of them when pairs_per_query x queries exceeds the method's
    eval_pairs budget (every_pair=True lifts the budget, up to the method's every_pair_limit).
    Returns (metrics, how it was measured)."""
    metrics, how = {}, []
    for direction in ("t2i", "i2t"):
        queries = split.text_queries if direction == "t2i" else split.image_queries
        per_query = method.pairs_per_query(split, direction)
        budget = method.eval_pairs[1 if smoke else 0]
        limit = getattr(method, "every_pair_limit", None)
        if every_pair and (limit is None or per_query * len(queries) <= limit):
            budget = None
        if budget is not None and per_query * len(queries) > budget:
            n = max(1, budget // max(per_query, 1))
            rng = np.random.default_rng([seed, 0 if direction == "t2i" else 1])
            queries = np.sort(rng.choice(queries, size=n, replace=False))
            how.append(f"{direction} on {n} sampled queries ({n * per_query:,} pairs)")
        else:
            how.append(f"{direction} on all {len(queries)} queries")
        indices, scores = method.rank(split, direction, max(ks), queries)  # (Q, K) each
        ranks = ranks_from_top_k(scores, ground_truth(split, direction, queries, indices))
        metrics |= {f"{direction}_r{k}": v for k, v in recall_at_k(ranks, ks).items()}
    return metrics, "; ".join(how)


def _latency(method, gallery, sizes, smoke: bool, repeats: int) -> list[dict]:
    """ms per text query against galleries of the given sizes (the first n images of `gallery`)."""
    measured = method.timed_sizes[1 if smoke else 0]
    most = min(gallery.n_images, max(sizes) if measured is None else max(measured))
    measured = measured or (max(1, most // 4), max(2, most // 2), most)  # enough points for a linear fit
    points = sorted({n for n in measured if n <= most} | set(sizes))
    return latency_vs_gallery(lambda n: method.query_fn(gallery.subset(range(min(n, gallery.n_images)))),
                              points, warmup=2, repeats=repeats, max_measured=most)


def _row(method, setting, split, metrics, ks, ms_per_query, notes, ms_measured=True, ms_spread=(None, None)):
    row = {"method": method, "setting": setting, "n_images": split.n_images, "n_texts": split.n_texts,
           "n_text_queries": split.n_text_queries, "n_image_queries": split.n_image_queries}
    for direction in ("i2t", "t2i"):
        for k in ks:
            value = metrics[f"{direction}_r{k}"]
            row[f"{direction}_r{k}"] = None if value is None else round(float(value), 2)
    recalls = [row[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks]
    row["ar"] = None if None in recalls else round(float(np.mean(recalls)), 2)
    row["ms_per_query"] = None if ms_per_query is None else round(float(ms_per_query), 4)
    # the interquartile range of the timed calls: a median is only as good as its spread
    row["ms_p25"], row["ms_p75"] = (None if v is None else round(float(v), 4) for v in ms_spread)
    row["ms_measured"] = bool(ms_measured)
    row["notes"] = notes
    return row


def run(smoke: bool = False, out: str | Path = "outputs/benchmark", seed: int = 0, progress: bool = True,
        methods=None, checkpoints: str | Path = CHECKPOINTS, every_pair=(), write: bool = True) -> dict:
    """Run the whole benchmark and write its three outputs; returns the results dict.

    checkpoints: the folder of trained models, shared with the notebooks (their `.fit(...,
    cache_dir="../outputs/checkpoints")`): a checkpoint's name hashes its config, data and
    vocabulary, so one folder serves every size and seed, and a model trained once is reused.
    methods: method names (course_lib.methods.registry), Method objects, or None for every registered one.
    every_pair: the settings (e.g. ("test",)) where every method ranks every query, whatever its
    budget; True = test and compositional (the full setting's 60M cross-encoder pairs per direction
    would take hours on a CPU, so it is never the default). write=False: return the results without
    writing them (the caller merges them with an earlier run first)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    settings.seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = SyntheticConfig.smoke() if smoke else SyntheticConfig()
    bench = make_benchmark(config, seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    if methods is None or all(isinstance(m, str) for m in methods):  # names, or every method
        methods = available_methods(seed, smoke, names=methods)
    repeats = 5 if smoke else 20
    rows, latency = [], []
    for setting in SETTINGS:
        split = bench[setting]
        rows.append(_row("oracle", setting, split, oracle_ceiling(split, KS[setting]), KS[setting], None,
                         "expected recall, computed from the generator's ground truth"))
        rows.append(_row(single_vector.NAME, setting, split, single_vector.reference_metrics(split, KS[setting]),
                         KS[setting], None, "expected recall, ties broken at random; not trained"))
    # each finished method's rows are kept as the run goes: an interrupted run, started again with the
    # same mode, seed and settings, continues where it stopped
    partial, key = out / PARTIAL, _partial_key(smoke, seed, every_pair)
    kept = _read_partial(partial, key)
    steps = tqdm(total=len(methods) * (len(SETTINGS) + 2), desc="benchmark", disable=not progress)
    for method in methods:
        if method.name in kept:
            rows += kept[method.name]["rows"]
            latency += kept[method.name]["latency"]
            steps.update(len(SETTINGS) + 2)
            continue
        first_row, first_point = len(rows), len(latency)
        steps.set_postfix(method=method.name, step="fit")
        method.fit(bench, tokenizer, cache_dir=Path(checkpoints))
        steps.update()
        for setting in SETTINGS:
            split = bench[setting]
            steps.set_postfix(method=method.name, step=setting)
            metrics, how = evaluate(method, split, KS[setting], smoke, seed,
                                    every_pair=setting in (("test", "compositional") if every_pair is True
                                                           else every_pair))
            query = _latency(method, split, (split.n_images,), smoke, repeats)[-1]
            timed = "measured" if query["measured"] else "extrapolated linearly from smaller galleries"
            rows.append(_row(method.name, setting, split, metrics, KS[setting], query["ms_per_query"],
                             f"{how}; ms: one text query, median of {repeats}, {timed}",
                             ms_measured=query["measured"], ms_spread=(query["p25_ms"], query["p75_ms"])))
            steps.update()
        steps.set_postfix(method=method.name, step="latency")
        for point in _latency(method, bench["full"], LATENCY_SIZES, smoke, repeats):
            if point["n"] in LATENCY_SIZES:
                latency.append({"method": method.name, "n": point["n"],
                                "ms_per_query": round(point["ms_per_query"], 4), "measured": point["measured"]})
        steps.update()
        kept[method.name] = {"rows": rows[first_row:], "latency": latency[first_point:]}
        _write_json(partial, {"key": key, "methods": kept})
    steps.close()
    env = settings.describe_environment()
    noisy = cascade_timing_problems(methods, rows)
    if noisy:
        print(f"note: {noisy}", file=sys.stderr)
    results = {
        "meta": {"device": env["device"], "torch": env["torch"], "mode": "smoke" if smoke else "default",
                 "seconds": round(time.perf_counter() - start, 1), "seed": seed,
                 "sizes": {name: [s.n_images, s.n_texts] for name, s in bench.items()},
                 "timing_note": noisy},
        "methods": {"oracle": ORACLE_NOTE, single_vector.NAME: single_vector.NOTE} | {m.name: m.notes for m in methods},
        "rows": rows,
        "latency": latency,
    }
    if write:
        write_outputs(results, out)
    partial.unlink(missing_ok=True)  # the run is complete
    return results


PARTIAL = ".partial.json"  # in --out: the rows of the methods an unfinished run completed


def _partial_key(smoke: bool, seed: int, every_pair) -> dict:
    """What must match for an interrupted run's rows to be reused (methods are matched by name)."""
    return {"mode": "smoke" if smoke else "default", "seed": seed,
            "every_pair": every_pair if every_pair is True else sorted(every_pair)}


def _write_json(path: Path, data) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def _read_partial(path: Path, key: dict) -> dict:
    """The finished methods' rows of an earlier, interrupted run with the same key, or {}."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if saved.get("key") != json.loads(json.dumps(key)):
        return {}
    return dict(saved.get("methods", {}))


def cascade_timing_problems(methods, rows) -> str | None:
    """A plain-words note when the timings contradict themselves, which a quiet machine cannot produce:
    a cascade (a method whose first stage is another method of the run) measured faster than its first
    stage alone, or a cascade measured slower than the same stages keeping more candidates. None when
    the timings agree with both rules."""
    ms = {(r["method"], r["setting"]): r for r in rows if r.get("ms_per_query") and r.get("ms_measured", True)}
    clashes = []
    for method in methods:
        first = getattr(method, "stages", [None])[0]
        for (name, setting), row in ms.items():
            own = first is not None and name == method.name and (first.name, setting) in ms
            if own and row["ms_per_query"] < ms[(first.name, setting)]["ms_per_query"]:
                clashes.append(f"{name} {row['ms_per_query']:.3g} ms against its first stage {first.name} "
                               f"{ms[(first.name, setting)]['ms_per_query']:.3g} ms ({setting})")
    chains = [m for m in methods if getattr(m, "stages", None) and getattr(m, "top_ms", None)]
    for a in chains:  # the same stages keeping fewer candidates cannot cost more
        for b in chains:
            same = [s.name for s in a.stages] == [s.name for s in b.stages] and a is not b
            if not (same and all(x <= y for x, y in zip(a.top_ms, b.top_ms)) and a.top_ms != b.top_ms):
                continue
            for setting in {s for _, s in ms}:
                if (a.name, setting) in ms and (b.name, setting) in ms and \
                        ms[(a.name, setting)]["ms_per_query"] > ms[(b.name, setting)]["ms_per_query"]:
                    clashes.append(f"{a.name} {ms[(a.name, setting)]['ms_per_query']:.3g} ms against {b.name} "
                                   f"{ms[(b.name, setting)]['ms_per_query']:.3g} ms, which keeps more candidates ({setting})")
    if not clashes:
        return None
    return ("this run's timings are too noisy to trust: a cascade cannot cost less than its first stage, yet "
            + "; ".join(clashes) + ". Something else was using the CPU: re-run with the machine otherwise idle.")


def write_outputs(results: dict, out: Path) -> None:
    """results.json, results.md and pareto.png into `out`, all or nothing: each is written to a
    temporary file first and renamed over the old one only once all three are written, so a run
    that fails or is interrupted while writing leaves the previous outputs whole."""
    out = Path(out)
    staged = {out / "results.json": out / ".results.json.tmp", out / "results.md": out / ".results.md.tmp",
              out / "pareto.png": out / ".pareto.tmp.png"}
    try:
        staged[out / "results.json"].write_text(json.dumps(results, indent=2))
        staged[out / "results.md"].write_text(results_markdown(results))
        _save_pareto(results["rows"], staged[out / "pareto.png"])
        for final, temporary in staged.items():
            os.replace(temporary, final)  # atomic on one file system
    finally:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)


def read_results(path) -> dict:
    """An earlier results.json, checked before any work: readable, complete JSON, with a "meta"
    (mode, seed) and a list of "rows". Every error names the file and says what to do."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}. Give the path of a results.json "
                         "that python -m course_lib.benchmark wrote") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not complete JSON ({error.msg} at line {error.lineno}, column {error.colno}): "
                         "was the run that wrote it cut short? Re-run that benchmark, or leave this file out") from None
    meta = results.get("meta") if isinstance(results, dict) else None
    rows = results.get("rows") if isinstance(results, dict) else None
    missing = []
    if not (isinstance(meta, dict) and {"mode", "seed"} <= meta.keys()):
        missing.append('a "meta" object with "mode" and "seed"')
    if not (isinstance(rows, list) and all(isinstance(r, dict) and {"method", "setting"} <= r.keys() for r in rows)):
        missing.append('a "rows" list of objects with "method" and "setting"')
    if missing:
        raise ValueError(f"{path} is not a benchmark results.json: it has no {' and no '.join(missing)}")
    return results


def check_outputs(out: Path, mode: str, seed: int, methods: list[str], merged: dict | None) -> None:
    """Refuse, before any work, a run that would replace out/results.json by one that drops some of
    its methods or holds another mode or seed: that file may be an hour of training. Raises ValueError
    saying how to keep it (--merge, another --out) or to overwrite it anyway (--replace)."""
    existing = Path(out) / "results.json"
    if not existing.exists():
        return
    try:
        current = read_results(existing)
    except ValueError as error:
        raise ValueError(f"{error}. This run would overwrite it: pass --replace to do so, or pick another --out") from None
    kept = {*REFERENCES, *methods, *({r["method"] for r in merged["rows"]} if merged else ())}
    lost = sorted({r["method"] for r in current["rows"]} - kept)
    theirs = (current["meta"]["mode"], current["meta"]["seed"])
    if lost:
        raise ValueError(f"{existing} holds the rows of {', '.join(lost)}, which this run would drop: add "
                         f"--merge {existing} to keep them, pick another --out, or pass --replace to overwrite it")
    if theirs != (mode, seed):
        raise ValueError(f"{existing} holds a {theirs[0]} run of seed {theirs[1]}, and this is a {mode} run of seed "
                         f"{seed}: pick another --out (e.g. outputs/benchmark-{mode}), or pass --replace to overwrite it")


def merge_results(new: dict, old: dict) -> dict:
    """This run's results plus the rows of `old` (an earlier results.json of the same mode and seed)
    for every method this run did not run, in course order; meta["merged"] says which rows are old.
    Lets a run of the new methods alone refresh the whole table without re-running the others."""
    if (old["meta"]["mode"], old["meta"]["seed"]) != (new["meta"]["mode"], new["meta"]["seed"]):
        raise ValueError(f"cannot merge a {old['meta']['mode']} run of seed {old['meta']['seed']} into a "
                         f"{new['meta']['mode']} run of seed {new['meta']['seed']}")
    ran = {r["method"] for r in new["rows"]}
    kept = sorted({r["method"] for r in old["rows"]} - ran)
    order = {name: i for i, name in enumerate([*REFERENCES, *registered_names()])}
    rank = lambda r: (SETTINGS.index(r["setting"]), order.get(r["method"], len(order)))  # noqa: E731
    rows = sorted(new["rows"] + [r for r in old["rows"] if r["method"] in kept], key=rank)
    latency = new.get("latency", []) + [p for p in old.get("latency", []) if p["method"] in kept]
    meta = {**new["meta"], "merged": {"methods": kept, "seconds": old["meta"]["seconds"]}}
    methods = {**{k: v for k, v in old.get("methods", {}).items() if k in kept}, **new.get("methods", {})}
    return {**new, "meta": meta, "methods": methods, "rows": rows,
            "latency": sorted(latency, key=lambda p: (order.get(p["method"], len(order)), p["n"]))}


def results_markdown(results: dict) -> str:
    """The results table as Markdown: one table per setting, columns from the rows' own keys."""
    meta = results["meta"]
    lines = [f"Mode `{meta['mode']}`, seed {meta['seed']}, device `{meta['device']}`, torch {meta['torch']}, "
             f"{meta['seconds']} s in all.", ""]
    if meta.get("merged"):
        lines[0] = lines[0][:-1] + (f" for the methods it ran; the rows of {', '.join(meta['merged']['methods'])} come "
                                    f"from an earlier run of the same mode and seed ({meta['merged']['seconds']} s).")
    for setting in SETTINGS:
        rows = [r for r in results["rows"] if r["setting"] == setting]
        if not rows:
            continue
        recall_keys = [k for k in rows[0] if k.startswith(("i2t_r", "t2i_r"))]
        head = f"**{setting}** ({rows[0]['n_images']:,} images, {rows[0]['n_texts']:,} captions"
        if (rows[0].get("n_text_queries", rows[0]["n_texts"]), rows[0].get("n_image_queries", rows[0]["n_images"])) \
                != (rows[0]["n_texts"], rows[0]["n_images"]):
            head += (f"; queries: the test split's {rows[0]['n_text_queries']:,} captions and "
                     f"{rows[0]['n_image_queries']:,} images")
        lines += [head + ")", ""]
        header = ["method"] + [k.replace("_r", " R@") for k in recall_keys] + ["AR", "ms/query"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            ms = _cell(r["ms_per_query"], ".3g")
            if r["ms_per_query"] is not None and not r.get("ms_measured", True):
                ms += EXTRAPOLATED
            elif r.get("ms_p25") is not None:
                ms += f" ({r['ms_p25']:.3g}–{r['ms_p75']:.3g})"  # the interquartile range
            cells = [_cell(r[k], ".1f") for k in recall_keys + ["ar"]] + [ms]
            sampled = "sampled" in r["notes"]
            lines.append("| " + " | ".join([r["method"] + (SAMPLED if sampled else "")] + cells) + " |")
        lines.append("")
    if results.get("latency"):
        sizes = sorted({p["n"] for p in results["latency"]})
        lines += [f"**ms per text query vs gallery size** ({EXTRAPOLATED} = extrapolated linearly from smaller galleries)",
                  "", "| method | " + " | ".join(f"{n:,} images" for n in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for name in dict.fromkeys(p["method"] for p in results["latency"]):
            points = {p["n"]: p for p in results["latency"] if p["method"] == name}
            lines.append(f"| {name} | " + " | ".join(
                f"{points[n]['ms_per_query']:.3g}{'' if points[n]['measured'] else EXTRAPOLATED}" if n in points else "–"
                for n in sizes) + " |")
        lines.append("")
    if any("sampled" in r["notes"] for r in results["rows"]):
        lines.append(f"{SAMPLED} too slow to score every query's pairs on this device: recalls of a fixed random "
                     "sample of the queries, each against the whole gallery (counts in results.json).")
    if any(r.get("ms_p25") is not None for r in results["rows"]):
        lines.append("ms/query: the median of the timed calls, with their interquartile range (25th–75th "
                     "percentile) in brackets.")
    if meta.get("timing_note"):
        lines.append(f"**Note:** {meta['timing_note']}")
    if any(not r.get("ms_measured", True) for r in results["rows"]):
        lines.append(f"{EXTRAPOLATED} ms/query extrapolated linearly from the largest galleries timed "
                     "(the method's timed_sizes), not measured.")
    lines += ["", "Methods:"] + [f"- `{name}`: {note}" for name, note in results.get("methods", {}).items()]
    return "\n".join(lines) + "\n"


def _cell(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def update_readme(results: dict | None, readme: str | Path, check_only: bool = False) -> None:
    """Replace the README's results block (between the two markers) with this run's table;
    check_only: only check that the README is there and has the block (before a run)."""
    readme = Path(readme)
    try:
        text = readme.read_text()
    except OSError as error:
        raise ValueError(f"cannot read the README {readme}: {error.strerror or error}") from None
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no results block; add the lines {README_START} and {README_END} "
                         "where the table should go")
    if check_only:
        return
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    temporary = readme.with_name(f".{readme.name}.tmp")
    temporary.write_text(f"{head}{README_START}\n{results_markdown(results)}{README_END}{tail}")
    os.replace(temporary, readme)


def _save_pareto(rows, path: Path) -> None:
    """Every method on t2i R@1 vs ms per query, test and full settings side by side (viz)."""
    # a bare Figure needs no GUI backend, so this works headless and leaves notebooks' backend alone
    from matplotlib.figure import Figure

    from course_lib.viz import plot_pareto_settings

    fig = plot_pareto_settings(rows, Figure(figsize=(13, 5.5)), settings=("test", "full"))
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (also on when COURSE_SMOKE=1): minutes become seconds")
    parser.add_argument("--out", default=None,
                        help="folder for results.json/.md and pareto.png (default: outputs/benchmark, or "
                             "outputs/benchmark-smoke with --smoke)")
    parser.add_argument("--checkpoints", default=CHECKPOINTS,
                        help="folder of cached trained models, shared with the notebooks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
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
                        help="also write the table into this README's results block (README.md)")
    parser.add_argument("--replace", action="store_true",
                        help="overwrite --out's results.json even if it holds methods this run drops, or "
                             "another mode or seed (without it, such a run stops before any work)")
    args = parser.parse_args(argv)
    settings.plain_course_notes()  # a noisy timing reads "note: ...", not a UserWarning with a file path
    smoke = args.smoke or settings.smoke_mode()
    mode = "smoke" if smoke else "default"
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
                      every_pair=every_pair, write=old is None)
    except KeyboardInterrupt:
        done = _read_partial(out / PARTIAL, _partial_key(smoke, args.seed, every_pair))
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
