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

from . import settings
from .data.synthetic import SyntheticConfig, make_benchmark, oracle_ceiling
from .data.tokenizer import build_word_tokenizer
from .metrics import retrieval_metrics
from .timing import benchmark as time_call

SETTINGS = ("test", "full", "compositional")
KS = {"test": (1, 5, 10), "full": (5, 10, 20), "compositional": (1, 5, 10)}


def available_methods(seed: int = 0) -> list:
    """Every method built so far, in the order the course teaches them."""
    from .baselines import RandomProjectionBaseline

    return [RandomProjectionBaseline(seed=seed)]


def _row(method, setting, split, metrics, ks, ms_per_query, notes):
    row = {"method": method, "setting": setting, "n_images": split.n_images, "n_texts": split.n_texts}
    for direction in ("i2t", "t2i"):
        for k in ks:
            row[f"{direction}_r{k}"] = round(float(metrics[f"{direction}_r{k}"]), 2)
    row["ar"] = round(float(sum(row[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks) / (2 * len(ks))), 2)
    row["ms_per_query"] = None if ms_per_query is None else round(float(ms_per_query), 4)
    row["notes"] = notes
    return row


def run(smoke: bool = False, out: str | Path = "outputs/benchmark", seed: int = 0, progress: bool = True,
        methods=None) -> dict:
    """Run the whole benchmark and write its three outputs; returns the results dict."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    settings.seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = SyntheticConfig.smoke() if smoke else SyntheticConfig()
    bench = make_benchmark(config, seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    methods = available_methods(seed) if methods is None else methods
    rows = []
    for setting in SETTINGS:
        split = bench[setting]
        rows.append(_row("oracle", setting, split, oracle_ceiling(split, KS[setting]), KS[setting], None,
                         "Bayes-optimal ranking under the generator's caption likelihood: the best expected recall any model can reach"))
    steps = tqdm(total=len(methods) * len(SETTINGS), desc="benchmark", disable=not progress)
    for method in methods:
        method.fit(bench, tokenizer, cache_dir=out / "checkpoints" / ("smoke" if smoke else "default"))
        for setting in SETTINGS:
            split = bench[setting]
            metrics = retrieval_metrics(method.similarity(split), split.txt2img, ks=KS[setting])
            timing = time_call(method.query_fn(split), warmup=3, repeats=5 if smoke else 30)
            rows.append(_row(method.name, setting, split, metrics, KS[setting], timing.median_ms,
                             f"{method.notes}; one text query, median of {timing.repeats} on {timing.device}"))
            steps.update()
    steps.close()
    env = settings.describe_environment()
    results = {
        "meta": {"device": env["device"], "torch": env["torch"], "mode": "smoke" if smoke else "default",
                 "seconds": round(time.perf_counter() - start, 1), "seed": seed,
                 "sizes": {name: [s.n_images, s.n_texts] for name, s in bench.items()}},
        "rows": rows,
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
            ms = "n/a" if r["ms_per_query"] is None else f"{r['ms_per_query']:.3g}"
            lines.append("| " + " | ".join([r["method"]] + [f"{r[k]:.1f}" for k in recall_keys]
                                           + [f"{r['ar']:.1f}", ms]) + " |")
        lines.append("")
    lines.append("Notes: " + "; ".join(sorted({f"{r['method']}: {r['notes']}" for r in results["rows"]})))
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
    parser.add_argument("--readme", default=None,
                        help="also write the table into this README's results block (README.md)")
    args = parser.parse_args(argv)
    results = run(smoke=args.smoke or settings.smoke_mode(), out=args.out, seed=args.seed)
    if args.readme:
        update_readme(results, args.readme)
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}, results.md and pareto.png")
    return results


if __name__ == "__main__":
    main()
