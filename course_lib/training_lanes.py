"""Training the benchmark's models side by side, in worker processes sharing the checkpoint
folder: a model after those it is built from, the longest critical path first. The benchmark then
fits every method as before, each fit loading the checkpoint a sequential run would have written."""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from course_lib.core import settings, shipped
from course_lib.methods.registry import available_methods, registered_names
from course_lib.shipping import benchmark_data, own_models

MAX_JOBS = 4


@dataclass(frozen=True)
class LaneSpec:
    """What a worker needs to rebuild the parent's methods exactly (picklable)."""

    seed: int
    smoke: bool
    names: tuple | None  # method names (None = every registered one)
    checkpoints: str
    retrain: bool  # COURSE_RETRAIN inside the worker (no shipped model is loaded)
    threads: int  # torch threads per worker


def usable_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def add_jobs_option(parser) -> None:
    """--jobs of the commands that train the default models."""
    parser.add_argument("--jobs", type=int, default=min(usable_cores(), MAX_JOBS),
                        help="processes that train the models that must train, side by side "
                             "(course_lib.training_lanes; default: this machine's usable "
                             f"cores, at most {MAX_JOBS}, here %(default)s); 1 = one after "
                             "another in this process")


def checked_options(parser, args) -> list[str] | None:
    """--jobs and --methods checked: the comma-separated names of --methods (None if not given)."""
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    names = None if args.methods is None else [name for name in args.methods.split(",") if name]
    if unknown := sorted(set(names or ()) - set(registered_names())):
        parser.error(f"unknown method(s) {unknown}; choose from {registered_names()}")
    return names


def _models(spec: LaneSpec, data=None):
    """(bench, tokenizer, own models) for spec, in the same order in every process."""
    bench, tokenizer = data or benchmark_data(spec.smoke, spec.seed)
    return bench, tokenizer, own_models(available_methods(spec.seed, spec.smoke, names=spec.names))


def recorded_cpu_seconds(method, bench, tokenizer, folder=None) -> float:
    """The training CPU-seconds this method's shipped model recorded (0 if none; a stale file of
    the same method stands in): a rough cost, to start the longest trainings first."""
    folder = Path(folder or shipped.SHIPPED_MODELS)
    try:
        name = method.stage(bench, tokenizer).file_name
        if not (folder / name).exists():
            listed = [n for n, e in shipped.read_manifest(folder)["files"].items()
                      if e.get("method") == method.name]
            name = listed[0] if listed else name
        history = torch.load(folder / name, map_location="cpu", weights_only=False)["history"]
    except (OSError, KeyError, RuntimeError):
        return 0.0

    def total(h) -> float:
        if isinstance(h, dict):
            return sum(total(v) for v in h.values())
        rows = h if isinstance(h, list) else []
        seconds = [r["cpu_seconds"] for r in rows if isinstance(r, dict) and "cpu_seconds" in r]
        return max(seconds, default=0.0)

    return float(total(history))


def plan(models, bench, tokenizer, checkpoints=None) -> tuple[list[int], dict[int, set[int]]]:
    """(the indices of `models` to train, longest path first; {index: indices it needs first}).
    A pixel stem several start from is trained by the first of them; the others wait for it."""
    position = {id(m): i for i, m in enumerate(models)}
    to_train = [i for i, m in enumerate(models) if m.shipped_file(bench, tokenizer) is None]
    needs = {i: {position[id(d)] for d in own_models([models[i]]) if d is not models[i]}
             & set(to_train) for i in to_train}
    cost = {i: recorded_cpu_seconds(models[i], bench, tokenizer) for i in to_train}
    # a model recording no learning curve costs what a typical one does, not 0 (or it starts last)
    known = [c for c in cost.values() if c > 0]
    cost = {i: c if c > 0 else (sum(known) / len(known) if known else 0.0) for i, c in cost.items()}
    first_with_stem = {}
    for i in sorted(to_train, key=lambda i: (-cost[i], i)):  # the longest of them trains the stem
        stem = getattr(models[i], "stem_stage", lambda bench: None)(bench)
        stem = stem and stem.file_name
        if stem is None or (checkpoints is not None and (Path(checkpoints) / stem).exists()):
            continue
        if (first := first_with_stem.setdefault(stem, i)) != i:
            needs[i].add(first)
    path = {}  # a model's cost plus the longest chain of models waiting for it (its critical path)

    def path_from(i: int) -> float:
        if i not in path:
            path[i] = cost[i] + max((path_from(j) for j in to_train if i in needs[j]), default=0.0)
        return path[i]

    return sorted(to_train, key=lambda i: (-path_from(i), -cost[i], i)), needs


def _exit_with_parent(poll_seconds: float = 5.0) -> None:
    """Stop this worker when its parent is gone (an orphan daemon would keep training)."""
    parent = multiprocessing.parent_process()

    def watch():
        while parent is not None and parent.is_alive():
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(spec: LaneSpec, tasks, results) -> None:
    """A worker: fit each model index it is handed, report (index, wall s, CPU s, error or None)."""
    _exit_with_parent()
    torch.set_num_threads(spec.threads)
    with settings.retraining(spec.retrain):
        try:
            bench, tokenizer, models = _models(spec)
        except BaseException:  # e.g. a method registered only in the parent's session
            results.put((None, 0.0, 0.0, traceback.format_exc()))
            return
        while (index := tasks.get()) is not None:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                models[index].progress = False
                models[index].fit(bench, tokenizer, cache_dir=Path(spec.checkpoints))
                error = None
            except BaseException:  # reported to the parent, which stops the run with it
                error = traceback.format_exc()
            results.put((index, time.perf_counter() - wall, time.process_time() - cpu, error))


def _next_result(results, workers, poll_seconds: float = 5.0):
    """The next (index, wall, cpu, error) a worker reports; RuntimeError if one died silently."""
    while True:
        try:
            return results.get(timeout=poll_seconds)
        except queue.Empty:
            if dead := [w for w in workers if not w.is_alive()]:
                raise RuntimeError(f"a training process stopped without a report (exit code "
                                   f"{dead[0].exitcode}; out of memory?). Fewer processes "
                                   "(--jobs 1) need less memory.") from None


def train_in_parallel(names=None, *, seed: int = 0, smoke: bool = False, checkpoints, jobs: int = 2,
                      retrain: bool = False, progress: bool = True, data=None) -> list[dict]:
    """Train every model the methods `names` (None = all) would train, in `jobs` processes, into
    `checkpoints`: one row per model, as finished ({"model", "seconds", "cpu_seconds"}). A failed
    training stops the others and raises RuntimeError. data: the parent's (bench, tokenizer)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    spec = LaneSpec(seed, smoke, None if names is None else tuple(names), str(checkpoints), retrain,
                    max(1, usable_cores() // jobs))
    with settings.retraining(retrain):
        bench, tokenizer, models = _models(spec, data)
        order, needs = plan(models, bench, tokenizer, checkpoints)
    if not order:
        return []
    context = multiprocessing.get_context("spawn")
    tasks, results = context.Queue(), context.Queue()
    workers = [context.Process(target=_worker, args=(spec, tasks, results), daemon=True)
               for _ in range(min(jobs, len(order)))]
    for worker in workers:
        worker.start()
    done, running, finished = set(), [], []
    bar = tqdm(total=len(order), desc=f"training in {len(workers)} processes", disable=not progress)
    try:
        while len(done) < len(order):
            ready = [i for i in order if i not in done and i not in running and needs[i] <= done]
            for index in ready[:len(workers) - len(running)]:
                running.append(index)
                tasks.put(index)
            if not running:  # nothing to wait for, yet models left: they wait on each other
                stuck = [models[i].name for i in order if i not in done]
                raise RuntimeError(f"these models wait on each other and none can start: {stuck}")
            bar.set_postfix(training=", ".join(models[i].name for i in running))
            index, wall, cpu, error = _next_result(results, workers)
            if error is not None:
                what = "setting up" if index is None else f"training {models[index].name}"
                raise RuntimeError(f"{what} in a worker process failed (--jobs 1 trains in this "
                                   f"process instead):\n{error}")
            running.remove(index)
            done.add(index)
            finished.append({"model": models[index].name, "seconds": round(wall, 1),
                             "cpu_seconds": round(cpu, 1)})
            bar.update()
    finally:
        bar.close()
        for _ in workers:
            tasks.put(None)
        for worker in workers:
            worker.join(timeout=5 if len(done) == len(order) else 0.1)
            if worker.is_alive():
                worker.terminate()
    return finished
