"""Training in worker processes gives the models a sequential run trains, in the order they need."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from course_lib import benchmark, training_lanes
from course_lib.core import settings
from course_lib.core.stages import Stage
from course_lib.methods.registry import available_methods
from course_lib.shipping import benchmark_data, own_models


@pytest.fixture(scope="module")
def smoke_data():
    return benchmark_data(smoke=True, seed=0)


def _weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_a_model_waits_for_the_models_it_is_built_from(smoke_data):
    bench, tokenizer = smoke_data
    with settings.retraining():
        models = own_models(available_methods(0, smoke=True,
                                              names=["fast-distilled", "lightningdot+rerank@20"]))
        order, needs = training_lanes.plan(models, bench, tokenizer)
    names = [m.name for m in models]
    assert sorted(order) == list(range(len(models)))  # retraining: every model trains
    distilled = names.index("fast-distilled")
    assert {names[i] for i in needs[distilled]} == {"fast", "slow"}  # its start and its teacher
    assert needs[names.index("lightningdot")] == set()
    # at most its miner, and the SCAN whose frozen towers it reads
    assert {names[i] for i in needs[names.index("cross_encoder")]} <= {"vsepp", "scan"}


def test_models_sharing_a_pixel_stem_wait_for_the_first_until_it_is_cached(smoke_data, monkeypatch,
                                                                           tmp_path):
    bench, tokenizer = smoke_data
    cost = {"hivlp-flat": 300.0, "fast": 100.0, "vsepp": 200.0}
    monkeypatch.setattr(training_lanes, "recorded_cpu_seconds", lambda m, b, t: cost[m.name])
    with settings.retraining():
        models = own_models(available_methods(0, smoke=True, names=list(cost)))
        shared = Stage("pixel_stem", {}, bench["pretrain"])
        for m in models:  # both start from one stem here, whatever their smoke sizes are
            if m.name in ("hivlp-flat", "fast"):
                monkeypatch.setattr(m, "stem_stage", lambda b: shared)
        order, needs = training_lanes.plan(models, bench, tokenizer, checkpoints=tmp_path)
        names = [m.name for m in models]
        assert [names[i] for i in order] == ["hivlp-flat", "vsepp", "fast"]
        # the stem's first trainer
        assert {names[i] for i in needs[names.index("fast")]} == {"hivlp-flat"}
        assert needs[names.index("hivlp-flat")] == set() and needs[names.index("vsepp")] == set()
        # cached: nobody writes it, nobody waits
        (tmp_path / shared.file_name).write_bytes(b"")
        _, needs = training_lanes.plan(models, bench, tokenizer, checkpoints=tmp_path)
    assert all(not n for n in needs.values())


def test_the_longest_recorded_training_starts_first(smoke_data, monkeypatch):
    bench, tokenizer = smoke_data
    cost = {"vsepp": 10.0, "scan": 300.0, "cross_encoder": 50.0}
    monkeypatch.setattr(training_lanes, "recorded_cpu_seconds", lambda m, b, t: cost[m.name])
    with settings.retraining():
        models = own_models(available_methods(0, smoke=True, names=list(cost)))
        order, needs = training_lanes.plan(models, bench, tokenizer)
    names = [m.name for m in models]
    assert [names[i] for i in order] == ["scan", "cross_encoder", "vsepp"]
    # the listwise cross-encoder waits for SCAN (its towers), not for VSE++
    # (a miner it does not use)
    assert {names[i] for i in needs[names.index("cross_encoder")]} == {"scan"}


@pytest.mark.parametrize("cost, expected", [
    # the distilled Fast (500 s) waits for Fast (20) and Slow (10): their paths are 520 and 510,
    # above VSE++'s 100, so they start first and the distilled model does not start last
    # (longest-first alone: distilled, vsepp, ...)
    ({"fast-distilled": 500.0, "vsepp": 100.0, "fast": 20.0, "slow": 10.0},
     ["fast", "slow", "fast-distilled", "vsepp"]),
    # Slow's shipped file records no learning curve. Counted as free, it and the distilled Fast that
    # waits for it started last (vsepp, fast, fast-distilled, slow); as the mean of the others (200
    # s) its path is 400, the longest
    ({"fast-distilled": 200.0, "vsepp": 300.0, "fast": 100.0, "slow": 0.0},
     ["slow", "vsepp", "fast", "fast-distilled"]),
], ids=["waited-for-first", "no-recorded-cost-is-typical"])
def test_a_model_others_wait_for_starts_before_a_longer_one(smoke_data, monkeypatch, cost,
                                                            expected):
    bench, tokenizer = smoke_data
    monkeypatch.setattr(training_lanes, "recorded_cpu_seconds", lambda m, b, t: cost[m.name])
    with settings.retraining():
        models = own_models(available_methods(0, smoke=True, names=["fast-distilled", "vsepp"]))
        order, _ = training_lanes.plan(models, bench, tokenizer)
    assert [models[i].name for i in order] == expected


def test_models_waiting_on_each_other_raise_instead_of_hanging(smoke_data, monkeypatch, tmp_path):
    def cycle(models, bench, tokenizer, checkpoints=None):
        return [0, 1], {0: {1}, 1: {0}}

    monkeypatch.setattr(training_lanes, "plan", cycle)
    with pytest.raises(RuntimeError, match="wait on each other"):
        training_lanes.train_in_parallel(["vsepp", "scan"], smoke=True, checkpoints=tmp_path,
                                         jobs=2, retrain=True, progress=False, data=smoke_data)


def test_a_model_with_a_current_shipped_file_is_not_trained(smoke_data, monkeypatch):
    bench, tokenizer = smoke_data
    models = own_models(available_methods(0, smoke=True, names=["vsepp", "scan"]))
    shipped = next(m for m in models if m.name == "scan")
    monkeypatch.setattr(type(shipped), "shipped_file",
                        lambda self, b, t: Path("x.pt") if self is shipped else None)
    order, _ = training_lanes.plan(models, bench, tokenizer)
    assert [models[i].name for i in order] == ["vsepp"]


def test_two_processes_train_what_one_thread_trains_in_this_process(tmp_path, smoke_data):
    bench, tokenizer = smoke_data
    lanes, here = tmp_path / "lanes", tmp_path / "here"
    finished = training_lanes.train_in_parallel(["vsepp", "scan"], smoke=True, checkpoints=lanes,
                                                jobs=2, retrain=True, progress=False)
    assert sorted(row["model"] for row in finished) == ["scan", "vsepp"]
    assert all(row["seconds"] > 0 and row["cpu_seconds"] > 0 for row in finished)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting on this 2-core machine (cores // jobs)
    try:
        with settings.retraining():
            for method in available_methods(0, smoke=True, names=["vsepp", "scan"]):
                method.progress = False
                method.fit(bench, tokenizer, cache_dir=here)
    finally:
        torch.set_num_threads(threads)
    files = sorted(p.name for p in lanes.glob("*.pt"))
    assert files and files == sorted(p.name for p in here.glob("*.pt"))
    if training_lanes.usable_cores() == 2:  # one thread per worker, as here: bit for bit the same
        for name in files:
            a, b = _weights(lanes / name), _weights(here / name)
            assert all(torch.equal(a[k], b[k]) for k in a), name


def test_the_benchmark_loads_what_the_processes_trained(tmp_path, monkeypatch):
    checkpoints, written = tmp_path / "ckpt", {}

    def lanes_then_note_the_files(*args, **kwargs):
        finished = training_lanes.train_in_parallel(*args, **kwargs)
        written.update({p.name: os.stat(p).st_mtime_ns for p in checkpoints.glob("*.pt")})
        return finished

    monkeypatch.setattr(benchmark, "train_in_parallel", lanes_then_note_the_files)
    results = benchmark.run(smoke=True, out=tmp_path / "out", methods=["vsepp"], progress=False,
                            checkpoints=checkpoints, jobs=2)
    assert [row["model"] for row in results["meta"]["trained_in_parallel"]] == ["vsepp"]
    assert results["meta"]["jobs"] == 2 and [name.split("-")[0] for name in written] == ["vsepp"]
    # the run's own fit loaded the file the worker wrote: a second training would have rewritten it
    assert {p.name: os.stat(p).st_mtime_ns for p in checkpoints.glob("*.pt")} == written
    rows = [r for r in results["rows"] if r["method"] == "vsepp"]
    assert rows and all(r["ar"] is not None for r in rows)


def test_a_failing_worker_stops_the_run_with_its_error(tmp_path):
    not_a_folder = tmp_path / "a_file"
    not_a_folder.write_text("")  # checkpoints cannot be written under a file
    with pytest.raises(RuntimeError, match="training scan in a worker process failed"):
        training_lanes.train_in_parallel(["scan"], smoke=True, checkpoints=not_a_folder, jobs=1 + 1,
                                         retrain=True, progress=False)


def test_jobs_below_one_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="at least 1"):
        training_lanes.train_in_parallel(["scan"], smoke=True, checkpoints=tmp_path, jobs=0)
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--jobs", "0", "--out", str(tmp_path)])
    assert "--jobs must be at least 1" in capsys.readouterr().err


def test_recorded_cost_falls_back_to_the_stale_file_of_the_same_method(tmp_path):
    """Regression: after a code change no shipped file had the method's current name, so every
    changed model cost 0 and a retrain started its longest model (HiVLP over pixels) late."""
    import json

    class Stub:
        name = "hivlp-flat"

        @staticmethod
        def stage(bench, tokenizer):
            return SimpleNamespace(file_name="hivlp-new.pt")

    history = [{"step": 1, "loss": 1.0}, {"step": 2, "eval": True, "cpu_seconds": 40.0},
               {"step": 4, "eval": True, "cpu_seconds": 90.0}]
    torch.save({"history": history}, tmp_path / "hivlp-old.pt")
    manifest = {"files": {"hivlp-old.pt": {"method": "hivlp-flat"},
                          "other.pt": {"method": "vsepp"}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert training_lanes.recorded_cpu_seconds(Stub(), None, None, folder=tmp_path) == 90.0
    Stub.name = "fast"  # nothing listed under its name: no recorded cost
    assert training_lanes.recorded_cpu_seconds(Stub(), None, None, folder=tmp_path) == 0.0
