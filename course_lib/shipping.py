"""Which trained models ship with the course (the default benchmark's, seed 0), and their refresh
(`python -m course_lib.refresh_shipped`; course_lib.core.shipped holds the folder's format).

A shipped model is named by what it was trained from (Method.stage) and checked by what it
computes: the manifest keeps each model's `probe` (its scores and recall on a fixed validation
batch), which `output_problems` recomputes, so an edit that changes a number cannot go unnoticed."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from course_lib.core import settings, shipped
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.files import write_atomically
from course_lib.core.metrics import retrieval_metrics
from course_lib.core.stages import config_fields
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.base import Method, Ranker
from course_lib.methods.registry import available_methods

SEED = 0  # the shipped models are the default benchmark's, of seed 0
PROBE_IMAGES = 32  # the probe batch: the first validation images, with their captions (5 each)
PROBE_KEPT = (40, 8)  # scores the manifest keeps: the first captions x images of the probe's matrix
# relative change of a kept score that counts: far above float32 and thread-order noise (~1e-6)
PROBE_TOLERANCE = 1e-4


def own_models(methods) -> list[Method]:
    """Every Method reachable from `methods` (attributes, lists of stages, a miner's method), each
    once, in the order first met: each owns a model it can ship."""
    found, seen = [], set()

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Method):
            found.append(obj)
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            miner_method = getattr(value, "method", None) if callable(value) else None
            for item in value if isinstance(value, (list, tuple)) else (value, miner_method):
                if isinstance(item, Ranker):
                    visit(item)

    for method in methods:
        visit(method)
    return found


def benchmark_data(smoke: bool = False, seed: int = SEED):
    """(bench, tokenizer) of the benchmark of this mode and seed: what every method trains on."""
    bench = make_benchmark(SyntheticConfig.smoke() if smoke else SyntheticConfig(), seed=seed)
    return bench, build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)


def default_benchmark():
    """(bench, tokenizer) of the default benchmark: the data the shipped models train on."""
    return benchmark_data(smoke=False, seed=SEED)


def _or_default(methods, bench, tokenizer) -> tuple:
    """(methods, bench, tokenizer), each the default benchmark's where None."""
    if bench is None:
        bench, tokenizer = default_benchmark()
    return available_methods(SEED, smoke=False) if methods is None else methods, bench, tokenizer


def shipping_entry(method: Method, bench, tokenizer) -> tuple[str, dict]:
    """(file name, manifest entry) of the method's model in the shipped folder: its stage's."""
    stage = method.stage(bench, tokenizer)
    return stage.file_name, shipped.manifest_entry(method.name, stage)


def expected_entries(bench=None, tokenizer=None, methods=None) -> dict:
    """{file name: manifest entry} of every model that should ship (default: the default run's)."""
    methods, bench, tokenizer = _or_default(methods, bench, tokenizer)
    return dict(shipping_entry(method, bench, tokenizer) for method in own_models(methods))


def probe_split(bench):
    """val's first PROBE_IMAGES images and captions, a new split each time: no cache answers it."""
    val = bench["val"]
    return val.subset(range(min(PROBE_IMAGES, val.n_images)), name="probe")


@contextlib.contextmanager
def as_shipped(method: Method):
    """The method's model with its weights as a shipped file gives them back, restored after."""
    model = method.model
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = shipped.shipped_weights(model)
    model.load_state_dict({k: v.to(original[k].dtype) for k, v in weights.items()})
    try:
        yield method
    finally:
        model.load_state_dict(original)


def probe(method: Method, bench) -> dict:
    """What a fitted method computes on the probe batch: {"scores": the PROBE_KEPT corner of its
    (T, N) scores, a line per caption, "recall": R@1 / R@5 of the whole matrix}."""
    split = probe_split(bench)
    with torch.no_grad():
        indices, scores = method.rank(split, "t2i", split.n_images)  # (T, N) each, best first
    dense = torch.zeros(split.n_texts, split.n_images).scatter_(1, indices, scores.float())
    metrics = retrieval_metrics(dense.T, split.txt2img, ks=(1, 5))
    kept = dense[:PROBE_KEPT[0], :PROBE_KEPT[1]].tolist()
    return {"scores": [" ".join(f"{x:.6g}" for x in row) for row in kept],
            "recall": {k: round(float(metrics[k]), 2)
                       for k in ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5")}}


def probe_differences(recorded: dict | None, now: dict) -> list[str]:
    """Why `now` (a probe) is not `recorded` ([] when it is, within PROBE_TOLERANCE)."""
    if not recorded:
        return ["the manifest records no probe for it"]
    old, new = (torch.tensor([[float(x) for x in row.split()] for row in p["scores"]])
                for p in (recorded, now))
    if old.shape != new.shape:
        return [f"probe scores of shape {tuple(new.shape)}, recorded {tuple(old.shape)}"]
    problems = []
    moved = (new - old).abs().max().item()
    if moved > PROBE_TOLERANCE * max(1.0, old.abs().max().item()):
        problems.append(f"its probe scores moved by up to {moved:.3g}")
    changed = {k: (v, now["recall"].get(k)) for k, v in recorded["recall"].items()
               if now["recall"].get(k) != v}
    if changed:
        problems.append("its probe recall moved: "
                        + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
    return problems


def output_problems(folder=shipped.SHIPPED_MODELS, methods=None, bench=None,
                    tokenizer=None) -> list[str]:
    """Why shipped models of `folder` do not compute their recorded probes ([]: they all do)."""
    methods, bench, tokenizer = _or_default(methods, bench, tokenizer)
    files = shipped.read_manifest(folder)["files"]
    problems = []
    with settings.shipped_models_from(folder):
        for method in own_models(methods):
            name = method.stage(bench, tokenizer).file_name
            if name not in files:
                continue  # check_shipped names what is missing or stale
            method.fit(bench, tokenizer, cache_dir=None)
            if not method.from_shipped:
                problems.append(f"{method.name}: {name} was not loaded from {folder}")
                continue
            differences = probe_differences(files[name].get("probe"), probe(method, bench))
            problems += [f"{method.name} ({name}): {p}" for p in differences]
    return problems


def refresh(folder=shipped.SHIPPED_MODELS, checkpoints=CHECKPOINTS, methods=None, bench=None,
            tokenizer=None, progress: bool = True, only=None) -> dict:
    """Fit every model that ships (trained, or from `checkpoints`, never a shipped file) and
    rewrite `folder` with their weights and manifest. only: method names whose models alone are
    fitted; other models whose files are still current stay, the rest are listed "not_shipped"."""
    methods, bench, tokenizer = _or_default(methods, bench, tokenizer)
    models = own_models(methods)
    not_shipped, keep = [], {}
    if only is not None:
        if unknown := set(only) - {m.name for m in methods}:
            raise ValueError(f"no such methods to ship: {sorted(unknown)}; known: "
                             f"{[m.name for m in methods]}")
        chosen = own_models([m for m in methods if m.name in set(only)])
        files = {id(m): shipping_entry(m, bench, tokenizer) for m in models}  # (file name, entry)
        refreshed = {files[id(m)][0] for m in chosen}
        listed = shipped.read_manifest(folder)["files"]
        keep = {name: listed[name] for name, entry in files.values()
                if name not in refreshed and name in listed
                and not shipped.stale_reasons(entry, listed[name])
                and not shipped.file_problems(folder, name, listed[name])}
        not_shipped = sorted({m.name for m in models
                              if files[id(m)][0] not in refreshed | set(keep)})
        models = chosen
    with settings.retraining():
        for method in models:
            method.progress = progress
            if method.model is None or method.from_shipped:
                cache_dir = None if checkpoints is None else Path(checkpoints)
                method.fit(bench, tokenizer, cache_dir=cache_dir)
    written = {}
    for method in models:
        name, entry = shipping_entry(method, bench, tokenizer)
        if name not in written:  # one file per distinct model
            with as_shipped(method):
                entry = {**entry, "probe": probe(method, bench)}
            written[name] = (name, entry, method.model, method.history)
    return shipped.write_shipped(folder, list(written.values()), not_shipped=not_shipped, keep=keep)


def _same_config(method: Method, old: dict, new: dict) -> bool:
    """Whether two manifest configs describe the same model: a field the old one leaves out counts
    at its default; one only the old one has is ignored (the probe decides)."""
    # both as the manifest gives them back (a tuple reads back a list)
    new, default = json.loads(json.dumps([new, config_fields(type(method.config)())]))
    return all(old.get(k, default.get(k)) == value for k, value in new.items())


def relabel(folder=shipped.SHIPPED_MODELS, methods=None, bench=None, tokenizer=None) -> dict:
    """Rewrite the manifest of `folder` under today's names and entries without training (a change
    of the naming rule only): each shipped file is renamed, after a check that it still computes
    its probe; a changed config, data, format or probe needs `refresh`."""
    methods, bench, tokenizer = _or_default(methods, bench, tokenizer)
    folder = Path(folder)
    old = shipped.read_manifest(folder)
    by_method = {entry["method"]: (name, entry) for name, entry in old["files"].items()}
    moved, files = {}, {}
    for method in own_models(methods):
        name, entry = shipping_entry(method, bench, tokenizer)
        old_name, old_entry = by_method[method.name]
        changed = [field for field in ("data", "format") if entry[field] != old_entry[field]]
        if not _same_config(method, old_entry["config"], entry["config"]):
            changed.insert(0, "config")
        if changed:
            raise ValueError(f"{method.name}: its {', '.join(changed)} changed since {old_name} "
                             f"was trained; retrain it with {shipped.REFRESH_COMMAND}")
        model = method.build_model(bench, tokenizer)
        method.history = shipped.load_shipped(folder / old_name, model)
        method.model, method.tokenizer, method.from_shipped = model.eval(), tokenizer, True
        if moved_by := probe_differences(old_entry.get("probe"), probe(method, bench)):
            raise ValueError(f"{method.name} ({old_name}): {'; '.join(moved_by)}; retrain it with "
                             f"{shipped.REFRESH_COMMAND}")
        moved[old_name] = name
        files[name] = {**entry, **{k: old_entry[k] for k in ("probe", "sha256", "bytes")}}
    for old_name, name in moved.items():
        if old_name != name:
            (folder / old_name).rename(folder / name)
    manifest = {**old, "files": files}
    write_atomically(folder / shipped.MANIFEST, lambda temporary: temporary.write_text(
        json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8"))
    return manifest
