"""The shipped models (shipped_models/, course_lib.core.shipped): current with their config, data
and format; computing what they computed when shipped (their probe outputs and recall); loaded
instead of trained; never loaded in smoke mode nor with --retrain / COURSE_RETRAIN.

Everything but the first three tests works on tiny models the tests train themselves in a temporary
folder. Retraining from scratch reproduces the shipped recalls within 0.3 points: a slow check, by
hand (`python -m course_lib.benchmark --retrain`, docs/shipped_models.md), not one of these."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest
import torch

from course_lib import benchmark, refresh_shipped, shipping
from course_lib.core import shipped
from course_lib.core.checkpoints import load_model_weights
from course_lib.core.settings import CourseNote, retrain_mode, retraining
from course_lib.core.shipped import (
    MANIFEST,
    REFRESH_COMMAND,
    SHIPPED_MODELS,
    check_shipped,
    read_manifest,
)
from course_lib.core.stages import Stage
from course_lib.core.train import Trainer
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.base import Method, Ranker
from course_lib.methods.lightningdot.method import LightningDOTMethod
from course_lib.methods.lightningdot.model import LightningDOTConfig
from course_lib.methods.registry import available_methods
from course_lib.methods.scan.method import SCANMethod
from course_lib.methods.scan.model import SCANConfig
from course_lib.methods.ubert.method import UBERTMethod
from course_lib.methods.ubert.model import UBERTConfig
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(n_train=30, n_val=10, n_test=10, n_pretrain=20, n_compositional=2)
TINY = {  # a few steps each: what is tested is where the weights come from, not how good they are
    "vsepp": lambda: VsePPMethod(VsePPConfig.smoke(max_steps=3, batch_size=16), progress=False),
    "lightningdot": lambda: LightningDOTMethod(
        LightningDOTConfig.smoke(pretrain_steps=2, finetune_steps=2, batch_size=16),
        progress=False),
    "ubert-embed": lambda: UBERTMethod(
        UBERTConfig.smoke(max_steps=2, cross_steps=2, sum_warmup_steps=0, batch_size=16,
                          cross_batch_size=8),
        progress=False, scan=SCANMethod(SCANConfig.smoke(max_steps=2), progress=False)),
}


def assert_current(folder, expected: dict) -> None:
    """The staleness check (every test here): fails naming what is stale and the refresh command."""
    problems = check_shipped(folder, expected)
    assert not problems, ("the shipped models no longer match their config, data or format:\n  "
                          + "\n  ".join(problems)
                          + f"\nRefresh them (about two hours on a laptop CPU) with: "
                          f"{REFRESH_COMMAND}")


def assert_computing_as_shipped(problems: list[str]) -> None:
    """Behaviour check: fails naming what a shipped model computes otherwise, and the refresh."""
    assert not problems, ("the shipped models no longer compute what they did when shipped:\n  "
                          + "\n  ".join(problems)
                          + "\nIf the change is meant, refresh them (about two hours on a "
                          f"laptop CPU) with: {REFRESH_COMMAND}")


def test_shipped_models_are_current():
    """shipped_models/ holds every default model, each matching today's config, data and format."""
    assert_current(SHIPPED_MODELS, shipping.expected_entries())


@pytest.fixture(scope="module")
def default_benchmark():
    return shipping.default_benchmark()


def test_shipped_models_compute_what_they_did(default_benchmark):
    """Every shipped file loads (nothing trains), scoring the probe batch and recall as recorded."""
    bench, tokenizer = default_benchmark
    assert_computing_as_shipped(shipping.output_problems(bench=bench, tokenizer=tokenizer))


def test_a_model_that_computes_otherwise_fails_the_check(default_benchmark, monkeypatch):
    """Every nn.Linear nudged (y + 0.05 tanh y): each shipped model's probe moves, and the check
    says so, naming the refresh command."""
    bench, tokenizer = default_benchmark
    linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward",
                        lambda self, x: (lambda y: y + 0.05 * torch.tanh(y))(linear(self, x)))
    problems = shipping.output_problems(bench=bench, tokenizer=tokenizer)
    with pytest.raises(AssertionError, match=f"refresh them .* with: {REFRESH_COMMAND}"):
        assert_computing_as_shipped(problems)
    moved = {p.split(" ")[0] for p in problems if "probe scores moved" in p}
    assert moved == {m.name for m in shipping.own_models(available_methods(0, smoke=False))}


# ------------------------------------------------------------------------------ tiny shipped models

@pytest.fixture(scope="module")
def data():
    bench = make_benchmark(SyntheticConfig.smoke(**SIZES), seed=0)
    return bench, build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)


@pytest.fixture(scope="module")
def shipped_tiny(data, tmp_path_factory):
    """A shipped folder of the TINY models, written by the refresh command's own function."""
    bench, tokenizer = data
    root = tmp_path_factory.mktemp("ship")
    methods = [make() for make in TINY.values()]
    manifest = shipping.refresh(root / "shipped", checkpoints=root / "cache", methods=methods,
                                bench=bench, tokenizer=tokenizer, progress=False)
    # U-BERT's SCAN ships too
    return root, {m.name: m for m in shipping.own_models(methods)}, manifest


@pytest.fixture
def course_env(monkeypatch, shipped_tiny):
    """Default mode (no smoke, no retrain) with the tiny shipped folder as the course's."""
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    monkeypatch.delenv("COURSE_RETRAIN", raising=False)
    monkeypatch.setenv("COURSE_SHIPPED_MODELS", str(shipped_tiny[0] / "shipped"))
    return shipped_tiny[0] / "shipped"


def refusing_to_train(monkeypatch, method):
    def train(*args):
        raise AssertionError(f"{method.name} trained although a shipped model matches")
    monkeypatch.setattr(method, "train", train)
    return method


def recording_training(monkeypatch, method):
    calls = []
    real = method.train
    monkeypatch.setattr(method, "train", lambda *args: calls.append(args) or real(*args))
    return calls


def test_manifest_round_trip(shipped_tiny, data):
    root, trained, manifest = shipped_tiny
    bench, tokenizer = data
    folder = root / "shipped"
    assert read_manifest(folder) == manifest and manifest["refresh"] == REFRESH_COMMAND
    assert sorted(p.name for p in folder.glob("*.pt")) == sorted(manifest["files"])
    for name, entry in manifest["files"].items():
        method = trained[entry["method"]]
        assert name == method.stage(bench, tokenizer).file_name
        assert entry["config"] == json.loads(json.dumps(dataclasses.asdict(method.config)))
        assert (entry["version"] == method.format_version
                and entry["prefix"] == method.checkpoint_prefix)
        assert set(entry["probe"]) == {"scores", "recall"}
        assert (entry["sha256"] == shipped.file_sha256(folder / name)
                and entry["bytes"] == (folder / name).stat().st_size)
        saved = torch.load(folder / name, weights_only=True)
        # weights only: no optimizer, no RNG states
        assert set(saved) == {"format", "model", "history"}
        assert (folder / name).stat().st_size < (root / "cache" / name).stat().st_size
    assert_current(folder,
                   shipping.expected_entries(bench, tokenizer, [make() for make in TINY.values()]))
    # load_model_weights reads a shipped file as it reads a Trainer checkpoint
    vsepp = trained["vsepp"]
    for path, want in ((folder / vsepp.checkpoint_path.name, rounded(vsepp.model.state_dict())),
                       (root / "cache" / vsepp.checkpoint_path.name, vsepp.model.state_dict())):
        model = load_model_weights(vsepp.build_model(bench, tokenizer), str(path))
        torch.testing.assert_close(model.state_dict(), want, rtol=0, atol=0)


def rounded(state: dict) -> dict:
    """A state dict as a shipped file gives it back: floating weights rounded to float16 (and
    computed in the model's float32 again); the rest exactly."""
    return {k: v.half().to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def test_shipped_weights_are_float16_within_its_range():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = 1e6  # beyond float16's 65504: this tensor stays float32
    model.register_buffer("steps", torch.tensor(7))
    state = shipped.shipped_weights(model)
    assert state["bias"].dtype == torch.float16 and state["steps"].dtype == torch.int64
    assert (state["weight"].dtype == torch.float32
            and torch.equal(state["weight"], model.weight.detach()))
    assert torch.equal(state["bias"].float(), model.bias.detach().half().float())


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_shipped_model_is_loaded_not_trained(name, course_env, shipped_tiny, data,
                                               monkeypatch, tmp_path):
    bench, tokenizer = data
    trained = shipped_tiny[1][name]
    method = refusing_to_train(monkeypatch, TINY[name]())
    method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert (method.from_shipped
            and method.checkpoint_path == course_env / trained.checkpoint_path.name)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing cached, no earlier stage either
    for key, value in rounded(trained.model.state_dict()).items():
        torch.testing.assert_close(method.model.state_dict()[key], value, rtol=0, atol=0)
    assert json.dumps(method.history, default=str) == json.dumps(trained.history, default=str)
    test = bench["test"]  # the loaded model ranks as the trained one with its weights rounded
    original = {k: v.clone() for k, v in trained.model.state_dict().items()}
    trained.model.load_state_dict(rounded(original))
    try:
        assert torch.equal(method.rank(test, "t2i", 5)[0], trained.rank(test, "t2i", 5)[0])
    finally:
        trained.model.load_state_dict(original)


def test_retrain_trains_even_with_a_matching_shipped_model(course_env, data, monkeypatch, tmp_path):
    bench, tokenizer = data
    method = TINY["vsepp"]()
    calls = recording_training(monkeypatch, method)
    with retraining():
        method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert calls and not method.from_shipped and method.checkpoint_path.parent == tmp_path
    monkeypatch.setenv("COURSE_RETRAIN", "1")  # the notebooks' switch
    again = TINY["vsepp"]()
    calls = recording_training(monkeypatch, again)
    again.fit(bench, tokenizer, cache_dir=tmp_path / "other")
    assert calls and not again.from_shipped


def test_without_shipped_models_trains_even_with_a_matching_one_and_says_nothing(
        course_env, data, monkeypatch, tmp_path, recwarn):
    from course_lib.core.shipped import shipped_folder, without_shipped_models

    bench, tokenizer = data
    method = TINY["vsepp"]()
    calls = recording_training(monkeypatch, method)
    with without_shipped_models():  # real photographs: the synthetic models are never looked at
        assert shipped_folder() is None
        method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert (calls and not method.from_shipped
            and not [w for w in recwarn if "shipped" in str(w.message)])
    assert shipped_folder() == course_env  # restored after the block


def test_smoke_mode_always_trains(course_env, data, monkeypatch, tmp_path):
    bench, tokenizer = data
    monkeypatch.setenv("COURSE_SMOKE", "1")
    method = TINY["vsepp"]()
    calls = recording_training(monkeypatch, method)
    method.fit(bench, tokenizer, cache_dir=tmp_path)
    assert calls and not method.from_shipped


def test_the_benchmark_loads_shipped_models_unless_told_to_retrain(course_env, data, monkeypatch,
                                                                   tmp_path):
    bench, _ = data
    # the tiny data, default mode
    monkeypatch.setattr(benchmark, "benchmark_data", lambda smoke, seed: data)
    for retrain in (False, True):
        method = TINY["vsepp"]()
        calls = recording_training(monkeypatch, method)
        results = benchmark.run(out=tmp_path / f"retrain-{retrain}", methods=[method],
                                progress=False, checkpoints=tmp_path / "cache", retrain=retrain)
        assert bool(calls) is retrain and method.from_shipped is not retrain
        assert results["meta"]["shipped_models"] == ([] if retrain else ["vsepp"])
    assert not retrain_mode()  # restored after the run


def test_the_retrain_flag_reaches_the_run(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(benchmark, "run", lambda **kwargs: seen.update(kwargs) or {"rows": []})
    monkeypatch.setattr(benchmark, "results_markdown", lambda results: "")
    benchmark.main(["--methods", "", "--out", str(tmp_path), "--replace"])
    assert seen["retrain"] is False
    benchmark.main(["--retrain", "--methods", "", "--out", str(tmp_path), "--replace"])
    assert seen["retrain"] is True


def test_refresh_refuses_smoke_and_other_seeds(monkeypatch, capsys):
    monkeypatch.setattr(refresh_shipped, "refresh", lambda *a, **k: pytest.fail("refreshed"))
    for argv in (["--smoke"], ["--seed", "1"]):  # the shipped models are the default ones of seed 0
        with pytest.raises(SystemExit):
            refresh_shipped.main(argv)
        assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err
    monkeypatch.setenv("COURSE_SMOKE", "1")
    with pytest.raises(SystemExit):
        refresh_shipped.main([])
    assert "the default models of seed 0: unset COURSE_SMOKE" in capsys.readouterr().err
    monkeypatch.delenv("COURSE_SMOKE")
    with pytest.raises(SystemExit):
        refresh_shipped.main(["--methods", "vsepp,nonsense", "--jobs", "1"])
    assert "unknown method(s) ['nonsense']" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["config", "version", "data", "file bytes", "file deleted",
                                    "unlisted file", "model removed"])
def test_the_staleness_check_fails_on_a_planted_change(change, shipped_tiny, data, tmp_path,
                                                       monkeypatch):
    bench, tokenizer = data
    folder = shutil.copytree(shipped_tiny[0] / "shipped", tmp_path / "shipped")
    methods = [make() for make in TINY.values()]
    manifest = read_manifest(folder)
    vsepp_file = next(name for name, entry in manifest["files"].items()
                      if entry["method"] == "vsepp")
    if change == "config":
        manifest["files"][vsepp_file]["config"]["max_steps"] += 1
    elif change == "version":
        monkeypatch.setattr(VsePPMethod, "format_version", VsePPMethod.format_version + 1)
    elif change == "data":
        bench = make_benchmark(SyntheticConfig.smoke(**SIZES), seed=1)
    elif change == "file bytes":
        with open(folder / vsepp_file, "ab") as f:
            f.write(b"\0")
    elif change == "file deleted":
        (folder / vsepp_file).unlink()
    elif change == "unlisted file":
        shutil.copy(folder / vsepp_file, folder / "vsepp-0000000000.pt")
    elif change == "model removed":
        del manifest["files"][vsepp_file]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    expected = shipping.expected_entries(bench, tokenizer, methods)
    with pytest.raises(AssertionError, match=f"Refresh them .* with: {REFRESH_COMMAND}"):
        assert_current(folder, expected)
    if change == "config":
        assert any("config differs in max_steps" in p for p in check_shipped(folder, expected))


def test_a_stale_shipped_model_is_trained_with_a_note_saying_why(course_env, data, monkeypatch,
                                                                 tmp_path):
    bench, tokenizer = data
    # one step more
    method = VsePPMethod(VsePPConfig.smoke(max_steps=4, batch_size=16), progress=False)
    calls = recording_training(monkeypatch, method)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        method.fit(bench, tokenizer, cache_dir=tmp_path)
    notes = [str(w.message) for w in caught if issubclass(w.category, CourseNote)]
    assert calls and not method.from_shipped
    assert len(notes) == 1 and "config differs in max_steps (shipped 3, now 4)" in notes[0]
    assert REFRESH_COMMAND in notes[0]


def test_an_altered_shipped_file_is_not_loaded(course_env, data, monkeypatch, tmp_path):
    bench, tokenizer = data
    folder = shutil.copytree(course_env, tmp_path / "shipped")
    monkeypatch.setenv("COURSE_SHIPPED_MODELS", str(folder))
    name = TINY["vsepp"]().stage(bench, tokenizer).file_name
    # truncated, as a failed download
    (folder / name).write_bytes((folder / name).read_bytes()[:-10])
    assert_vsepp_trains_with_note(data, monkeypatch, tmp_path, "does not match the sha256")


def test_without_shipped_models_every_model_trains_with_a_note(data, monkeypatch, tmp_path):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    monkeypatch.setenv("COURSE_SHIPPED_MODELS", str(tmp_path / "deleted"))
    assert_vsepp_trains_with_note(data, monkeypatch, tmp_path, "no shipped models in")


def assert_vsepp_trains_with_note(data, monkeypatch, tmp_path, note: str) -> None:
    """The tiny VSE++ trains (no shipped file loads) and a CourseNote matching `note` says why."""
    bench, tokenizer = data
    method = TINY["vsepp"]()
    calls = recording_training(monkeypatch, method)
    with pytest.warns(CourseNote, match=note):
        method.fit(bench, tokenizer, cache_dir=tmp_path / "cache")
    assert calls and not method.from_shipped


def test_refresh_command_writes_the_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    seen = {}
    manifest = {"files": {"vsepp-x.pt": {"bytes": 2_000_000}, "scan-y.pt": {"bytes": 500_000}},
                "not_shipped": []}
    monkeypatch.setattr(refresh_shipped, "refresh", lambda folder, checkpoints, only: seen.update(
        folder=folder, checkpoints=checkpoints, only=only) or manifest)
    # the models are trained side by side first (course_lib.training_lanes), then refresh loads them
    lanes = []
    monkeypatch.setattr(refresh_shipped, "train_in_parallel",
                        lambda names, **kwargs: lanes.append((names, kwargs)))
    refresh_shipped.main(["--checkpoints", str(tmp_path), "--jobs", "2"])
    assert seen == {"folder": SHIPPED_MODELS, "checkpoints": str(tmp_path), "only": None}
    assert lanes == [(None, dict(seed=0, checkpoints=str(tmp_path), jobs=2, retrain=True))]
    refresh_shipped.main(["--checkpoints", str(tmp_path), "--jobs", "1"])
    assert len(lanes) == 1  # one process: refresh trains them itself
    assert "wrote 2 models (2.5 MB)" in capsys.readouterr().out
    manifest["not_shipped"] = ["scan"]
    refresh_shipped.main(["--checkpoints", str(tmp_path), "--methods", "vsepp,cross_encoder",
                          "--jobs", "1"])
    assert seen["only"] == ["vsepp", "cross_encoder"]
    assert "not shipped (trained on first use): scan" in capsys.readouterr().out


def test_a_config_with_a_tuple_is_current_after_the_manifest_round_trip(data):
    """JSON writes a tuple as a list: a field like HiVLP's eol_widths must not read as changed."""
    bench, tokenizer = data
    stage = Stage("hivlp", {"eol_widths": (32, 64, 128)}, bench["train"], tokenizer)
    expected = shipped.manifest_entry("hivlp-flat", stage)
    written = json.loads(json.dumps(expected))
    assert written["config"]["eol_widths"] == [32, 64, 128]
    assert shipped.stale_reasons(expected, written) == []
    written["config"]["eol_widths"] = [16, 32, 64]
    assert "config differs in eol_widths" in shipped.stale_reasons(expected, written)[0]


def test_a_partial_refresh_ships_some_models_and_declares_the_rest(shipped_tiny, data, tmp_path):
    """refresh(only=...) ships the chosen models; the others are listed as not shipped, which the
    staleness check accepts, while a model that is neither shipped nor declared still fails it."""
    bench, tokenizer = data
    _, trained, _ = shipped_tiny
    methods = list(trained.values())
    folder = tmp_path / "partial"
    manifest = shipping.refresh(folder, checkpoints=None, methods=methods, bench=bench,
                                tokenizer=tokenizer, progress=False, only=["vsepp"])
    assert [e["method"] for e in manifest["files"].values()] == ["vsepp"]
    assert manifest["not_shipped"] == sorted(m.name for m in methods if m.name != "vsepp")
    expected = shipping.expected_entries(bench, tokenizer, methods)
    assert check_shipped(folder, expected) == []
    undeclared = read_manifest(folder)
    undeclared["not_shipped"] = undeclared["not_shipped"][1:]
    (folder / MANIFEST).write_text(json.dumps(undeclared))
    problems = check_shipped(folder, expected)
    assert len(problems) == 1 and "nothing is shipped for it" in problems[0]
    with pytest.raises(ValueError, match="no such methods to ship"):
        shipping.refresh(folder, methods=methods, bench=bench, tokenizer=tokenizer, only=["nope"])


def test_a_partial_refresh_keeps_the_other_current_models(shipped_tiny, data, tmp_path):
    """refresh(only=["vsepp"]) over a full folder rewrites vsepp's file and keeps every other model
    that is still current, byte for byte (it used to drop them all and declare them not shipped)."""
    import shutil

    bench, tokenizer = data
    root, trained, full = shipped_tiny
    folder = tmp_path / "full"
    shutil.copytree(root / "shipped", folder)
    (folder / "not-listed.pt").write_bytes(b"stray")  # a file outside the manifest goes, as before
    before = {p.name: p.read_bytes() for p in folder.glob("*.pt") if p.name != "not-listed.pt"}
    manifest = shipping.refresh(folder, checkpoints=None, methods=list(trained.values()),
                                bench=bench, tokenizer=tokenizer, progress=False, only=["vsepp"])
    assert manifest["files"] == full["files"] and manifest["not_shipped"] == []
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt")} == before
    assert check_shipped(folder,
                         shipping.expected_entries(bench, tokenizer, list(trained.values()))) == []
    # a model whose shipped file no longer matches is not kept: it is
    # declared, and trained on first use
    stale = read_manifest(folder)
    other = next(name for name, e in stale["files"].items() if e["method"] != "vsepp")
    stale["files"][other]["version"] = 0
    (folder / MANIFEST).write_text(json.dumps(stale))
    manifest = shipping.refresh(folder, checkpoints=None, methods=list(trained.values()),
                                bench=bench, tokenizer=tokenizer, progress=False, only=["vsepp"])
    assert other not in manifest["files"] and not (folder / other).exists()
    assert full["files"][other]["method"] in manifest["not_shipped"]


def test_the_shipped_folder_stays_small(shipped_tiny, tmp_path, monkeypatch):
    root, trained, _ = shipped_tiny
    monkeypatch.setattr(shipped, "MAX_BYTES", 1000)
    model = trained["vsepp"]
    with pytest.raises(ValueError, match="more than 0 MB"):
        shipped.write_shipped(tmp_path / "big",
                              [("vsepp-x.pt", {"method": "vsepp"}, model.model, model.history)])
    assert not (tmp_path / "big").exists()  # refused before writing anything


def test_every_model_the_benchmark_uses_ships_and_nothing_else():
    methods = available_methods(0, smoke=True)
    names = [m.name for m in shipping.own_models(methods)]
    assert names == ["vsepp", "scan", "cross_encoder", "lightningdot", "ubert-embed", "hivlp-flat",
                     "hivlp-regions-flat", "slow", "fast", "fast-distilled"]


def test_a_method_without_a_model_of_its_own_does_not_ship():
    """A cascade's stages ship; the cascade is a Ranker, not a Method: it has no model to train."""
    [cascade] = available_methods(0, smoke=True, names=["lightningdot+rerank@20"])
    assert isinstance(cascade, Ranker) and not isinstance(cascade, Method)
    assert not hasattr(cascade, "build_model") and not hasattr(cascade, "train")
    assert ([m.name for m in shipping.own_models([cascade])]
            == ["lightningdot", "cross_encoder", "scan"])


def test_probe_differences_read_float_rounding_as_the_same_and_any_change_as_a_change():
    recorded = {"scores": ["1 -2.5", "0.25 3"], "recall": {"t2i_r1": 50.0}}
    assert shipping.probe_differences(recorded, {"scores": ["1.00000001 -2.5", "0.25 3"],
                                                 "recall": {"t2i_r1": 50.0}}) == []
    moved = shipping.probe_differences(recorded, {"scores": ["1.01 -2.5", "0.25 3"],
                                                  "recall": {"t2i_r1": 50.0}})
    assert len(moved) == 1 and "moved by up to 0.01" in moved[0]
    recall = shipping.probe_differences(recorded, {"scores": ["1 -2.5", "0.25 3"],
                                                   "recall": {"t2i_r1": 25.0}})
    assert recall == ["its probe recall moved: t2i_r1 50.0 -> 25.0"]
    assert shipping.probe_differences(None, recorded) == ["the manifest records no probe for it"]


def test_the_probe_is_what_the_shipped_file_computes(shipped_tiny, data, course_env,
                                                     monkeypatch, tmp_path):
    """refresh records each probe from the weights as shipped (float16), so the loaded model matches
    it; and a probe is the method's own scores: the kept corner equals its score matrix on the
    probe batch."""
    bench, tokenizer = data
    assert shipping.output_problems(course_env, methods=[make() for make in TINY.values()],
                                    bench=bench, tokenizer=tokenizer) == []
    untrained = refusing_to_train(monkeypatch, TINY["vsepp"]())
    vsepp = untrained.fit(bench, tokenizer, cache_dir=tmp_path)
    split = shipping.probe_split(bench)
    scores = vsepp.similarity(split).T  # (T, N)
    recorded = read_manifest(course_env)["files"][vsepp.checkpoint_path.name]["probe"]
    kept = torch.tensor([[float(x) for x in row.split()] for row in recorded["scores"]])
    torch.testing.assert_close(kept, scores[:kept.shape[0], :kept.shape[1]], rtol=1e-5, atol=1e-5)


def test_relabel_renames_without_retraining(shipped_tiny, data, tmp_path, monkeypatch):
    """A change of the naming rule: relabel moves each file to today's name byte for byte and
    keeps its probe, training nothing; a model whose config changed, or whose file no longer
    computes its probe, is refused."""
    bench, tokenizer = data
    folder = shutil.copytree(shipped_tiny[0] / "shipped", tmp_path / "shipped")
    manifest = read_manifest(folder)
    before = {entry["method"]: (folder / name).read_bytes()
              for name, entry in manifest["files"].items()}
    # as an older rule named them, one that left a field out at its default, from an older config
    renamed = {f"old-{name}": json.loads(json.dumps(entry))
               for name, entry in manifest["files"].items()}
    old_vsepp = next(e for e in renamed.values() if e["method"] == "vsepp")
    assert old_vsepp["config"].pop("seed") == VsePPConfig().seed
    old_vsepp["config"]["a_retired_switch"] = "off"  # a field the config no longer has
    for name in manifest["files"]:
        (folder / name).rename(folder / f"old-{name}")
    (folder / MANIFEST).write_text(json.dumps({**manifest, "files": renamed}))
    methods = [refusing_to_train(monkeypatch, make()) for make in TINY.values()]
    relabelled = shipping.relabel(folder, methods=methods, bench=bench, tokenizer=tokenizer)
    assert relabelled["files"] == manifest["files"]
    assert {e["method"]: (folder / name).read_bytes()
            for name, e in relabelled["files"].items()} == before
    assert not list(folder.glob("old-*"))
    changed = [make() for make in TINY.values()]
    changed[0].config = VsePPConfig.smoke(max_steps=4, batch_size=16)
    with pytest.raises(ValueError, match="vsepp: its config changed .* retrain it"):
        shipping.relabel(folder, methods=changed, bench=bench, tokenizer=tokenizer)
    # a probe the file no longer computes (the code changed what it computes): refused
    tampered = read_manifest(folder)
    entry = next(e for e in tampered["files"].values() if e["method"] == "vsepp")
    first, *rest = entry["probe"]["scores"][0].split()
    entry["probe"]["scores"][0] = " ".join([f"{float(first) + 1:.6g}", *rest])
    (folder / MANIFEST).write_text(json.dumps(tampered))
    fresh = [make() for make in TINY.values()]
    with pytest.raises(ValueError, match="vsepp .*probe scores moved.* retrain it"):
        shipping.relabel(folder, methods=fresh, bench=bench, tokenizer=tokenizer)


def test_the_refresh_command_relabels_the_shipped_models(tmp_path, monkeypatch, capsys):
    """`refresh_shipped --relabel` on a copy of the real shipped folder with one file under an old
    name: it comes back under its name, byte for byte, with nothing trained."""
    folder = shutil.copytree(SHIPPED_MODELS, tmp_path / "shipped")
    manifest = read_manifest(folder)
    name = next(n for n, e in manifest["files"].items() if e["method"] == "vsepp")
    (folder / name).rename(folder / "vsepp-old.pt")
    files = {("vsepp-old.pt" if n == name else n): e for n, e in manifest["files"].items()}
    (folder / MANIFEST).write_text(json.dumps({**manifest, "files": files}))
    monkeypatch.setattr(refresh_shipped, "SHIPPED_MODELS", folder)
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    monkeypatch.setattr(Trainer, "fit", lambda *a: pytest.fail("relabel trained a model"))
    refresh_shipped.main(["--relabel"])
    assert read_manifest(folder) == manifest
    assert (folder / name).read_bytes() == (SHIPPED_MODELS / name).read_bytes()
    assert f"relabelled {len(files)} models" in capsys.readouterr().out
