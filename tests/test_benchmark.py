"""The headless benchmark job writes the schema DESIGN §6 fixes, and its baseline scores right."""

import json

import numpy as np
import pytest
import torch

from course_lib import benchmark
from course_lib.baselines import RandomProjectionBaseline
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.metrics import retrieval_metrics
from course_lib.rerank import TwoStageMethod
from course_lib.vsepp import VsePPConfig, VsePPMethod

ROW_KEYS = {"method", "setting", "n_images", "n_texts", "ar", "ms_per_query", "notes"}


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
    assert set(on_disk["methods"]) == {"oracle", "random_projection", "vsepp"}
    seen = {(r["method"], r["setting"]) for r in on_disk["rows"]}
    assert seen == {(m, s) for m in on_disk["methods"] for s in ("test", "full", "compositional")}
    for row in on_disk["rows"]:
        ks = (5, 10, 20) if row["setting"] == "full" else (1, 5, 10)
        recall_keys = {f"{d}_r{k}" for d in ("i2t", "t2i") for k in ks}
        assert set(row) == ROW_KEYS | recall_keys
        assert row["ar"] == pytest.approx(np.mean([row[k] for k in recall_keys]), abs=0.01)
        assert (row["ms_per_query"] is None) == (row["method"] == "oracle")
    sizes = {(p["method"], p["n"]) for p in on_disk["latency"]}
    assert sizes == {(m, n) for m in ("random_projection", "vsepp") for n in benchmark.LATENCY_SIZES}


def test_markdown_shows_the_json_numbers(smoke_results):
    out, results = smoke_results
    table = (out / "results.md").read_text()
    for row in results["rows"]:
        assert f"| {row['method']} | {row['i2t_r' + ('5' if row['setting'] == 'full' else '1')]:.1f} |" in table
    for name, note in results["methods"].items():
        assert f"- `{name}`: {note}" in table


def test_untrained_baseline_is_near_chance_and_below_the_oracle(smoke_results):
    _, results = smoke_results
    rows = {(r["method"], r["setting"]): r for r in results["rows"]}
    test = rows[("random_projection", "test")]
    chance_r10 = 100 * 10 / test["n_images"]
    assert test["t2i_r10"] < 3 * chance_r10 + 5
    assert test["t2i_r1"] < rows[("oracle", "test")]["t2i_r1"]


def test_slow_methods_are_scored_on_sampled_queries(monkeypatch):
    # beyond its pair budget a method's t2i comes from sampled text queries; the recalls must be
    # those of the same texts in the full matrix (an independent computation)
    bench = make_benchmark(SyntheticConfig.smoke(n_train=60, n_val=12, n_test=30, n_pretrain=20,
                                                 n_compositional=6), seed=3)
    tokenizer = build_word_tokenizer(bench["train"].captions)
    method = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    split = bench["test"]
    monkeypatch.setitem(benchmark.EVAL_PAIRS, "random_projection", (None, 30 * 40))
    metrics, how = benchmark._evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    assert "40 sampled text queries" in how and metrics["i2t_r1"] is None
    exhaustive, how = benchmark._evaluate(method, split, (1, 5, 10), smoke=True, seed=0, every_pair=True)
    assert how == "every pair scored" and exhaustive == retrieval_metrics(method.similarity(split), split.txt2img)
    picked = np.sort(np.random.default_rng(0).choice(split.n_texts, size=40, replace=False))
    sims = method.similarity(split).numpy()
    ranks = [(sims[:, t] > sims[split.txt2img[t], t]).sum() for t in picked]
    for k in (1, 5, 10):
        assert metrics[f"t2i_r{k}"] == pytest.approx(100 * np.mean(np.array(ranks) < k))


class _Reranker(RandomProjectionBaseline):
    """A stand-in re-ranker: another random projection, offering the pair-scorer API."""

    def pair_scorer(self, split):
        sims = self.similarity(split)
        return lambda images, texts: sims[images, texts]


def test_two_stage_methods_are_scored_per_direction_and_sampled_by_top_m(monkeypatch):
    bench = make_benchmark(SyntheticConfig.smoke(n_train=60, n_val=12, n_test=30, n_pretrain=20,
                                                 n_compositional=6), seed=3)
    tokenizer = build_word_tokenizer(bench["train"].captions)
    first = RandomProjectionBaseline(dim=8, seed=1).fit(bench, tokenizer)
    second = _Reranker(dim=8, seed=2).fit(bench, tokenizer)
    method = TwoStageMethod(first, second, top_m=4)
    split = bench["test"]
    metrics, how = benchmark._evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    i2t, t2i = method.similarity(split)
    assert how == "every query re-ranked"
    assert metrics == retrieval_metrics(i2t, split.txt2img, t2i_sims=t2i)
    # a budget of 10 queries' worth of re-ranked pairs: t2i on 10 sampled captions
    monkeypatch.setitem(benchmark.EVAL_PAIRS, method.name, (None, 10 * 4))
    metrics, how = benchmark._evaluate(method, split, (1, 5, 10), smoke=True, seed=0)
    assert "10 sampled text queries" in how and "40 pairs" in how and metrics["i2t_r1"] is None
    picked = np.sort(np.random.default_rng(0).choice(split.n_texts, size=10, replace=False))
    ranks = [(t2i[:, t] > t2i[split.txt2img[t], t]).sum() for t in picked]  # same queries, full matrix
    for k in (1, 5, 10):
        assert metrics[f"t2i_r{k}"] == pytest.approx(100 * np.mean(np.array(ranks) < k))


def test_the_course_methods_are_registered_in_teaching_order():
    names = [m.name for m in benchmark.available_methods(smoke=True)]
    assert names == ["vsepp", "scan", "cross_encoder", "lightningdot", "lightningdot+rerank@20",
                     "lightningdot+rerank@50"]


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
        expected = (bag @ method.text_projection.numpy()) @ (pooled @ method.image_projection.numpy())
        assert sims[i, t] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    top = method.query_fn(split, top_k=5)()
    assert torch.equal(top, torch.topk(torch.from_numpy(sims[:, 0]), 5).indices)
    assert set(retrieval_metrics(sims, split.txt2img)) >= {"t2i_r1", "ar"}


def test_readme_block_is_replaced_and_the_rest_kept(tmp_path, smoke_results):
    _, results = smoke_results
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:start -->\nold table\n<!-- results:end -->\noutro\n")
    benchmark.update_readme(results, readme)
    text = readme.read_text()
    assert text.startswith("intro\n<!-- results:start -->\n") and text.endswith("<!-- results:end -->\noutro\n")
    assert "old table" not in text and benchmark.results_markdown(results) in text
    readme.write_text("no markers here")
    with pytest.raises(ValueError, match="results block"):
        benchmark.update_readme(results, readme)


def test_methods_option_selects_a_subset_and_rejects_unknown_names(tmp_path):
    results = benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", ""])
    assert {r["method"] for r in results["rows"]} == {"oracle"}
    with pytest.raises(SystemExit):
        benchmark.main(["--smoke", "--out", str(tmp_path), "--methods", "vsepp,nonsense"])
