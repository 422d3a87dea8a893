"""The lean online text query: one caption in, the top k gallery items out (notebook 03, section
10, times each step). A dot product costs microseconds, the eager path around it many times that
(docs/tuning_notes.md, "The online query path"): the tokenizer's Python front end, a dict of
tensors, dozens of operator dispatches, `retrieval.search`'s checks. Here each is paid once, at
build: QueryEncoder runs encode as one graph (ONNX Runtime, TorchScript or one CUDA graph per
caption length); a backend that fails or disagrees with eager is skipped, so no answer changes."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from course_lib.core.frozen_states import FROZEN_STATES
from course_lib.core.settings import CourseNote

BACKENDS = ("onnx", "jit", "compile", "cuda_graph", "eager")
AUTO = {"cpu": ("onnx", "jit", "eager"), "cuda": ("cuda_graph", "jit", "eager")}  # in this order
STAGES = ("tokenise", "tensors + transfer", "encoder forward", "normalise + to host", "search")
_TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # a backend must match eager to float32 rounding


class QueryTokenizer:
    """caption -> (input_ids, attention_mask), each int64 (1, T), as TextCollate gives them, from a
    private copy of the Rust backend. Views of one row, which the next call overwrites."""

    def __init__(self, tokenizer, max_length: int = 40):
        from tokenizers import Tokenizer
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.no_padding()
        self.backend.enable_truncation(max_length)
        self.max_length = max_length
        self._ids = np.zeros((1, max_length), dtype=np.int64)  # (1, L) reused
        self._mask = np.ones((1, max_length), dtype=np.int64)  # one unpadded caption: all real

    def __call__(self, caption: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.backend.encode(caption).ids
        T = len(ids)
        self._ids[0, :T] = ids
        return self._ids[:, :T], self._mask[:, :T]  # (1, T) views, C-contiguous (one row)


class _Encode(nn.Module):
    """encode(batch dict) as a module of two tensors, as tracing and export need."""

    def __init__(self, encode: Callable[[dict], object]):
        super().__init__()
        self.encode = encode
        if isinstance(owner := getattr(encode, "__self__", None), nn.Module):
            self.model = owner  # registered, so trace / export see its parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.encode({"input_ids": input_ids, "attention_mask": attention_mask})
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class QueryEncoder:
    """encode(batch) for one caption by the first of `backend`'s candidates ("auto": AUTO) that
    matches eager on every (ids, mask) probe. Stages feed(ids, mask) -> run(inputs) -> host(outputs)
    (float32 (1, d) numpy rows, one per output); `backend` names the one kept."""

    def __init__(self, encode: Callable[[dict], object], probes, *, device="cpu",
                 backend: str = "auto"):
        self.device = torch.device(device)
        self.module = _Encode(encode).eval()
        if not probes:
            raise ValueError("QueryEncoder needs at least one probe (ids, mask) to check against")
        self.probes = [(np.ascontiguousarray(i, np.int64), np.ascontiguousarray(m, np.int64))
                       for i, m in probes]
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        with FROZEN_STATES.paused():  # a graph of the BERT itself, not of the memo's lookups
            self._choose(AUTO.get(self.device.type, AUTO["cpu"]) if backend == "auto"
                         else (backend,))

    def _choose(self, candidates) -> None:
        """Keep the first candidate backend whose vectors match eager's on every probe."""
        feed, run, host = self._build_eager()
        expected = [host(run(feed(i, m))) for i, m in self.probes]
        reasons = []
        for name in candidates:
            try:
                self.feed, self.run, self.host = getattr(self, f"_build_{name}")()
                if all(_same(self(i, m), e)
                       for (i, m), e in zip(self.probes, expected, strict=True)):
                    self.backend = name
                    return
                reason = "its vectors differ from eager's"
            except ImportError as error:  # onnxruntime not installed: a choice, not a failure
                reasons.append(f"{name}: {error}")
                continue
            except Exception as error:  # export / trace / capture failures vary by model, version
                reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
            reasons.append(f"{name}: {reason}")
            warnings.warn(f"query encoder backend {name!r} skipped ({reason})", CourseNote,
                          stacklevel=3)  # the caller of QueryEncoder(...)
        raise RuntimeError(f"no query encoder backend works here: {'; '.join(reasons)}")

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.host(self.run(self.feed(ids, mask)))

    def _torch_feed(self, ids, mask):  # _build_* each return (feed, run, host)
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)

    @staticmethod
    def _torch_host(outputs) -> tuple[np.ndarray, ...]:
        return tuple(o.float().cpu().numpy() for o in outputs)  # no copies for float32 CPU outputs

    def _torch(self, module):
        return self._torch_feed, torch.inference_mode()(lambda x: module(*x)), self._torch_host

    def _build_eager(self):
        return self._torch(self.module.to(self.device))

    def _build_jit(self):
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # trace warns about shape-dependent Python branches
            example = self._torch_feed(*max(self.probes, key=lambda p: p[0].shape[1]))
            traced = torch.jit.freeze(torch.jit.trace(self.module.to(self.device), example,
                                                      check_trace=False))
        return self._torch(traced)

    def _build_compile(self):
        return self._torch(torch.compile(self.module.to(self.device), dynamic=True))

    def _build_onnx(self):
        if self.device.type != "cpu":
            raise RuntimeError("the course's ONNX Runtime path is CPU-only")
        import onnxruntime  # noqa: F401  (absent: fall back before paying for the export)
        graph = io.BytesIO()
        with torch.inference_mode(False), torch.no_grad(), _quiet():
            ids, mask = (torch.from_numpy(a) for a in self.probes[0])
            names = [f"out{i}" for i in range(len(self.module.cpu()(ids, mask)))]
            torch.onnx.export(self.module.cpu(), (ids, mask), graph, dynamo=False,
                              input_names=["input_ids", "attention_mask"], output_names=names,
                              dynamic_axes={"input_ids": {1: "T"}, "attention_mask": {1: "T"}})
        options = onnxruntime.SessionOptions()
        # one query's operators are too small to split: threads would only wait for each other
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        with _quiet():
            session = onnxruntime.InferenceSession(graph.getvalue(), options,
                                                   providers=["CPUExecutionProvider"])
        return (lambda ids, mask: {"input_ids": ids, "attention_mask": mask},
                lambda inputs: session.run(None, inputs), tuple)

    def _build_cuda_graph(self):
        """One CUDA graph per caption length T, captured on first use: one replay launches the
        whole forward, where eager launches a kernel per operator. feed fills static inputs."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        module, graphs = self.module.to(self.device), {}

        def capture(T: int):
            ids = torch.zeros(1, T, dtype=torch.long, device=self.device)
            mask = torch.ones(1, T, dtype=torch.long, device=self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(3):  # warm up off the default stream, as torch.cuda.graph asks
                    module(ids, mask)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph):
                outputs = module(ids, mask)
            return graph, ids, mask, outputs

        def feed(ids, mask):
            if ids.shape[1] not in graphs:
                graphs[ids.shape[1]] = capture(ids.shape[1])
            graph, static_ids, static_mask, outputs = graphs[ids.shape[1]]
            static_ids.copy_(torch.from_numpy(ids), non_blocking=True)
            static_mask.copy_(torch.from_numpy(mask), non_blocking=True)
            return graph, outputs

        def run(inputs):
            graph, outputs = inputs
            graph.replay()
            return outputs

        return feed, run, self._torch_host


@contextlib.contextmanager
def _quiet():
    """Nothing the exporter says reaches the console: warnings, logging, sys.stdout / stderr, and
    C++ writes to descriptors 1 and 2 (a failed ONNX export of a GRU prints its whole IR there)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved, disabled = [os.dup(fd) for fd in (1, 2)], logging.root.manager.disable
    try:
        with (tempfile.TemporaryFile() as sink, warnings.catch_warnings(),
              contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())):
            warnings.simplefilter("ignore")
            logging.disable(logging.CRITICAL)
            for fd in (1, 2):
                os.dup2(sink.fileno(), fd)
            try:
                yield
            finally:
                logging.disable(disabled)
                with contextlib.suppress(OSError, AttributeError, TypeError):  # no libc: Windows
                    import ctypes
                    ctypes.CDLL(None).fflush(None)  # C stdio's buffers land in the sink
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def _same(got, expected) -> bool:
    return len(got) == len(expected) and all(g.shape == e.shape and np.allclose(g, e, **_TOLERANCE)
                                             for g, e in zip(got, expected, strict=True))


class Searcher:
    """FAISS top k of one query row (1, d) -> (scores (k,), indices (k,)), without input checks."""

    def __init__(self, index, k: int):
        self.index, self.k = index, min(int(k), index.ntotal)
        self._scores = np.empty((1, self.k), dtype=np.float32)  # (1, k)
        self._indices = np.empty((1, self.k), dtype=np.int64)  # (1, k)

    def __call__(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.index.search(query, self.k, D=self._scores, I=self._indices)
        return self._scores[0].copy(), self._indices[0].copy()


def probe_captions(tokenizer: QueryTokenizer, caption: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of `caption`, its first word and it repeated to max_length."""
    texts = [caption, caption.split()[0] if caption.split() else caption,
             " ".join([caption] * tokenizer.max_length)]
    return [tuple(a.copy() for a in tokenizer(text)) for text in texts]


class QuerySide:
    """A model's (QueryTokenizer, QueryEncoder), rebuilt only when model or weights change."""

    def __init__(self):
        self.built, self.encoder = {}, None  # arguments -> (model, versions, tokenizer, encoder)

    def get(self, model: nn.Module, tokenizer, probe_caption: str, *, max_length: int = 40,
            backend: str = "auto", encode_name: str = "encode_texts"):
        device = next(model.parameters()).device
        arguments = (str(device), max_length, backend, encode_name)
        # weights changed in place bump _version: a graph of old weights is never served
        versions = sum(p._version for p in model.parameters())
        held, held_versions, query_tokenizer, encoder = self.built.get(arguments, (None,) * 4)
        if held is not model or held_versions != versions:
            query_tokenizer = QueryTokenizer(tokenizer, max_length)
            encoder = QueryEncoder(getattr(model, encode_name),
                                   probe_captions(query_tokenizer, probe_caption),
                                   device=device, backend=backend)
            self.built[arguments] = (model, versions, query_tokenizer, encoder)
        self.encoder = encoder
        return query_tokenizer, encoder


class TextQueryPath:
    """caption -> (scores (k,), indices (k,)), best first, of the encoder's output `output`."""

    def __init__(self, tokenizer: QueryTokenizer, encoder: QueryEncoder, searcher: Searcher,
                 output: int = 0):
        self.tokenizer, self.encoder, self.searcher = tokenizer, encoder, searcher
        self.output = output

    def __call__(self, caption: str) -> tuple[np.ndarray, np.ndarray]:
        return self.searcher(self.encoder(*self.tokenizer(caption))[self.output])

    def stages(self, caption: str) -> list[tuple[str, Callable]]:
        """(name, fn) stages for timing.profile_stages, each fn fed the last one's output."""
        encoder = self.encoder
        return list(zip(STAGES, (lambda _: self.tokenizer(caption), lambda t: encoder.feed(*t),
                                 encoder.run, lambda out: encoder.host(out)[self.output],
                                 self.searcher), strict=True))
