"""Which trained models ship with the course, and their refresh: `python -m course_lib.benchmark
--refresh-shipped` (course_lib.core.shipped holds the folder's format, loading and checks).

The models that ship are those of the default benchmark (seed 0, default sizes): every method
registered in course_lib.methods that owns a model, and the models they are built from (a cascade's
stages, a distilled model's teacher, hivlp-regions' flat model), found by walking the methods
(`own_models`), so a new method ships without touching this module.
"""

from __future__ import annotations

from pathlib import Path

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.shipped import (SHIPPED_MODELS, check_shipped, file_problems, read_manifest, stale_reasons,
                                     write_shipped)
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.base import Method
from course_lib.methods.registry import available_methods

SEED = 0  # the shipped models are the default benchmark's, of seed 0


def own_models(methods) -> list[Method]:
    """Every Method reachable from `methods` (their attributes, lists of stages, a miner's method)
    that owns a model it can ship (Method.ships), each once, in the order first met."""
    found, seen = [], set()

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Method) and obj.ships:
            found.append(obj)
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            miner_method = getattr(value, "method", None) if callable(value) else None  # a cross-encoder's miner
            for item in value if isinstance(value, (list, tuple)) else (value, miner_method):
                if isinstance(item, Method):
                    visit(item)

    for method in methods:
        visit(method)
    return found


def benchmark_data(smoke: bool = False, seed: int = SEED):
    """(bench, tokenizer) of the benchmark in this mode and seed: the data every method trains on."""
    bench = make_benchmark(SyntheticConfig.smoke() if smoke else SyntheticConfig(), seed=seed)
    return bench, build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)


def default_benchmark():
    """(bench, tokenizer) of the default benchmark: the data the shipped models train on."""
    return benchmark_data(smoke=False, seed=SEED)


def expected_entries(bench=None, tokenizer=None, methods=None) -> dict:
    """{file name: manifest entry} of every model that should ship (default: the default benchmark's)."""
    if bench is None:
        bench, tokenizer = default_benchmark()
    methods = available_methods(SEED, smoke=False) if methods is None else methods
    return dict(method.shipping_entry(bench, tokenizer) for method in own_models(methods))


def stale_problems(folder=SHIPPED_MODELS) -> list[str]:
    """What is stale, missing or altered in the shipped folder ([] when it is current)."""
    return check_shipped(folder, expected_entries())


def refresh(folder=SHIPPED_MODELS, checkpoints=CHECKPOINTS, methods=None, bench=None, tokenizer=None,
            progress: bool = True, only=None) -> dict:
    """Fit every model that ships (training it, or loading a finished checkpoint of the same name
    from `checkpoints`, never a shipped file) and rewrite `folder` with their weights and manifest.
    methods / bench / tokenizer: the default benchmark's unless given (tests pass tiny ones).

    only: method names; then only their models are fitted and written. Every other model whose file
    in `folder` is still current (the same name and manifest entry, its bytes intact) stays as it is,
    and the manifest lists the rest as "not_shipped" (trained on first use), so that the staleness
    check knows they are left out on purpose rather than lost."""
    if bench is None:
        bench, tokenizer = default_benchmark()
    methods = available_methods(SEED, smoke=False) if methods is None else methods
    models = own_models(methods)
    not_shipped, keep = [], {}
    if only is not None:
        unknown = set(only) - {m.name for m in methods}
        if unknown:
            raise ValueError(f"no such methods to ship: {sorted(unknown)}; known: {[m.name for m in methods]}")
        chosen = own_models([m for m in methods if m.name in set(only)])
        files = {id(m): m.shipping_entry(bench, tokenizer) for m in models}  # (file name, entry) of each
        refreshed = {files[id(m)][0] for m in chosen}
        listed = read_manifest(folder)["files"]
        keep = {name: listed[name] for name, entry in files.values()
                if name not in refreshed and name in listed and not stale_reasons(entry, listed[name])
                and not file_problems(folder, name, listed[name])}
        not_shipped = sorted({m.name for m in models if files[id(m)][0] not in refreshed | set(keep)})
        models = chosen
    with settings.retraining():
        for method in models:
            method.progress = progress
            if method.model is None or method.from_shipped:
                method.fit(bench, tokenizer, cache_dir=None if checkpoints is None else Path(checkpoints))
    written = {}
    for method in models:
        name, entry = method.shipping_entry(bench, tokenizer)
        written.setdefault(name, (name, entry, method.model, method.history))  # one file per distinct model
    return write_shipped(folder, list(written.values()), not_shipped=not_shipped, keep=keep)


__all__ = ["own_models", "benchmark_data", "default_benchmark", "expected_entries", "stale_problems", "refresh", "SEED"]
