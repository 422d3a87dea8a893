"""One text query on every device this machine has: the check that the GPU path of notebook 03
(section 10) is real, runnable where a notebook is not (a GPU box without Jupyter).

Times each LightningDOT query path (course_lib.core.serving) over a 1k gallery, checks each
returns the reference path's top 10, profiles the default path and times the cross-encoder's query.

    python -m course_lib.studies.gpu_query [--repeats 200] [--out gpu_query.json]"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from course_lib.core.checkpoints import model_device
from course_lib.core.retrieval import build_index
from course_lib.core.serving import Searcher, TextQueryPath
from course_lib.core.settings import describe_environment, seed_everything, smoke_mode
from course_lib.core.timing import measure, profile_stages
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.encoding import encode_gallery
from course_lib.methods.registry import available_methods

BACKENDS = {"cpu": ("reference", "eager", "jit", "onnx"),
            "cuda": ("reference", "eager", "jit", "cuda_graph")}


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def query_paths(method, split, device: str, repeats: int = 200) -> dict:
    """{backend: timings and "same_top10", or "error"; "profile": the default path's stages}."""
    with _moved(method.model, device):
        reference = method.query_fn(split, backend="reference")()
        found = {}
        for backend in BACKENDS[device]:
            try:
                fn = method.query_fn(split, backend=backend)
            except RuntimeError as error:  # e.g. no ONNX Runtime, no C++ compiler
                found[backend] = {"error": str(error)}
                continue
            timed = measure(fn, warmup=20, repeats=repeats, device=device)
            found[backend] = {"median_ms": timed.median_ms, "p25_ms": timed.p25_ms,
                              "p75_ms": timed.p75_ms,
                              "same_top10": bool(np.array_equal(fn(), reference))}
        caption = split.captions[0]
        tokens, encoder = method.query_side(caption)
        searcher = Searcher(build_index(encode_gallery(method.model, split)), 10)
        profile = profile_stages(TextQueryPath(tokens, encoder, searcher).stages(caption),
                                 query_fn=method.query_fn(split), repeats=repeats, device=device)
        found["profile"] = {"backend": encoder.backend, "table": profile.table(),
                            "stages": profile.stages, "total_ms": profile.total.median_ms}
        return found


def query_ms(method, split, device: str, repeats: int = 20) -> dict:
    """One text query of a method without a lean path (the cross-encoder) on `device`."""
    with _moved(method.model, device):
        timed = measure(method.query_fn(split), warmup=3, repeats=repeats, device=device)
    return {"median_ms": timed.median_ms, "p25_ms": timed.p25_ms, "p75_ms": timed.p75_ms}


@contextmanager
def _moved(model, device: str):
    home = model_device(model)
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


def format_report(report: dict) -> str:
    lines = []
    for device in devices():
        paths, cross = report[device]["lightningdot"], report[device]["cross_encoder"]
        timings = {backend: row for backend, row in paths.items() if backend != "profile"}
        lines.append(f"\n{device}: one text query against {report['n_images']:,} images, median of "
                     f"{report['repeats']} calls")
        for backend, row in timings.items():
            timed = (f"{row['median_ms']:.3f} ms (IQR {row['p25_ms']:.3f}-{row['p75_ms']:.3f}), "
                     f"same top 10: {row['same_top10']}" if "median_ms" in row
                     else f"not available: {row['error']}")
            lines.append(f"  lightningdot {backend:<11} " + timed)
        fastest = min(row["median_ms"] for row in timings.values() if "median_ms" in row)
        lines += [f"  cross_encoder          {cross['median_ms']:.3f} ms: "
                  f"{cross['median_ms'] / fastest:,.0f}x the fastest LightningDOT path",
                  f"  profile of the default path (encoder backend "
                  f"{paths['profile']['backend']!r}):", paths["profile"]["table"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per path")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    seed_everything(0)
    bench = make_benchmark(SyntheticConfig.smoke() if smoke_mode() else SyntheticConfig(), seed=0)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    split = bench["test"]
    names = ["lightningdot", "cross_encoder"]
    methods = {m.name: m for m in available_methods(0, smoke_mode(), names=names)}
    for method in methods.values():
        method.fit(bench, tokenizer, cache_dir=Path("outputs/checkpoints"))
    report = {"environment": describe_environment(), "n_images": split.n_images,
              "repeats": args.repeats, "shipped": {n: m.from_shipped for n, m in methods.items()}}
    for device in devices():
        paths = query_paths(methods["lightningdot"], split, device, args.repeats)
        report[device] = {"lightningdot": paths,
                          "cross_encoder": query_ms(methods["cross_encoder"], split, device)}
    print(report["environment"])
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
