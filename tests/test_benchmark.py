"""The headless benchmark job writes its fixed results.json schema; its baseline scores right."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from course_lib import benchmark, evaluation
from course_lib import results as results_io
from course_lib.core.metrics import retrieval_metrics
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.base import Method
from course_lib.methods.baselines import RandomProjectionBaseline
from course_lib.methods.registry import register_method, registered_names, unregister_method
from course_lib.methods.rerank import TwoStageMethod
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

ROW_KEYS = {"method", "setting", "n_images", "n_texts", "n_text_queries", "n_image_queries", "ar",
            "ms_p25", "ms_p75", "ms_per_query", "ms_measured", "notes"}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    methods = [RandomProjectionBaseline(), VsePPMethod(VsePPConfig.smoke(), progress=False)]
    results = benchmark.run(smoke=True, out=out, methods=methods, progress=False,
                            checkpoints=out / "checkpoints")
    return out, results


def test_outputs_and_schema(smoke_results):
    out, results = smoke_results
    for name in ("results.json", "results.md", "pareto.png"):
        assert (out / name).stat().st_size > 0
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == results
    assert {"device", "torch", "mode", "seconds", "seed"} <= set(on_disk["meta"])
    assert on_disk["meta"]["mode"] == "smoke"
    assert set(on_disk["methods"]) == {*results_io.REFERENCES, "random_projection", "vsepp"}
    seen = {(r["method"], r["setting"]) for r in on_disk["rows"]}
    assert seen == {(m, s) for m in on_disk["methods"] for s in ("test", "full", "compositional")}
    for row in on_disk["rows"]:
        ks = (5, 10, 20) if row["setting"] == "full" else (1, 5, 10)
        recall_keys = {f"{d}_r{k}" for d in ("i2t", "t2i") for k in ks}
        assert set(row) == ROW_KEYS | recall_keys
        assert row["ar"] == pytest.approx(np.mean([row[k] for k in recall_keys]), abs=0.01)
        assert (row["ms_per_query"] is None) == (row["method"] in results_io.REFERENCES)
    sizes = {(p["method"], p["n"]) for p in on_disk["latency"]}
    assert sizes == {(m, n) for m in ("random_projection", "vsepp")
                     for n in benchmark.LATENCY_SIZES}


def test_markdown_shows_the_json_numbers(smoke_results):
    out, results = smoke_results
    table = (out / "results.md").read_text()
    for row in results["rows"]:
        recall = row["i2t_r5" if row["setting"] == "full" else "i2t_r1"]
        assert f"| {row['method']} | {recall:.1f} |" in table
    for name, note in results["methods"].items():
        assert f"- `{name}`: {note}" in table


def test_untrained_baseline_is_near_chance_and_below_the_oracle(smoke_results):
    _, results = smoke_results
    rows = {(r["method"], r["setting"]): r for r in results["rows"]}
    test = rows[("random_projection", "test")]
    chance_r10 = 100 * 10 / test["n_images"]
    assert test["t2i_r10"] < 3 * chance_r10 + 5
    assert test["t2i_r1"] < rows[("oracle", "test")]["t2i_r1"]


def _small_bench():
    return make_benchmark(SyntheticConfig.smoke(n_train=60, n_val=12, n_test=30, n_pretrain=20,
                                                n_compositional=6), seed=3)


def _pessimistic_ranks(sims, queries, txt2img, direction):
    """Independent loop: wrong candidates scoring at least as high as the (best) truth."""
    ranks = []
    for q in queries:
        if direction == "t2i":
            truth = sims[txt2img[q], q]
            ranks.append(sum(sims[i, q] >= truth for i in range(sims.shape[0]) if i != txt2img[q]))
        else:
            best = max(sims[q, t] for t in range(sims.shape[1]) if txt2img[t] == q)
            ranks.append(sum(sims[q, t] >= best for t in range(sims.shape[1]) if txt2img[t] != q))
    return np.array(ranks)


def test_slow_methods_are_scored_on_sampled_queries(monkeypatch):
    # beyond its pair budget a method's recalls come from sampled queries of each direction; they
    # must be those of the same queries in the full matrix (an independent loop)
    bench = _small_bench()
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    split = bench["test"]
    monkeypatch.setattr(method, "pairs_per_query", lambda split, direction: 30)
    monkeypatch.setattr(method, "eval_pairs", (None, 30 * 12))
    metrics, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    assert "t2i on 12 sampled queries" in how and "i2t on 12 sampled queries" in how
    # too small: stays sampled
    monkeypatch.setattr(method, "every_pair_limit", 30 * 12, raising=False)
    limited, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0,
                                       every_pair=True)
    assert "t2i on 12 sampled queries" in how and limited == metrics
    monkeypatch.setattr(method, "every_pair_limit", 30 * split.n_texts)  # every pair fits: lifted
    exhaustive, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0,
                                          every_pair=True)
    assert "sampled" not in how
    capped, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0,
                                      pair_cap=30 * 12)
    # a cap samples as a budget does
    assert "t2i on 12 sampled queries" in how and capped == metrics
    monkeypatch.setattr(method, "eval_pairs", (None, None))
    capped, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0,
                                      pair_cap=30 * 12)
    assert "t2i on 12 sampled queries" in how and capped == metrics  # and binds where no budget did
    full = retrieval_metrics(method.similarity(split), split.txt2img)
    assert all(exhaustive[k] == pytest.approx(full[k]) for k in exhaustive)
    sims = method.similarity(split).numpy()
    for direction, n in (("t2i", split.n_texts), ("i2t", split.n_images)):
        rng = np.random.default_rng([0, 0 if direction == "t2i" else 1])
        picked = np.sort(rng.choice(np.arange(n), size=12, replace=False))
        ranks = _pessimistic_ranks(sims, picked, split.txt2img, direction)
        for k in (1, 5, 10):
            assert metrics[f"{direction}_r{k}"] == pytest.approx(100 * np.mean(ranks < k))


def test_full_setting_is_ranked_for_the_test_queries_only():
    bench = _small_bench()
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    full = bench["full"]
    metrics, how = evaluation.evaluate(method, full, (5, 10, 20))
    assert f"t2i on all {bench['test'].n_texts} queries" in how
    assert f"i2t on all {bench['test'].n_images} queries" in how
    expected = retrieval_metrics(method.similarity(full), full.txt2img, ks=(5, 10, 20),
                                 query_texts=full.query_texts, query_images=full.query_images)
    assert all(metrics[k] == pytest.approx(expected[k]) for k in metrics)


class _Reranker(RandomProjectionBaseline):
    """A stand-in re-ranker: another random projection, offering the pair-scorer API."""

    eval_pairs = (None, None)

    def score_pairs(self, split, images, texts):
        return self.similarity(split)[images, texts]


def test_two_stage_methods_are_scored_per_direction_and_sampled_by_top_m(monkeypatch):
    bench = _small_bench()
    tokenizer = build_word_tokenizer(bench["train"].captions)
    first = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    second = _Reranker(dim=8, seed=2).fit(bench, tokenizer)
    method = TwoStageMethod(first, second, top_m=4)
    split = bench["test"]
    metrics, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    i2t, t2i = method.similarity(split)
    assert "sampled" not in how
    dense = retrieval_metrics(i2t, split.txt2img, t2i_sims=t2i)
    assert all(metrics[k] == pytest.approx(dense[k]) for k in metrics)
    # a budget of 10 queries' worth of re-ranked pairs: each direction on 10 sampled queries
    monkeypatch.setattr(second, "eval_pairs", (None, 10 * 4))
    metrics, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    assert "t2i on 10 sampled queries (40 pairs)" in how
    picked = np.sort(np.random.default_rng([0, 0]).choice(split.n_texts, size=10, replace=False))
    # same queries, dense matrix
    ranks = _pessimistic_ranks(t2i.numpy(), picked, split.txt2img, "t2i")
    for k in (1, 5, 10):
        assert metrics[f"t2i_r{k}"] == pytest.approx(100 * np.mean(ranks < k))


class _Dummy(Method):
    """A method that exists only in this test: a fixed random score per pair, cheap to rank."""

    checkpoint_prefix = "dummy"
    eval_pairs = (None, None)
    timed_sizes = ((10, 20), (10, 20))
    notes = "test-only method"

    @dataclasses.dataclass
    class config_class:  # noqa: N801 - a config with no fields
        pass

    def build_model(self, bench, tokenizer):
        return torch.nn.Linear(1, 1)

    def train(self, bench, tokenizer, checkpoint_path, cache_dir):
        return self.build_model(bench, tokenizer), None

    def _scores(self, split):
        rng = np.random.default_rng(split.n_images)
        return torch.from_numpy(rng.random((split.n_images, split.n_texts)))

    def rank(self, split, direction, top_k, queries=None):
        from course_lib.methods.queries import query_indices, top_k_of

        q = torch.from_numpy(query_indices(split, direction, queries))
        sims = self._scores(split)
        return top_k_of(sims.T[q] if direction == "t2i" else sims[q], top_k)

    def query_fn(self, split, caption_index=0, top_k=10):
        return lambda: self.rank(split, "t2i", top_k, [caption_index])[0][0].numpy()


def test_a_method_registered_in_a_test_runs_through_the_smoke_benchmark(tmp_path):
    # adding a method touches only its own module: registration is all the benchmark needs
    register_method("dummy", order=99)(lambda build: _Dummy(name="dummy", progress=False))
    try:
        assert registered_names()[-1] == "dummy"
        # --jobs 1: a method registered only in this process cannot be built in a training worker
        results = benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", "dummy",
                                  "--checkpoints", str(tmp_path / "ckpt"), "--jobs", "1"])
        rows = [r for r in results["rows"] if r["method"] == "dummy"]
        assert {r["setting"] for r in rows} == set(benchmark.SETTINGS)
        full = next(r for r in rows if r["setting"] == "full")
        assert full["n_text_queries"] < full["n_texts"] and full["ms_per_query"] > 0
        assert "dummy" in (tmp_path / "results.md").read_text()
    finally:
        unregister_method("dummy")
    assert "dummy" not in registered_names()


def test_the_course_methods_are_registered_in_teaching_order():
    # the benchmark loops over the registry; a new lesson's method appears
    # without touching this test
    methods = benchmark.available_methods(smoke=True)
    names = [m.name for m in methods]
    assert names == registered_names() and len(set(names)) == len(names)
    lessons = ["vsepp", "scan", "cross_encoder", "lightningdot", "lightningdot+rerank@20",
               "lightningdot+rerank@50"]
    assert [n for n in names if n in lessons] == lessons
    by_name = {m.name: m for m in methods}  # a method built from others shares their one instance
    assert by_name["lightningdot+rerank@20"].stages[1] is by_name["cross_encoder"]
    assert by_name["lightningdot+rerank@50"].stages[0] is by_name["lightningdot"]


def test_baseline_scores_match_an_explicit_computation():
    bench = make_benchmark(SyntheticConfig.smoke(n_train=60, n_val=12, n_test=12, n_pretrain=20,
                                                 n_compositional=6), seed=3)
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    split = bench["test"]
    sims = method.similarity(split).numpy()
    vocab = tokenizer.get_vocab()
    for i, t in [(0, 0), (3, 17), (11, 59)]:
        words = split.captions[t].split()
        bag = np.zeros(len(tokenizer))
        for w in words:
            bag[vocab.get(w, vocab["[UNK]"])] += 1
        mask = split.region_mask[i]
        pooled = split.regions[i][mask].mean(0)
        expected = ((bag @ method.text_projection.numpy())
                    @ (pooled @ method.image_projection.numpy()))
        assert sims[i, t] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    top = method.query_fn(split, top_k=5)()
    assert np.array_equal(top, torch.topk(torch.from_numpy(sims[:, 0]), 5).indices.numpy())
    assert set(retrieval_metrics(sims, split.txt2img)) >= {"t2i_r1", "ar"}


def test_readme_block_is_replaced_and_the_rest_kept(tmp_path, smoke_results):
    # a real run's results through --readme's writer
    # (tests/test_results_blocks.py: the split in detail)
    _, results = smoke_results
    readme, doc = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    readme.write_text("intro\n<!-- results:start -->\nold table\n<!-- results:end -->\noutro\n")
    doc.write_text("docs\n<!-- results:start -->\nold tables\n<!-- results:end -->\n")
    results_io.update_readme(results, readme)
    text = readme.read_text()
    assert (text.startswith("intro\n<!-- results:start -->\n")
            and text.endswith("<!-- results:end -->\noutro\n"))
    assert "old table" not in text and results_io.readme_markdown(results) in text
    assert results_io.docs_markdown(results) in doc.read_text()
    readme.write_text("no markers here")
    with pytest.raises(ValueError, match="results block"):
        results_io.update_readme(results, readme)


def test_methods_option_selects_a_subset_and_rejects_unknown_names(tmp_path):
    results = benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", ""])
    assert {r["method"] for r in results["rows"]} == set(results_io.REFERENCES)
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", "vsepp,nonsense"])
    results = benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", "",
                              "--every-pair", "test"])
    assert {r["method"] for r in results["rows"]} == set(results_io.REFERENCES)
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--out", str(tmp_path), "--every-pair", "nowhere"])


def test_a_bare_every_pair_names_test_and_compositional(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(benchmark, "run", lambda **kwargs: seen.update(kwargs) or {"rows": []})
    monkeypatch.setattr(benchmark, "results_markdown", lambda results: "")
    for flags, settings in (([], ()), (["--every-pair"], ("test", "compositional")),
                            (["--every-pair", "test"], ("test",))):
        benchmark.main(["--methods", "", "--out", str(tmp_path), "--replace", *flags])
        assert seen["every_pair"] == settings  # one type: a tuple of setting names


def test_the_other_commands_options_name_the_command_to_type(tmp_path, capsys):
    from course_lib.core.shipped import REFRESH_COMMAND

    real = "python -m course_lib.real_benchmark --features DIR"
    for argv, command in ((["--features", str(tmp_path)], real),
                          (["--text-encoder", "bert-base-uncased"], real),
                          (["--refresh-shipped", "--methods", "vsepp"], REFRESH_COMMAND)):
        with pytest.raises(SystemExit):
            benchmark.main([*argv, "--out", str(tmp_path)])
        assert f"{argv[0]} belongs to another command: {command}" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_the_results_dict_fills_meta_then_the_extras_and_the_notes():
    class Named:
        name, notes = "vsepp", "a dual encoder"

    results = results_io.results_dict([{"method": "vsepp"}], [Named()], smoke=True, seed=3,
                                      seconds=1.26, references={"chance": "a random ranking"},
                                      data="real")
    assert list(results) == ["meta", "methods", "rows"]
    assert list(results["meta"]) == ["device", "torch", "mode", "seconds", "seed", "data"]
    assert results["meta"]["mode"] == "smoke" and results["meta"]["seconds"] == 1.3
    assert results["methods"] == {"chance": "a random ranking", "vsepp": "a dual encoder"}
    assert list(results["methods"]) == ["chance", "vsepp"]
    assert results["rows"] == [{"method": "vsepp"}]


def test_extrapolated_times_are_starred_in_every_table():
    row = {"method": "slow", "setting": "test", "n_images": 10, "n_texts": 50, "n_text_queries": 50,
           "n_image_queries": 10, "ar": 1.0, "ms_per_query": 12.5, "ms_measured": False,
           "notes": "x", **{f"{d}_r{k}": 1.0 for d in ("i2t", "t2i") for k in (1, 5, 10)}}
    results = {"meta": {"mode": "smoke", "seed": 0, "device": "cpu", "torch": "x", "seconds": 1},
               "rows": [row, {**row, "method": "fast", "ms_measured": True}], "latency": []}
    table = results_io.results_markdown(results)
    assert "| slow | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 12.5* |" in table
    assert "| fast | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 12.5 |" in table
    assert "* ms/query extrapolated" in table


def test_pairwise_methods_score_a_small_split_once_for_both_directions():
    from course_lib.methods.base import PairwiseMethod

    class Counting(PairwiseMethod):
        config_class = None
        calls = 0

        def build_model(self, *args):
            return None

        def train(self, *args):
            return None, None

        def query_fn(self, split, caption_index=0, top_k=10):
            return None

        def score_block(self, split, images, texts):
            Counting.calls += len(images) * len(texts)
            g = np.random.default_rng(0).random((split.n_images, split.n_texts))
            return torch.from_numpy(g[np.ix_(images, texts)]).float()

    bench = _small_bench()
    split = bench["test"]
    method = Counting(config=object(), name="counting", progress=False)
    method.model = torch.nn.Linear(1, 1)
    metrics, _ = evaluation.evaluate(method, split, (1, 5))
    assert Counting.calls == split.n_images * split.n_texts  # once, not once per direction
    dense = retrieval_metrics(method.similarity(split), split.txt2img, ks=(1, 5))
    assert all(metrics[k] == pytest.approx(dense[k]) for k in metrics)
    Counting.calls = 0
    method.rank(split, "t2i", 5, queries=[0, 3])  # the cached matrix serves a subset too
    assert Counting.calls == 0


def test_merge_keeps_old_rows_only_for_methods_not_rerun(smoke_results):
    _, results = smoke_results
    baseline = next(r["method"] for r in results["rows"]
                    if r["method"] not in (*results_io.REFERENCES, "vsepp"))
    old = json.loads(json.dumps(results))  # an earlier run of vsepp, with a marked recall
    old["rows"] = [{**r, "t2i_r1": -1.0} for r in old["rows"] if r["method"] == "vsepp"]
    old["latency"] = [p for p in old["latency"] if p["method"] == "vsepp"]
    old["meta"]["seconds"] = 12.5
    new = json.loads(json.dumps(results))  # this run: the oracle and the baseline only
    new["rows"] = [r for r in new["rows"] if r["method"] != "vsepp"]
    new["latency"] = [p for p in new["latency"] if p["method"] != "vsepp"]
    merged = results_io.merge_results(new, old)
    for setting in ("test", "full"):
        methods = [r["method"] for r in merged["rows"] if r["setting"] == setting]
        # course order: registered, then the rest
        assert methods == [*results_io.REFERENCES, "vsepp", baseline]
    # the old rows, untouched
    assert all(r["t2i_r1"] == -1.0 for r in merged["rows"] if r["method"] == "vsepp")
    assert merged["meta"]["merged"] == {"methods": ["vsepp"], "seconds": 12.5}
    assert [p["method"] for p in merged["latency"]][0] == "vsepp"
    assert "from an earlier run" in results_io.results_markdown(merged)
    old["meta"]["seed"] = 1
    with pytest.raises(ValueError, match="cannot merge"):
        results_io.merge_results(new, old)


def test_pareto_png_labels_every_timed_method_on_test_and_full(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    names = ["vsepp", "scan", "cross_encoder", "lightningdot", "lightningdot+rerank@20", "ubert@20",
             "hivlp", "fast", "slow", "fast_slow@10", "fast_slow@50"]
    # the benchmark's full setting has R@5, 10, 20: its panel plots t2i R@5
    rows = [{"method": "oracle", "setting": s, "t2i_r1" if s == "test" else "t2i_r5": 90.0,
             "ms_per_query": None}
            for s in ("test", "full")]
    rows += [{"method": m, "setting": s, "t2i_r1" if s == "test" else "t2i_r5": float(i),
              "ms_per_query": 10.0 ** (i % 4), "ms_measured": True} for s in ("test", "full")
             for i, m in enumerate(names)]
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    results_io._save_pareto(rows, tmp_path / "pareto.png")
    (fig,) = drawn
    assert ([ax.get_title() for ax in fig.axes]
            == ["accuracy vs latency (test)", "accuracy vs latency (full)"])
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.texts]
        # the oracle (90) lies above every method (0-10): marked at the top
        # edge, the axes fit the methods
        assert sorted(labels) == sorted(names + ["oracle 90.0 (ceiling) \u2191"])
        assert any(line.get_label() == "Pareto front" for line in ax.lines)
    assert [ax.get_ylabel() for ax in fig.axes] == ["t2i_r1 (%) on test", "t2i_r5 (%) on full"]


# ------------------------------------------------------------------- inputs checked before any work
@pytest.fixture
def no_run(monkeypatch):
    """benchmark.run replaced by a failure: a command that must stop first never reaches it."""
    def refuse(**kwargs):
        raise AssertionError("the benchmark ran: the inputs should have been refused first")
    monkeypatch.setattr(benchmark, "run", refuse)


def saved_results(folder, smoke_results, mode="smoke"):
    """A results.json of the smoke fixture's methods in `folder`, as an earlier run leaves it."""
    _, results = smoke_results
    folder.mkdir(exist_ok=True)
    results = {**results, "meta": {**results["meta"], "mode": mode}}
    results_io.write_outputs(results, folder)
    return folder / "results.json"


def test_merging_a_smoke_run_into_a_default_run_stops_before_any_work(tmp_path, smoke_results,
                                                                      no_run, capsys, monkeypatch):
    # it used to run to the end, then raise, leaving results.json with the oracle rows alone
    monkeypatch.delenv("COURSE_SMOKE", raising=False)  # a default run, as a learner types it
    path = saved_results(tmp_path / "X", smoke_results)
    before = path.read_bytes()
    with pytest.raises(SystemExit):
        benchmark.main(["--merge", str(path), "--out", str(path.parent)])
    assert "smoke run of seed 0" in capsys.readouterr().err and path.read_bytes() == before


@pytest.mark.parametrize("content, message", [('{"rows": []}', 'no a "meta" object'),
                                              ('{"meta": {"mode": "smoke", "seed": 0}, "ro',
                                               "not complete JSON"),
                                              (None, "cannot read")])
def test_a_bad_merge_file_is_named_in_plain_words(tmp_path, content, message, no_run, capsys):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--merge", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_a_run_that_would_drop_methods_or_change_mode_stops_unless_asked(tmp_path, smoke_results,
                                                                         no_run, capsys):
    path = saved_results(tmp_path / "X", smoke_results)
    with pytest.raises(SystemExit):  # only the oracle rows would be left
        benchmark.main(["--smoke", "--methods", "", "--out", str(path.parent)])
    assert "random_projection, vsepp" in capsys.readouterr().err
    # merging keeps them: the run may go ahead
    with pytest.raises(AssertionError, match="the benchmark ran"):
        benchmark.main(["--smoke", "--methods", "", "--out", str(path.parent),
                        "--merge", str(path)])
    with pytest.raises(AssertionError, match="the benchmark ran"):  # asked for
        benchmark.main(["--smoke", "--methods", "", "--out", str(path.parent), "--replace"])
    default_run = saved_results(tmp_path / "Y", smoke_results, mode="default")
    with pytest.raises(SystemExit):  # a smoke run over a default one, whatever its methods
        benchmark.main(["--smoke", "--methods", "vsepp", "--out", str(default_run.parent),
                        "--merge", str(path)])
    assert "holds a default run of seed 0" in capsys.readouterr().err


def test_outputs_are_replaced_all_or_nothing(tmp_path, smoke_results, monkeypatch):
    path = saved_results(tmp_path / "X", smoke_results)
    before = {name: (path.parent / name).read_bytes()
              for name in ("results.json", "results.md", "pareto.png")}

    def broken_plot(rows, target, published=None):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(results_io, "_save_pareto", broken_plot)
    _, results = smoke_results
    with pytest.raises(RuntimeError, match="the plot failed"):
        results_io.write_outputs({**results, "rows": results["rows"][:3]}, path.parent)
    assert {name: (path.parent / name).read_bytes() for name in before} == before
    assert (sorted(p.name for p in path.parent.iterdir())
            == ["pareto.png", "results.json", "results.md"])


def test_a_missing_readme_block_stops_before_any_work(tmp_path, no_run, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("no markers")
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--out", str(tmp_path / "out"), "--readme", str(readme)])
    assert "no results block" in capsys.readouterr().err
    # the README's block, no docs/results.md
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--out", str(tmp_path / "out"), "--readme", str(readme)])
    assert "docs/results.md: No such file" in capsys.readouterr().err


def test_a_cascade_faster_than_its_first_stage_is_flagged_in_plain_words():
    # in one smoke run ubert-embed took 144 ms while ubert-embed+cross_encoder@20, which
    # contains it, took 18.9 ms
    class Stage:
        name = "first"

    class Chain:
        name, stages = "first+rerank", [Stage()]

    def rows(first_ms, chain_ms):
        return [{"method": "first", "setting": "test", "ms_per_query": first_ms,
                 "ms_measured": True},
                {"method": "first+rerank", "setting": "test", "ms_per_query": chain_ms,
                 "ms_measured": True}]

    assert results_io.cascade_timing_problems([Stage(), Chain()], rows(1.0, 3.0)) is None
    note = results_io.cascade_timing_problems([Stage(), Chain()], rows(144.0, 18.9))
    assert ("too noisy to trust" in note
            and "first+rerank 18.9 ms against its first stage first 144 ms" in note)
    results = {"meta": {"mode": "smoke", "seed": 0, "device": "cpu", "torch": "x", "seconds": 1,
                        "timing_note": note},
               "rows": [{**r, "n_images": 10, "n_texts": 50, "t2i_r1": 1.0, "i2t_r1": 1.0,
                         "ar": 1.0, "notes": "",
                         "ms_p25": r["ms_per_query"] * 0.9, "ms_p75": r["ms_per_query"] * 1.2}
                        for r in rows(144.0, 18.9)]}
    table = results_io.results_markdown(results)
    assert "**Note:** this run's timings are too noisy" in table and "144 (130–173)" in table


def test_an_interrupted_run_keeps_finished_methods_and_continues(tmp_path, monkeypatch, capsys):
    # Ctrl-C used to give a raw KeyboardInterrupt traceback, an empty --out,
    # and a re-run from scratch
    calls = []
    real_evaluate = evaluation.evaluate

    def evaluate(method, *args, **kwargs):
        calls.append(method.name)
        if method.name == "vsepp" and calls.count("random_projection") == 3 and len(calls) == 4:
            raise KeyboardInterrupt  # while the second method is being evaluated
        return real_evaluate(method, *args, **kwargs)

    monkeypatch.setattr(benchmark, "evaluate", evaluate)

    def methods():
        return [RandomProjectionBaseline(),
                VsePPMethod(VsePPConfig.smoke(max_steps=3), progress=False)]

    monkeypatch.setattr(benchmark, "available_methods", lambda seed, smoke, names=None: methods())
    # --jobs 1: the two methods above train in this process. With more jobs the training processes
    # build every registered method, which this test does not patch: 90 s of
    # smoke training it never used
    args = ["--smoke", "--out", str(tmp_path), "--checkpoints", str(tmp_path / "ckpt"),
            "--jobs", "1"]
    with pytest.raises(SystemExit) as stop:
        benchmark.main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 130 and "interrupted. 1 method(s) finished (random_projection)" in err
    assert "Traceback" not in err and not (tmp_path / "results.json").exists()
    results = benchmark.main(args)
    assert calls.count("random_projection") == 3  # not evaluated again: its rows were kept
    assert ({r["method"] for r in results["rows"]}
            == {*results_io.REFERENCES, "random_projection", "vsepp"})
    # a complete run leaves no partial rows behind
    assert not (tmp_path / results_io.PARTIAL).exists()


def test_a_continued_run_names_the_shipped_models_of_both_parts(tmp_path, monkeypatch):
    # the continued part used to name only the models it loaded itself, not
    # those of the methods it kept
    def loaded_as_shipped(name):
        method = VsePPMethod(VsePPConfig.smoke(max_steps=3), progress=False)
        method.name = name
        real_fit = method.fit

        def fit(*args, **kwargs):
            real_fit(*args, **kwargs)
            method.from_shipped = True  # as if fit had found its model in shipped_models/
            return method
        method.fit = fit
        return method

    calls = []
    real_evaluate = evaluation.evaluate

    def evaluate(method, *args, **kwargs):
        calls.append(method.name)
        if calls == ["first", "first", "first", "second"]:
            raise KeyboardInterrupt  # while the second method is being evaluated
        return real_evaluate(method, *args, **kwargs)

    monkeypatch.setattr(benchmark, "evaluate", evaluate)
    monkeypatch.setattr(benchmark, "available_methods",
                        lambda seed, smoke, names=None: [loaded_as_shipped("first"),
                                                         loaded_as_shipped("second")])
    args = ["--smoke", "--out", str(tmp_path), "--checkpoints", str(tmp_path / "ckpt"),
            "--jobs", "1"]
    with pytest.raises(SystemExit):
        benchmark.main(args)
    results = benchmark.main(args)
    assert calls.count("first") == 3  # the first method's rows were kept, not measured again
    assert results["meta"]["shipped_models"] == ["first", "second"]
    shipped_note = "Loaded from shipped_models/, not trained: first, second."
    assert shipped_note in (tmp_path / "results.md").read_text()


def test_a_cascade_keeping_fewer_candidates_but_slower_is_flagged():
    # in one smoke run lightningdot+rerank@20 took 356 ms against 49.6 ms for @50
    class Stage:
        def __init__(self, name):
            self.name = name

    first, second = Stage("lightningdot"), Stage("cross_encoder")

    class Chain:
        def __init__(self, m):
            self.name, self.stages, self.top_ms = f"lightningdot+rerank@{m}", [first, second], [m]

    rows = [{"method": name, "setting": "test", "ms_per_query": ms, "ms_measured": True}
            for name, ms in (("lightningdot", 1.0), ("lightningdot+rerank@20", 356.0),
                             ("lightningdot+rerank@50", 49.6))]
    note = results_io.cascade_timing_problems([first, Chain(20), Chain(50)], rows)
    assert ("lightningdot+rerank@20 356 ms against lightningdot+rerank@50 49.6 ms, "
            "which keeps more candidates") in note
    rows[1]["ms_per_query"] = 20.0
    assert results_io.cascade_timing_problems([first, Chain(20), Chain(50)], rows) is None



def test_a_direction_with_too_few_sampled_queries_is_left_out(monkeypatch):
    # recalls from a handful of queries are noise: below MIN_SAMPLED_QUERIES the direction is not
    # ranked at all, and the row says why instead of showing a number
    bench = _small_bench()
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    split = bench["test"]
    fewest = evaluation.MIN_SAMPLED_QUERIES[1]
    monkeypatch.setattr(method, "pairs_per_query",
                        lambda split, direction: split.n_images if direction == "t2i"
                        else split.n_texts)
    # t2i: exactly the fewest queries fit the budget; i2t (5 captions per
    # image): one fewer than that
    monkeypatch.setattr(method, "eval_pairs", (None, fewest * split.n_images))
    ranked = []
    original = method.rank
    monkeypatch.setattr(method, "rank", lambda *a, **k: ranked.append(a[1]) or original(*a, **k))
    metrics, how = evaluation.evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    assert ranked == ["t2i"]
    assert f"t2i on {fewest} sampled queries" in how
    allowed = fewest * split.n_images // split.n_texts
    assert f"i2t not measured: its budget allows {allowed} sampled queries" in how
    assert all(metrics[f"i2t_r{k}"] is None for k in (1, 5, 10))
    assert all(metrics[f"t2i_r{k}"] is not None for k in (1, 5, 10))
    row = evaluation.results_row("random_projection", "test", split, metrics, (1, 5, 10), 1.0, how)
    assert (row["ar"] is None and row["i2t_r1"] is None
            and row["t2i_r1"] == round(metrics["t2i_r1"], 2))
    meta = {"mode": "smoke", "seed": 0, "device": "cpu", "torch": "-", "seconds": 1}
    table = results_io.results_markdown({"meta": meta, "rows": [row], "methods": {}})
    assert "| random_projection† | – | – | – |" in table and "– not measured" in table


class _SizeRecorder(RandomProjectionBaseline):
    """Records the gallery every query_fn is built on."""

    def __init__(self, timed_sizes, **kwargs):
        super().__init__(**kwargs)
        self.timed_sizes, self.galleries = timed_sizes, []

    def query_fn(self, split, caption_index=0, top_k=10):
        self.galleries.append(split)
        return lambda: None


@pytest.mark.filterwarnings("ignore:the fitted cost falls")  # no-op queries: a flat, noisy line
def test_latency_times_only_the_sizes_asked_and_the_whole_gallery_as_itself():
    # a quarter and a half of the gallery are timed only to extrapolate beyond what the method may
    # time; and the whole gallery is the split itself, so the states its evaluation cached serve
    split = _small_bench()["test"]
    n = split.n_images
    method = _SizeRecorder((None, None))
    rows = evaluation.query_latency(method, split, (n,), smoke=True, repeats=1)
    assert [r["n"] for r in rows] == [n] and method.galleries == [split]
    method = _SizeRecorder((None, None))
    evaluation.query_latency(method, split, (10, n), smoke=True, repeats=1)
    assert [g.n_images for g in method.galleries] == [10, n] and method.galleries[1] is split
    method = _SizeRecorder(((4, 8), (4, 8)))  # may time 8 at most: 4 and 8 are timed to reach n
    rows = evaluation.query_latency(method, split, (n,), smoke=True, repeats=1)
    assert ([g.n_images for g in method.galleries] == [4, 8]
            and [r["measured"] for r in rows] == [True, True, False])


def test_a_dual_encoder_embeds_a_gallery_once_for_ranking_and_timing(monkeypatch):
    from course_lib.methods import base

    bench = _small_bench()
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = VsePPMethod(VsePPConfig.smoke(max_steps=2), progress=False).fit(bench, tokenizer)
    encoded = []
    original = base.encode_gallery
    monkeypatch.setattr(base, "encode_gallery", lambda model, split, **k: encoded.append(
        (split, "indices" in k)) or original(model, split, **k))
    split = bench["test"]
    top, _ = method.rank(split, "t2i", 5)
    method.query_fn(split, caption_index=3, top_k=5)()
    method.rank(split, "i2t", 5)  # encodes only its query images, as before
    assert [s for s, some in encoded if not some] == [split]
    assert method.query_fn(split, caption_index=3, top_k=5)().tolist() == top[3].tolist()
    retrained = VsePPMethod(VsePPConfig.smoke(max_steps=2), progress=False).fit(bench, tokenizer)
    method.model = retrained.model
    method.rank(split, "t2i", 5)  # another model: embedded again
    assert [s for s, some in encoded if not some] == [split, split]


def test_split_cache_keeps_the_splits_used_last_per_model():
    from course_lib.core.split_cache import CACHED_SPLITS, SplitCache

    cache, computed = SplitCache(), []
    splits = [object() for _ in range(CACHED_SPLITS + 1)]
    model, other = object(), object()
    value = lambda split, m: cache.get(split, m, lambda: computed.append(split) or len(computed))  # noqa: E731
    firsts = [value(s, model) for s in splits[:CACHED_SPLITS]]
    assert ([value(s, model) for s in splits[:CACHED_SPLITS]] == firsts
            and len(computed) == CACHED_SPLITS)
    value(splits[0], model)  # used last: splits[1] is now the oldest
    value(splits[-1], model)  # one split too many: the oldest goes
    assert len(computed) == CACHED_SPLITS + 1
    value(splits[0], model)
    assert len(computed) == CACHED_SPLITS + 1
    value(splits[1], model)
    assert computed[-1] is splits[1]
    value(splits[1], other)  # another model: computed again
    assert computed[-2:] == [splits[1], splits[1]]


def test_the_benchmark_settings_reuse_a_first_stages_states_in_its_cascades(monkeypatch, tmp_path):
    # test, full and compositional stay cached after a method's run (the latency table's subsets
    # come first), so a cascade over it embeds no whole split again
    from course_lib.methods import base

    first = VsePPMethod(VsePPConfig.smoke(max_steps=2), name="vsepp", progress=False)
    cascade = TwoStageMethod(first, _Reranker(dim=8, seed=2), top_m=4)
    encoded = []
    for name in ("encode_gallery", "encode_captions"):
        original = getattr(base, name)
        monkeypatch.setattr(base, name,
                            lambda *a, _original=original, _name=name, **k: encoded.append(
            (_name, a[1], "indices" in k)) or _original(*a, **k))  # the split itself: no id reused
    benchmark.run(smoke=True, out=tmp_path, methods=[first, cascade], progress=False,
                  checkpoints=tmp_path / "checkpoints")
    whole = [(name, id(split)) for name, split, some in encoded if not some]
    # each split's images and captions once
    assert len(whole) == len(set(whole)) >= 2 * len(benchmark.SETTINGS)


def test_a_runs_sizes_reach_every_config_of_their_class_and_no_other():
    from course_lib.methods.cross_encoder.model import CrossEncoderConfig
    from course_lib.methods.lightningdot.model import LightningDOTConfig
    from course_lib.methods.registry import available_methods

    sizes = {"LightningDOTConfig": {"finetune_steps": 7, "hidden": 32}}
    dual, rerank = available_methods(0, True, ["lightningdot", "lightningdot+rerank@20"],
                                     sizes=sizes)
    assert dual.config == LightningDOTConfig.smoke(finetune_steps=7, hidden=32)
    assert rerank.first is dual  # one model serves the cascade
    plain = available_methods(0, True, ["cross_encoder"])[0]
    # another class
    assert isinstance(plain.config, CrossEncoderConfig) and rerank.reranker.config == plain.config


def test_a_finished_method_releases_its_split_caches_unless_a_later_one_reads_them():
    from types import SimpleNamespace

    from course_lib.core.split_cache import SplitCache
    from course_lib.real_benchmark import release_finished

    def method(*stages):
        cache = SplitCache()
        cache.get("test", "model", lambda: "states")
        if stages:
            return SimpleNamespace(cache=cache, stages=stages)
        return SimpleNamespace(cache=cache)

    first, reranker = method(), method()
    inner = method()  # a cascade's own stage object, in no list
    alone, cascade = method(), method(first, reranker, inner)
    methods = [first, alone, reranker, cascade]
    def kept():
        return [bool(m.cache.kept) for m in (first, alone, reranker, cascade, inner)]

    release_finished(methods, 2)  # first and alone done; the cascade still reads first
    assert kept() == [True, False, True, True, True]
    release_finished(methods, 4)  # all done
    assert kept() == [False, False, False, False, False]
