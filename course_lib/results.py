"""The benchmark's results once measured: the results dict, results.json read, checked, merged and
written all or nothing (with results.md and pareto.png), the README's tables, an interrupted run's
rows, and the note when its timings contradict themselves."""

from __future__ import annotations

import itertools
import json
import os
from functools import partial
from pathlib import Path

from course_lib.core.settings import describe_environment
from course_lib.methods.registry import registered_names
from course_lib.published import published_markdown
from course_lib.studies import single_vector

SETTINGS = ("test", "full", "compositional")
EXTRAPOLATED = "*"  # marks a time extrapolated linearly from smaller galleries, in every table
SAMPLED = "†"  # marks recalls from a sample of the queries
REFERENCES = ("oracle", single_vector.NAME)  # untrained rows every run writes, whatever its methods
PARTIAL = ".partial.json"  # in --out: the rows of the methods an unfinished run completed


def run_mode(smoke: bool) -> str:
    """A run's mode, as meta["mode"] names it: "smoke" (tiny sizes) or "default"."""
    return "smoke" if smoke else "default"


def results_dict(rows: list[dict], methods, *, smoke: bool, seed: int, seconds: float,
                 references: dict | None = None, **meta) -> dict:
    """A run's results as results.json holds them: {"meta", "methods": name -> notes, "rows"}."""
    env = describe_environment()
    return {"meta": {"device": env["device"], "torch": env["torch"], "mode": run_mode(smoke),
                     "seconds": round(seconds, 1), "seed": seed, **meta},
            "methods": {**(references or {}), **{method.name: method.notes for method in methods}},
            "rows": rows}


def partial_key(smoke: bool, seed: int, every_pair: tuple[str, ...]) -> dict:
    """What must match for an interrupted run's rows to be reused (methods are matched by name)."""
    return {"mode": run_mode(smoke), "seed": seed, "every_pair": sorted(every_pair)}


def save_partial(path: Path, key: dict, finished: dict) -> None:
    """Keep the finished methods' rows (method -> {"rows", "latency"}) for a rerun with this key."""
    _write_together({path: json.dumps({"key": key, "methods": finished})})


def read_partial(path: Path, key: dict) -> dict:
    """The finished methods' rows of an earlier, interrupted run with the same key, or {}."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(saved.get("methods", {})) if saved.get("key") == json.loads(json.dumps(key)) else {}


def cascade_timing_problems(methods, rows) -> str | None:
    """A note when the timings contradict themselves: a cascade faster than its first stage, or
    slower than the same stages keeping more candidates. None if they agree."""
    ms = {(r["method"], r["setting"]): r["ms_per_query"] for r in rows
          if r.get("ms_per_query") and r.get("ms_measured", True)}
    clashes = []
    for method in methods:
        first = getattr(method, "stages", [None])[0]
        for (name, setting), own_ms in ms.items():
            theirs = ms.get((getattr(first, "name", None), setting))
            if name == method.name and theirs is not None and own_ms < theirs:
                clashes.append(f"{name} {own_ms:.3g} ms against its first stage {first.name} "
                               f"{theirs:.3g} ms ({setting})")
    chains = [m for m in methods if getattr(m, "stages", None) and getattr(m, "top_ms", None)]
    for a, b in itertools.product(chains, repeat=2):  # the same stages keeping fewer cost no more
        same = [s.name for s in a.stages] == [s.name for s in b.stages]
        if not (same and a.top_ms != b.top_ms
                and all(x <= y for x, y in zip(a.top_ms, b.top_ms, strict=True))):
            continue
        for setting in {s for _, s in ms}:
            mine, theirs = ms.get((a.name, setting)), ms.get((b.name, setting))
            if mine is not None and theirs is not None and mine > theirs:
                clashes.append(f"{a.name} {mine:.3g} ms against {b.name} {theirs:.3g} ms, "
                               f"which keeps more candidates ({setting})")
    if not clashes:
        return None
    return ("this run's timings are too noisy to trust: a cascade cannot cost less than its first "
            "stage, yet " + "; ".join(clashes) + ". Something else was using the CPU: re-run with "
            "the machine otherwise idle.")


def write_outputs(results: dict, out: Path) -> None:
    """results.json, results.md, pareto.png (and curves.png) into `out`, all or nothing."""
    out = Path(out)
    files = {out / "results.json": json.dumps(results, indent=2),
             out / "results.md": results_markdown(results),
             out / "pareto.png": partial(_save_pareto, results["rows"],
                                         published=results.get("published"))}
    if results.get("curves"):  # a real-data run: its learning curves too
        files[out / "curves.png"] = partial(_save_curves, results["curves"])
    _write_together(files)


def _write_together(files: dict) -> None:
    """{path: its text, or a function writing it to a path}: all written, then moved in, or none."""
    staged = {final: final.with_name(f".{final.stem}.tmp{final.suffix}") for final in files}
    try:
        for final, content in files.items():
            write = content if callable(content) else partial(Path.write_text, data=content)
            write(staged[final])
        for final, temporary in staged.items():
            os.replace(temporary, final)
    finally:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)


def read_results(path) -> dict:
    """An earlier results.json, checked before any work; an error names the file and what to do."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}. Give the path of a "
                         "results.json that python -m course_lib.benchmark wrote") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not complete JSON ({error.msg} at line {error.lineno}, column "
                         f"{error.colno}): was the run that wrote it cut short? Re-run that "
                         "benchmark, or leave this file out") from None
    meta, rows = (results.get(k) if isinstance(results, dict) else None for k in ("meta", "rows"))
    missing = []
    if not (isinstance(meta, dict) and {"mode", "seed"} <= meta.keys()):
        missing.append('a "meta" object with "mode" and "seed"')
    if not (isinstance(rows, list)
            and all(isinstance(r, dict) and {"method", "setting"} <= r.keys() for r in rows)):
        missing.append('a "rows" list of objects with "method" and "setting"')
    if missing:
        raise ValueError(f"{path} is not a benchmark results.json: it has no "
                         f"{' and no '.join(missing)}")
    return results


def check_outputs(out: Path, mode: str, seed: int, methods: list[str], merged: dict | None) -> None:
    """ValueError, before any work, for a run that would replace out/results.json by one that drops
    some of its methods or holds another mode or seed: that file may be an hour of training."""
    existing = Path(out) / "results.json"
    if not existing.exists():
        return
    try:
        current = read_results(existing)
    except ValueError as error:
        raise ValueError(f"{error}. This run would overwrite it: pass --replace to do so, or pick "
                         "another --out") from None
    kept = {*REFERENCES, *methods, *({r["method"] for r in merged["rows"]} if merged else ())}
    lost = sorted({r["method"] for r in current["rows"]} - kept)
    theirs = (current["meta"]["mode"], current["meta"]["seed"])
    if lost:
        raise ValueError(f"{existing} holds the rows of {', '.join(lost)}, which this run would "
                         f"drop: add --merge {existing} to keep them, pick another --out, or pass "
                         "--replace to overwrite it")
    if theirs != (mode, seed):
        raise ValueError(f"{existing} holds a {theirs[0]} run of seed {theirs[1]}, and this is a "
                         f"{mode} run of seed {seed}: pick another --out (e.g. "
                         f"outputs/benchmark-{mode}), or pass --replace to overwrite it")


def merge_results(new: dict, old: dict) -> dict:
    """This run's results plus `old`'s rows of every method not run here, in course order."""
    if (old["meta"]["mode"], old["meta"]["seed"]) != (new["meta"]["mode"], new["meta"]["seed"]):
        raise ValueError(f"cannot merge a {old['meta']['mode']} run of seed {old['meta']['seed']} "
                         f"into a {new['meta']['mode']} run of seed {new['meta']['seed']}")
    ran = {r["method"] for r in new["rows"]}
    kept = sorted({r["method"] for r in old["rows"]} - ran)
    order = {name: i for i, name in enumerate([*REFERENCES, *registered_names()])}
    rows = sorted(new["rows"] + [r for r in old["rows"] if r["method"] in kept],
                  key=lambda r: (SETTINGS.index(r["setting"]), order.get(r["method"], len(order))))
    latency = new.get("latency", []) + [p for p in old.get("latency", []) if p["method"] in kept]
    meta = {**new["meta"], "merged": {"methods": kept, "seconds": old["meta"]["seconds"]}}
    methods = {**{k: v for k, v in old.get("methods", {}).items() if k in kept},
               **new.get("methods", {})}
    return {**new, "meta": meta, "methods": methods, "rows": rows,
            "latency": sorted(latency, key=lambda p: (order.get(p["method"], len(order)), p["n"]))}


def results_markdown(results: dict, settings=SETTINGS, extras: bool = True) -> str:
    """The results as Markdown; extras: the latency table and each method's notes too."""
    meta = results["meta"]
    lines = [f"Mode `{meta['mode']}`, seed {meta['seed']}, device `{meta['device']}`, torch "
             f"{meta['torch']}, {meta['seconds']} s in all.", ""]
    if merged := meta.get("merged"):
        lines[0] = lines[0][:-1] + (f" for the methods it ran; the rows of "
                                    f"{', '.join(merged['methods'])} come from an earlier run of "
                                    f"the same mode and seed ({merged['seconds']} s).")
    if meta.get("shipped_models"):  # the seconds above did not include their training
        lines[0] += (" Loaded from shipped_models/, not trained: "
                     f"{', '.join(meta['shipped_models'])}.")
    shown = [r for r in results["rows"] if r["setting"] in settings]
    for setting in settings:
        rows = [r for r in shown if r["setting"] == setting]
        if not rows:
            continue
        first = rows[0]
        recall_keys = [k for k in first if k.startswith(("i2t_r", "t2i_r"))]
        head = f"**{setting}** ({first['n_images']:,} images, {first['n_texts']:,} captions"
        queries = (first.get("n_text_queries", first["n_texts"]),
                   first.get("n_image_queries", first["n_images"]))
        if queries != (first["n_texts"], first["n_images"]):
            head += (f"; queries: the test split's {first['n_text_queries']:,} captions and "
                     f"{first['n_image_queries']:,} images")
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
            name = r["method"] + (SAMPLED if "sampled" in r["notes"] else "")
            lines.append("| " + " | ".join([name] + cells) + " |")
        lines.append("")
    if extras and results.get("latency"):
        sizes = sorted({p["n"] for p in results["latency"]})
        lines += [f"**ms per text query vs gallery size** ({EXTRAPOLATED} = extrapolated linearly "
                  "from smaller galleries)", "",
                  "| method | " + " | ".join(f"{n:,} images" for n in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for name in dict.fromkeys(p["method"] for p in results["latency"]):
            points = {p["n"]: p for p in results["latency"] if p["method"] == name}
            cells = [f"{points[n]['ms_per_query']:.3g}"
                     + ("" if points[n]["measured"] else EXTRAPOLATED) if n in points else "–"
                     for n in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if any("sampled" in r["notes"] for r in shown):
        lines.append(f"{SAMPLED} too slow to score every query's pairs on this device: recalls of "
                     "a fixed random sample of the queries, each against the whole gallery (counts "
                     "in results.json).")
    if any("not measured" in r["notes"] for r in shown):
        lines.append("– not measured: the method's pair budget allows too few sampled queries in "
                     "that direction for a recall worth comparing (its notes in results.json give "
                     "the count).")
    if any(r.get("ms_p25") is not None for r in shown):
        lines.append("ms/query: the median of the timed calls, with their interquartile range "
                     "(25th–75th percentile) in brackets.")
    if meta.get("timing_note"):
        lines.append(f"**Note:** {meta['timing_note']}")
    if any(not r.get("ms_measured", True) for r in shown):
        lines.append(f"{EXTRAPOLATED} ms/query extrapolated linearly from the largest galleries "
                     "timed (the method's timed_sizes), not measured.")
    test = next((r for r in shown if r["setting"] == "test"), None)  # None unless "test" is shown
    if results.get("published") and test is not None:
        lines += ["", published_markdown(results["published"], test["n_images"])]
    if extras:
        notes = results.get("methods", {})
        lines += ["", "Methods:"] + [f"- `{name}`: {note}" for name, note in notes.items()]
    return "\n".join(lines) + "\n"


def _cell(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"
README_SETTINGS = ("test",)  # the README shows the test setting; the rest goes to docs/results.md
RESULTS_DOC = Path("docs") / "results.md"  # beside the README: other settings, latency, notes
PICTURE = Path("docs") / "pareto.png"  # beside the README: the accuracy-latency picture it shows
# the real-photo run (course_lib.real_benchmark) has blocks of its own in both, and its own picture
REAL_START, REAL_END = "<!-- real-results:start -->", "<!-- real-results:end -->"
REAL_PICTURE = Path("docs") / "pareto-real.png"
_MARKERS = {False: (README_START, README_END, PICTURE), True: (REAL_START, REAL_END, REAL_PICTURE)}


def is_real(results: dict) -> bool:
    """Whether results come from real photographs (course_lib.real_benchmark)."""
    return results["meta"].get("data") == "real"


def readme_markdown(results: dict) -> str:
    """The README's results block: the test table, where the rest is, and the frontier picture."""
    doc, picture = RESULTS_DOC.as_posix(), _MARKERS[is_real(results)][2].as_posix()
    table = results_markdown(results, settings=README_SETTINGS, extras=False)
    if is_real(results):
        return (table + "\nThe full setting (every split's photos as the gallery), ms per query "
                f"and each method's notes: [`{doc}`]({doc}). The frontier (t2i R@1 against ms per "
                "text query, log axis; the published rows as dashed levels, measured on their "
                "1,000-photo gallery):\n\n![every method's recall on real photos against its ms "
                f"per query]({picture})\n")
    return (table + "\nThe full and compositional settings, ms per query against 1k and 5k images "
            f"and each method's notes: [`{doc}`]({doc}). The accuracy–latency picture (t2i R@1 on "
            "test, t2i R@5 on full, against ms per text query, log axis; the Pareto front as a "
            "step line, the oracle dotted, hollow markers where the time is extrapolated):\n\n"
            f"![every method's recall against its ms per query]({picture})\n")


def docs_markdown(results: dict) -> str:
    """docs/results.md's results block: every setting but the README's, latency table, notes."""
    return results_markdown(results, tuple(s for s in SETTINGS if s not in README_SETTINGS))


def _blocks(path: Path, start: str = README_START, end: str = README_END) -> tuple[str, str]:
    """The text before and after a file's results block; ValueError if file or block is missing."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    if start not in text or end not in text:
        raise ValueError(f"{path} has no results block; add the lines {start} and {end} "
                         "where the table should go")
    head, rest = text.split(start, 1)
    return head, rest.split(end, 1)[1]


def update_readme(results: dict | None, readme: str | Path, check_only: bool = False,
                  real: bool | None = None) -> None:
    """Write this run into the README's results block, docs/results.md's and the picture, all or
    nothing (a real-photo run: the real-results blocks). check_only: only check the blocks."""
    real = (results is not None and is_real(results)) if real is None else real
    start, end, picture = _MARKERS[real]
    readme = Path(readme)
    doc, picture = readme.parent / RESULTS_DOC, readme.parent / picture
    parts = {readme: _blocks(readme, start, end), doc: _blocks(doc, start, end)}
    if check_only:
        return
    body = {readme: readme_markdown(results), doc: docs_markdown(results)}
    files = {path: f"{head}{start}\n{body[path]}{end}{tail}"
             for path, (head, tail) in parts.items()}
    files[picture] = partial(_save_pareto, results["rows"], published=results.get("published"))
    _write_together(files)


def _save_curves(curves: dict, path: Path) -> None:
    from course_lib.viz import plot_training_curves

    plot_training_curves(curves).savefig(path, dpi=110)


def _save_pareto(rows, path: Path, published: dict | None = None) -> None:
    """Every method's recall against ms per query, test and full side by side (pareto_plot)."""
    # a bare Figure needs no GUI backend, and leaves notebooks' backend alone
    from matplotlib.figure import Figure

    from course_lib.pareto_plot import plot_pareto_settings

    fig = plot_pareto_settings(rows, Figure(figsize=(13, 5.5)), settings=("test", "full"),
                               published=published)
    fig.savefig(path, dpi=120)

