"""The headless main job: `python -m course_lib.benchmark [--smoke] [--out DIR]`.

Builds the synthetic benchmark, fits every method the course has so far, evaluates it on the
test, full and compositional settings (DESIGN §4), times one text query against each gallery,
and writes DIR/results.json, DIR/results.md (the README's table) and DIR/pareto.png.
Each setting also gets an `oracle` row: the expected recall of the Bayes-optimal ranking under
the generator's own caption likelihood, the best any model can reach (course_lib.data.oracle).

A method is any object with `name`, `notes`, `fit(bench, tokenizer, cache_dir)` (train, or load
the checkpoint cached under cache_dir), `similarity(split)` (an (n_images, n_texts) score matrix)
and `query_fn(split)` (a zero-argument callable answering one text query against the gallery).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from . import settings
from .data.synthetic import SyntheticConfig, make_benchmark, oracle_ceiling
from .data.tokenizer import build_word_tokenizer
from .metrics import recall_at_k, retrieval_metrics, t2i_ranks
from .timing import latency_vs_gallery

SETTINGS = ("test", "full", "compositional")
KS = {"test": (1, 5, 10), "full": (5, 10, 20), "compositional": (1, 5, 10)}
LATENCY_SIZES = (1_000, 5_000)  # gallery sizes of the latency table (README: ms/query at 1k and 5k)
# Pairs a method may score per setting (default, smoke); None = every pair. Beyond it, t2i is
# measured on a fixed sample of text queries against the whole gallery (i2t needs every caption).
# A two-stage method scores top_m pairs per query, (n_images + n_texts) * top_m in all.
EVAL_PAIRS = {"scan": (8_000_000, 400_000), "cross_encoder": (600_000, 20_000),
              **{f"lightningdot+rerank@{m}": (600_000, 20_000) for m in (20, 50)}}
CHECKPOINTS = "outputs/checkpoints"  # trained models, shared with the notebooks (run's docstring)
RERANK_TOP_M = (20, 50)  # LightningDOT A.1: "for re-ranking, we choose k from {20, 50}"
# Galleries (default, smoke) a slow method's single query is timed on, the largest included; bigger
# ones are extrapolated linearly from these (LightningDOT's starred numbers). One cross-encoder query
# against 5k images takes about 0.4 s on one CPU thread.
TIMED_SIZES = {"cross_encoder": ((1_000, 2_500, 5_000), (25, 50, 100))}


ORACLE_NOTE = ("Bayes-optimal ranking under the generator's own caption likelihood: the best expected "
               "recall any model can reach (course_lib.data.oracle)")


def available_methods(seed: int = 0, smoke: bool = False) -> list:
    """Every method built so far, in the order the course teaches them."""
    from .cross_encoder import CrossEncoderConfig, CrossEncoderMethod
    from .cross_encoder_train import dual_encoder_miner
    from .lightningdot import LightningDOTConfig
    from .lightningdot_train import LightningDOTMethod
    from .rerank import TwoStageMethod
    from .scan_model import SCANConfig, SCANMethod
    from .vsepp import VsePPConfig, VsePPMethod

    def config(cls):
        return cls.smoke(seed=seed) if smoke else cls(seed=seed)

    vsepp = VsePPMethod(config(VsePPConfig))
    cross_encoder = CrossEncoderMethod(config(CrossEncoderConfig), miner=dual_encoder_miner(vsepp))
    lightningdot = LightningDOTMethod(config(LightningDOTConfig))
    return [vsepp, SCANMethod(config(SCANConfig)), cross_encoder, lightningdot,
            *(TwoStageMethod(lightningdot, cross_encoder, m) for m in RERANK_TOP_M)]


def _evaluate(method, split, ks, smoke: bool, seed: int, every_pair: bool = False) -> tuple[dict, str]:
    """Recalls of a method on a split: every pair, or t2i on sampled queries beyond its budget
    (every_pair=True lifts the budget)."""
    budget = None if every_pair else EVAL_PAIRS.get(method.name, (None, None))[1 if smoke else 0]
    per_query = getattr(method, "top_m", None)  # a two-stage method re-scores top_m pairs per query
    total = (split.n_images * split.n_texts if per_query is None
             else (split.n_images + split.n_texts) * per_query)
    if budget is None or total <= budget:
        scores = method.similarity(split)
        if isinstance(scores, tuple):  # (i2t, t2i): each direction re-ranked its own candidates
            return retrieval_metrics(scores[0], split.txt2img, ks=ks, t2i_sims=scores[1]), "every query re-ranked"
        return retrieval_metrics(scores, split.txt2img, ks=ks), "every pair scored"
    n_queries = min(split.n_texts, max(1, budget // (per_query or split.n_images)))
    picked = np.sort(np.random.default_rng(seed).choice(split.n_texts, size=n_queries, replace=False))
    sample = split.texts_subset(picked)
    t2i_scores = getattr(method, "t2i_similarity", method.similarity)(sample)
    recalls = recall_at_k(t2i_ranks(t2i_scores, sample.txt2img), ks)
    metrics = {f"t2i_r{k}": v for k, v in recalls.items()} | {f"i2t_r{k}": None for k in ks}
    return metrics, (f"t2i on {n_queries} sampled text queries against all {split.n_images} images "
                     f"({n_queries * (per_query or split.n_images):,} pairs scored); i2t not computed")


def _latency(method, gallery, sizes, smoke: bool, repeats: int) -> list[dict]:
    """ms per text query against galleries of the given sizes (the first n images of `gallery`)."""
    measured = TIMED_SIZES.get(method.name, (None, None))[1 if smoke else 0]
    most = min(gallery.n_images, max(sizes) if measured is None else max(measured))
    measured = measured or (max(1, most // 4), max(2, most // 2), most)  # enough points for a linear fit
    points = sorted({n for n in measured if n <= most} | set(sizes))
    return latency_vs_gallery(lambda n: method.query_fn(gallery.subset(range(min(n, gallery.n_images)))),
                              points, warmup=2, repeats=repeats, max_measured=most)


def _row(method, setting, split, metrics, ks, ms_per_query, notes):
    row = {"method": method, "setting": setting, "n_images": split.n_images, "n_texts": split.n_texts}
    for direction in ("i2t", "t2i"):
        for k in ks:
            value = metrics[f"{direction}_r{k}"]
            row[f"{direction}_r{k}"] = None if value is None else round(float(value), 2)
    recalls = [row[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks]
    row["ar"] = None if None in recalls else round(float(np.mean(recalls)), 2)
    row["ms_per_query"] = None if ms_per_query is None else round(float(ms_per_query), 4)
    row["notes"] = notes
    return row


def run(smoke: bool = False, out: str | Path = "outputs/benchmark", seed: int = 0, progress: bool = True,
        methods=None, checkpoints: str | Path = CHECKPOINTS, every_pair: bool = False) -> dict:
    """Run the whole benchmark and write its three outputs; returns the results dict.

    checkpoints: the folder of trained models, shared with the notebooks (their `.fit(...,
    cache_dir="../outputs/checkpoints")`): a checkpoint's name hashes its config, data and
    vocabulary, so one folder serves every size and seed, and a model trained once is reused.
    every_pair: score every pair of the test and compositional settings, however slow (the full
    setting stays sampled: 720M cross-encoder pairs would take about a day on a CPU)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    settings.seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = SyntheticConfig.smoke() if smoke else SyntheticConfig()
    bench = make_benchmark(config, seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    methods = available_methods(seed, smoke) if methods is None else methods
    repeats = 5 if smoke else 20
    rows, latency = [], []
    for setting in SETTINGS:
        split = bench[setting]
        rows.append(_row("oracle", setting, split, oracle_ceiling(split, KS[setting]), KS[setting], None,
                         "expected recall, computed from the generator's ground truth"))
    steps = tqdm(total=len(methods) * (len(SETTINGS) + 2), desc="benchmark", disable=not progress)
    for method in methods:
        steps.set_postfix(method=method.name, step="fit")
        method.fit(bench, tokenizer, cache_dir=Path(checkpoints))
        steps.update()
        for setting in SETTINGS:
            split = bench[setting]
            steps.set_postfix(method=method.name, step=setting)
            metrics, how = _evaluate(method, split, KS[setting], smoke, seed,
                                     every_pair=every_pair and setting != "full")
            query = _latency(method, split, (split.n_images,), smoke, repeats)[-1]
            timed = "measured" if query["measured"] else "extrapolated linearly from smaller galleries"
            rows.append(_row(method.name, setting, split, metrics, KS[setting], query["ms_per_query"],
                             f"{how}; ms: one text query, median of {repeats}, {timed}"))
            steps.update()
        steps.set_postfix(method=method.name, step="latency")
        for point in _latency(method, bench["full"], LATENCY_SIZES, smoke, repeats):
            if point["n"] in LATENCY_SIZES:
                latency.append({"method": method.name, "n": point["n"],
                                "ms_per_query": round(point["ms_per_query"], 4), "measured": point["measured"]})
        steps.update()
    steps.close()
    env = settings.describe_environment()
    results = {
        "meta": {"device": env["device"], "torch": env["torch"], "mode": "smoke" if smoke else "default",
                 "seconds": round(time.perf_counter() - start, 1), "seed": seed,
                 "sizes": {name: [s.n_images, s.n_texts] for name, s in bench.items()}},
        "methods": {"oracle": ORACLE_NOTE} | {m.name: m.notes for m in methods},
        "rows": rows,
        "latency": latency,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(results_markdown(results))
    _save_pareto(rows, out / "pareto.png")
    return results


def results_markdown(results: dict) -> str:
    """The results table as Markdown: one table per setting, columns from the rows' own keys."""
    meta = results["meta"]
    lines = [f"Mode `{meta['mode']}`, seed {meta['seed']}, device `{meta['device']}`, torch {meta['torch']}, "
             f"{meta['seconds']} s in all.", ""]
    for setting in SETTINGS:
        rows = [r for r in results["rows"] if r["setting"] == setting]
        if not rows:
            continue
        recall_keys = [k for k in rows[0] if k.startswith(("i2t_r", "t2i_r"))]
        lines += [f"**{setting}** ({rows[0]['n_images']} images, {rows[0]['n_texts']} captions)", ""]
        header = ["method"] + [k.replace("_r", " R@") for k in recall_keys] + ["AR", "ms/query"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            cells = [_cell(r[k], ".1f") for k in recall_keys + ["ar"]] + [_cell(r["ms_per_query"], ".3g")]
            sampled = "sampled" in r["notes"]
            lines.append("| " + " | ".join([r["method"] + ("†" if sampled else "")] + cells) + " |")
        lines.append("")
    if results.get("latency"):
        sizes = sorted({p["n"] for p in results["latency"]})
        lines += ["**ms per text query vs gallery size** (* = extrapolated linearly from smaller galleries)",
                  "", "| method | " + " | ".join(f"{n:,} images" for n in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for name in dict.fromkeys(p["method"] for p in results["latency"]):
            points = {p["n"]: p for p in results["latency"] if p["method"] == name}
            lines.append(f"| {name} | " + " | ".join(
                f"{points[n]['ms_per_query']:.3g}{'' if points[n]['measured'] else '*'}" if n in points else "–"
                for n in sizes) + " |")
        lines.append("")
    if any("sampled" in r["notes"] for r in results["rows"]):
        lines.append("† too slow to score every pair on this device: t2i on a fixed sample of text queries "
                     "against the whole gallery, i2t not computed (counts in results.json).")
    lines += ["", "Methods:"] + [f"- `{name}`: {note}" for name, note in results.get("methods", {}).items()]
    return "\n".join(lines) + "\n"


def _cell(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def update_readme(results: dict, readme: str | Path) -> None:
    """Replace the README's results block (between the two markers) with this run's table."""
    readme = Path(readme)
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no results block; add the lines {README_START} and {README_END} "
                         "where the table should go")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{results_markdown(results)}{README_END}{tail}")


def _save_pareto(rows, path: Path) -> None:
    # a bare Figure needs no GUI backend, so this works headless and leaves notebooks' backend alone
    from matplotlib.figure import Figure

    from .viz import plot_pareto

    fig = Figure(figsize=(6.5, 4.5))
    plot_pareto(rows, setting="test", ax=fig.subplots())
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (also on when COURSE_SMOKE=1): minutes become seconds")
    parser.add_argument("--out", default="outputs/benchmark", help="folder for results.json/.md and pareto.png")
    parser.add_argument("--checkpoints", default=CHECKPOINTS,
                        help="folder of cached trained models, shared with the notebooks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the methods to run, e.g. 'vsepp,scan' "
                             "('' = only the oracle rows); default: every method")
    parser.add_argument("--every-pair", action="store_true",
                        help="score every pair of test and compositional, however slow (cross-encoder: "
                             "about 8 min per setting on one CPU thread); full stays sampled")
    parser.add_argument("--readme", default=None,
                        help="also write the table into this README's results block (README.md)")
    args = parser.parse_args(argv)
    smoke = args.smoke or settings.smoke_mode()
    methods = None
    if args.methods is not None:
        wanted = [name for name in args.methods.split(",") if name]
        methods = {m.name: m for m in available_methods(args.seed, smoke)}
        unknown = sorted(set(wanted) - set(methods))
        if unknown:
            parser.error(f"unknown method(s) {unknown}; choose from {sorted(methods)}")
        methods = [methods[name] for name in wanted]
    results = run(smoke=smoke, out=args.out, seed=args.seed, methods=methods, checkpoints=args.checkpoints,
                  every_pair=args.every_pair)
    if args.readme:
        update_readme(results, args.readme)
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}, results.md and pareto.png")
    return results


if __name__ == "__main__":
    main()
