"""The lean online query path (course_lib.core.serving): the tokenizer gives TextCollate's ids, each
encoder backend gives eager's vectors or is skipped, the searcher gives retrieval.search's answer,
and every dual encoder's lean query_fn returns the same top k as the eager path it replaced."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from course_lib.core.retrieval import build_index, search
from course_lib.core.serving import (
    AUTO,
    QueryEncoder,
    QueryTokenizer,
    Searcher,
    TextQueryPath,
    probe_captions,
)
from course_lib.core.settings import CourseNote, seed_everything
from course_lib.core.tokens import SpecialTokens
from course_lib.data.datasets import TextCollate

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH_SIZES = dict(n_train=60, n_val=10, n_test=30, n_pretrain=30, n_compositional=1)
HAS_ORT = (importlib.util.find_spec("onnxruntime") is not None
           and importlib.util.find_spec("onnx") is not None)
CPU_BACKENDS = ["eager", "jit"] + (["onnx"] if HAS_ORT else [])


def test_query_tokenizer_gives_the_collates_ids(bench, tok):
    long = " ".join(bench["test"].captions[:12])  # > 40 tokens: truncated, [SEP] kept at the end
    queries = QueryTokenizer(tok, max_length=40)
    for caption in bench["test"].captions[:20] + [long, "zebra UNKNOWNWORD circle", ""]:
        expected = TextCollate(tok, 40).encode([caption])
        ids, mask = queries(caption)
        assert ids.dtype == np.int64 and ids.flags.c_contiguous
        np.testing.assert_array_equal(ids, expected["input_ids"].numpy())
        np.testing.assert_array_equal(mask, expected["attention_mask"].numpy())
    assert queries(long)[0].shape == (1, 40)
    assert (tok.backend_tokenizer.truncation is None
            or tok.backend_tokenizer.truncation["max_length"] != 3)
    QueryTokenizer(tok, max_length=3)  # a private copy: the caller's tokenizer keeps its settings
    np.testing.assert_array_equal(queries(long)[0],
                                  TextCollate(tok, 40).encode([long])["input_ids"].numpy())


class _Tiny(nn.Module):
    """A text encoder of a few operators: (1, T) ids -> (1, 8) and (1, 4) outputs."""

    def __init__(self, length_branch: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj = nn.Embedding(50, 8), nn.Linear(8, 4)
        self.length_branch = length_branch

    def encode(self, batch):
        x = self.embed(batch["input_ids"]) * batch["attention_mask"][..., None]  # (1, T, 8)
        pooled = x.mean(1)  # (1, 8)
        if self.length_branch and batch["input_ids"].shape[1] > 4:  # a Python branch on the length
            pooled = pooled * 2
        return [pooled, self.proj(pooled)]


def _probes(lengths=(3, 6, 9)):
    return [(np.arange(1, T + 1, dtype=np.int64)[None], np.ones((1, T), dtype=np.int64))
            for T in lengths]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_each_backend_matches_eager_on_every_length(backend):
    model = _Tiny().eval()
    encoder = QueryEncoder(model.encode, _probes(), backend=backend)
    assert encoder.backend == backend
    for ids, mask in _probes((2, 5, 11)):  # lengths it was not built on
        with torch.no_grad():
            expected = [t.numpy() for t in model.encode({"input_ids": torch.from_numpy(ids),
                                                         "attention_mask": torch.from_numpy(mask)})]
        got = encoder(ids, mask)
        assert ([g.shape for g in got] == [(1, 8), (1, 4)]
                and all(g.dtype == np.float32 for g in got))
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_backend_that_bakes_in_one_length_is_skipped_with_a_note():
    """Tracing records one side of a Python branch on the length; the probes catch it, and auto
    falls back to the next backend (eager) instead of answering wrongly."""
    model = _Tiny(length_branch=True).eval()
    # (and 'onnx', exported by tracing)
    with pytest.warns(CourseNote, match="'jit' skipped .*differ"):
        encoder = QueryEncoder(model.encode, _probes(), backend="auto")
    assert encoder.backend == "eager"
    ids, mask = _probes((7,))[0]
    assert np.allclose(encoder(ids, mask)[0],
                       2 * model.embed(torch.from_numpy(ids)).mean(1).detach().numpy())


class _GRUText(nn.Module):
    """A bi-GRU text tower over packed sequences: its ONNX export fails with its IR graph dumped."""

    def __init__(self):
        super().__init__()
        from course_lib.core.encoders import BiGRUEncoder

        torch.manual_seed(0)
        self.tower = BiGRUEncoder(50, 16, 16)

    def encode(self, batch):
        return self.tower(batch).pooled


def test_building_a_gru_query_encoder_writes_nothing_but_its_notes(capfd):
    # a failed ONNX export used to print ~95 lines of Torch IR graph from
    # C++ before the one-line note
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        encoder = QueryEncoder(_GRUText().eval().encode, _probes(), backend="auto")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")  # capfd reads file descriptors 1 and 2: C++ writes count too
    skipped = [str(n.message) for n in notes]
    assert all(issubclass(n.category, CourseNote) and "\n" not in str(n.message)
               for n in notes), skipped
    # without onnxruntime: no note, a choice
    tried = [b for b in AUTO["cpu"] if b != "onnx" or HAS_ORT]
    # one note per skip
    assert [n.split("'")[1] for n in skipped] == tried[:tried.index(encoder.backend)]


def test_quiet_swallows_python_and_c_level_writes_and_restores_them(capfd):
    import logging
    import os
    import sys

    from course_lib.core.serving import _quiet

    with _quiet():
        print("python stdout")
        print("python stderr", file=sys.stderr)
        os.write(1, b"fd 1\n")
        os.write(2, b"fd 2\n")
        warnings.warn("a warning", stacklevel=1)
        logging.getLogger("torch.onnx").error("a log record")
    assert capfd.readouterr() == ("", "")
    print("after")
    os.write(2, b"after fd 2\n")
    assert capfd.readouterr() == ("after\n", "after fd 2\n")


def test_a_refused_backend_asked_for_by_name_raises():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CourseNote)
        with pytest.raises(RuntimeError, match="no query encoder backend works"):
            QueryEncoder(_Tiny(length_branch=True).eval().encode, _probes(), backend="jit")
    with pytest.raises(ValueError, match="backend must be"):
        QueryEncoder(_Tiny().encode, _probes(), backend="tensorrt")
    with pytest.raises(RuntimeError, match="CUDA"):
        QueryEncoder(_Tiny().encode, _probes(), backend="cuda_graph")


def test_searcher_matches_search_and_its_answers_are_not_overwritten():
    g = torch.Generator().manual_seed(0)
    gallery, queries = torch.randn(200, 16, generator=g), torch.randn(3, 16, generator=g).numpy()
    index = build_index(gallery)
    searcher = Searcher(index, k=10)
    first = searcher(queries[:1])
    for q in range(3):
        scores, indices = searcher(queries[q:q + 1])
        expected_scores, expected_indices = search(index, queries[q:q + 1], 10)
        np.testing.assert_array_equal(indices, expected_indices[0])
        np.testing.assert_allclose(scores, expected_scores[0], rtol=1e-6)
    np.testing.assert_array_equal(first[1], search(index, queries[:1], 10)[1][0])  # a copy, kept
    # k capped at the gallery
    assert len(Searcher(build_index(gallery[:4]), k=10)(queries[:1])[1]) == 4


def test_path_stages_chain_to_the_whole_query(bench, tok):
    model = _Tiny().eval()
    queries = QueryTokenizer(tok, 40)
    caption = bench["test"].captions[0]
    encoder = QueryEncoder(model.encode, probe_captions(queries, caption))
    gallery = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    searcher = Searcher(build_index(gallery), 5)
    path = TextQueryPath(queries, encoder, searcher)
    x = None
    names = []
    for name, fn in path.stages(caption):
        x = fn(x)
        names.append(name)
    assert names == ["tokenise", "tensors + transfer", "encoder forward",
                     "normalise + to host", "search"]
    np.testing.assert_array_equal(x[1], path(caption)[1])
    # [CLS] word [SEP]; full
    assert [p[0].shape[1] for p in probe_captions(queries, caption)][1:] == [3, 40]


# ------------------------------------------------------------------------------- every dual encoder

def _fresh(name, bench, tok):
    """A Method of `name` holding a fresh (untrained) model: rankings are as checkable untrained."""
    from course_lib.methods.fast_slow.method import FastMethod
    from course_lib.methods.fast_slow.model import FastConfig, FastModel
    from course_lib.methods.hivlp.method import HiVLPMethod
    from course_lib.methods.hivlp.model import HiVLPConfig, build_hivlp
    from course_lib.methods.lightningdot.method import LightningDOTMethod, build_lightningdot
    from course_lib.methods.lightningdot.model import LightningDOTConfig
    from course_lib.methods.scan.model import SCANConfig, build_scan
    from course_lib.methods.ubert.method import UBERTMethod
    from course_lib.methods.ubert.model import UBERTConfig, build_ubert
    from course_lib.methods.vsepp import VsePPConfig, VsePPMethod, build_dual_encoder

    seed_everything(0)
    train = bench["train"]
    builds = {
        "vsepp": lambda: (VsePPMethod(VsePPConfig()),
                          lambda m: build_dual_encoder(m.config, train, tok)),
        "vsepp-bow": lambda: (VsePPMethod(VsePPConfig(text_encoder="bow")),
                              lambda m: build_dual_encoder(m.config, train, tok)),
        "lightningdot": lambda: (LightningDOTMethod(LightningDOTConfig()),
                                 lambda m: build_lightningdot(m.config, train, tok)),
        "ubert-embed": lambda: (UBERTMethod(UBERTConfig()),
                                lambda m: build_ubert(m.config, train, tok,
                                                      build_scan(SCANConfig(), train, tok))),
        "fast": lambda: (FastMethod(FastConfig()),
                         lambda m: FastModel(len(tok), m.config, SpecialTokens.of(tok))),
        "fast-transformer": lambda: (FastMethod(FastConfig(text_tower="transformer")),
                                     lambda m: FastModel(len(tok), m.config,
                                                         SpecialTokens.of(tok))),
        "fast-bow": lambda: (FastMethod(FastConfig(text_tower="bow")),
                             lambda m: FastModel(len(tok), m.config, SpecialTokens.of(tok))),
        "hivlp": lambda: (HiVLPMethod(HiVLPConfig()), lambda m: build_hivlp(m.config, train, tok)),
    }
    method, build = builds[name]()
    method.tokenizer, method.progress = tok, False
    method.model = build(method).eval()
    return method


DUAL_ENCODERS = ["vsepp", "vsepp-bow", "lightningdot", "ubert-embed", "fast", "fast-transformer",
                 "fast-bow", "hivlp"]


@pytest.mark.parametrize("name", DUAL_ENCODERS)
def test_lean_query_fn_returns_the_reference_top_k(name, bench, tok):
    method, split = _fresh(name, bench, tok), bench["test"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CourseNote)  # a backend skipped is reported, not an error
        for t in (0, 7, split.n_texts - 1):
            lean = method.query_fn(split, t, top_k=10, with_scores=True)()
            reference = method.query_fn(split, t, top_k=10, with_scores=True, backend="reference")()
            np.testing.assert_array_equal(lean[0], reference[0])
            np.testing.assert_allclose(lean[1], reference[1], rtol=1e-4, atol=1e-5)
            assert np.array_equal(method.query_fn(split, t, top_k=5)(), reference[0][:5])
    assert method._query_side.encoder.backend in ("onnx", "jit", "eager")


def test_the_query_side_is_built_once_per_model(bench, tok):
    method, split = _fresh("lightningdot", bench, tok), bench["test"]
    method.query_fn(split, 0)
    built = method._query_side.encoder
    method.query_fn(split, 3)  # another query, another gallery size: the same compiled encoder
    method.query_fn(split.subset(range(10)), 1)
    assert method._query_side.encoder is built
    with torch.no_grad():
        method.model.text_encoder.word.weight.add_(0.5)  # weights changed in place: exported again
    method.query_fn(split, 0)
    assert method._query_side.encoder is not built
    lean = method.query_fn(split, 0, with_scores=True)()
    reference = method.query_fn(split, 0, with_scores=True, backend="reference")()
    np.testing.assert_allclose(lean[1], reference[1], rtol=1e-4, atol=1e-5)
    rebuilt = method._query_side.encoder
    method.model = _fresh("lightningdot", bench, tok).model  # a new model is exported again
    method.query_fn(split, 0)
    assert method._query_side.encoder is not rebuilt


def test_hivlp_online_paths_return_their_offline_rankings(bench, tok):
    from course_lib.methods.hivlp.method import HiVLPCascade

    method, split = _fresh("hivlp", bench, tok), bench["test"]
    cascade = HiVLPCascade(method, survivors=(20, 10))
    queries = np.array([0, 7, split.n_texts - 1])
    ranked = cascade.rank(split, "t2i", 5, queries)[0].numpy()  # (3, 5)
    level = method.level(0)
    ranked_level = level.rank(split, "t2i", 5, queries)[0].numpy()
    for row, t in enumerate(queries):
        np.testing.assert_array_equal(cascade.query_fn(split, int(t), top_k=5)(), ranked[row])
        np.testing.assert_array_equal(level.query_fn(split, int(t), top_k=5)(), ranked_level[row])


def test_ubert_online_cascade_returns_its_offline_ranking(bench, tok):
    from course_lib.methods.ubert.method import UBERTCascade

    method, split = _fresh("ubert-embed", bench, tok), bench["test"]
    cascade = UBERTCascade(method, top_k=8, top_k_i2t=8)
    queries = np.array([0, 7, split.n_texts - 1])
    ranked = cascade.rank(split, "t2i", 5, queries)[0].numpy()
    for row, t in enumerate(queries):
        np.testing.assert_array_equal(cascade.query_fn(split, int(t), top_k=5)(), ranked[row])
    images = cascade.rank(split, "i2t", 5, np.array([0, 4]))[0].numpy()
    for row, i in enumerate((0, 4)):
        np.testing.assert_array_equal(cascade.image_query_fn(split, i, top_k=5)(), images[row])


@pytest.mark.parametrize("name", ["lightningdot", "vsepp"])
def test_image_query_fn_returns_the_offline_ranking(name, bench, tok):
    method, split = _fresh(name, bench, tok), bench["test"]
    ranked = method.rank(split, "i2t", 10, np.array([0, 5]))[0].numpy()
    for row, i in enumerate((0, 5)):
        np.testing.assert_array_equal(method.image_query_fn(split, i, top_k=10)(), ranked[row])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda_graph", "jit"])
def test_cuda_query_paths_return_the_reference_top_k(backend, bench, tok):
    method, split = _fresh("lightningdot", bench, tok), bench["test"]
    method.model.cuda()
    for t in (0, 7):
        reference = method.query_fn(split, t, backend="reference")()
        np.testing.assert_array_equal(method.query_fn(split, t, backend=backend)(), reference)
    assert method._query_side.encoder.backend == backend


def test_the_device_report_times_every_path_and_checks_its_top_10(bench, tok):
    """course_lib.studies.gpu_query, run here on the CPU (and on CUDA where there is one): every
    backend timed or refused with its reason, each timed one giving the reference top 10, the
    profile's stages in order, the model back on its device, and the report's ratio to the
    cross-encoder."""
    from course_lib.core.serving import STAGES
    from course_lib.studies.gpu_query import BACKENDS, devices, format_report, query_paths

    method, split = _fresh("lightningdot", bench, tok), bench["test"]
    report = {"n_images": split.n_images, "repeats": 3}
    for device in devices():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CourseNote)
            found = query_paths(method, split, device, repeats=3)
        assert set(found) == set(BACKENDS[device]) | {"profile"}
        timed = {b: row for b, row in found.items() if b != "profile" and "median_ms" in row}
        assert {"reference", "eager"} <= set(timed)
        assert all(row["same_top10"] and row["median_ms"] >= 0 for row in timed.values())
        assert [row["stage"] for row in found["profile"]["stages"]][:len(STAGES)] == list(STAGES)
        assert next(method.model.parameters()).device.type == "cpu"  # moved back
        fastest = min(row["median_ms"] for row in timed.values())
        report[device] = {"lightningdot": found, "cross_encoder": {"median_ms": 100 * fastest}}
    text = format_report(report)
    assert text.count("100x the fastest LightningDOT path") == len(devices())
