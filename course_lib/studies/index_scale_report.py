"""The index-of-millions study's results as the Markdown tables of its results.md and
docs/index_scale.md: build, storage, recall vs latency, exact search vs matrix multiply."""

from __future__ import annotations


def _params_text(row: dict) -> str:
    text = ", ".join(f"{key}={value}" for key, value in row["params"].items()) or "exact"
    return text + (f"; trained on {row['train_size']:,}" if row.get("train_size") else "")


def _table(header: list[str], rows: list[list], numeric_from: int = 0) -> list[str]:
    """Markdown table lines; columns from numeric_from on right-aligned."""
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    return [f"| {' | '.join(map(str, cells))} |" for cells in [header, align, *rows]]


def results_markdown(results: dict) -> str:
    """The study's tables as Markdown, ready for docs/index_scale.md."""
    meta, q = results["meta"], results["meta"]["queries"]
    sizes = ", ".join(f"{n:,}" for n in meta["sizes"])
    load = meta["load_average_start_end"]
    head = (f"Device `{meta['device']}` ({meta['cpu']}), torch {meta['torch']}, faiss "
            f"{meta['faiss']}, {meta['torch_threads']} torch / {meta['faiss_threads']} FAISS "
            f"thread(s); galleries of {sizes} items, {q:,} queries, k = {meta['k']}, E = "
            f"{meta['dim']}; {meta['seconds']} s in all, peak memory {meta['peak_rss_gb']} GB, "
            f"load average {load[0]} at the start and {load[1]} at the end (mode "
            f"`{meta['mode']}`).")
    source = (f"Embeddings: {meta['embeddings']}. Gallery: {meta['gallery']}. Queries: held-out "
              "test captions. Recall: k-recall@10 against the flat index's exact top 10.")
    rows = [[f"{r['n']:,}", r["kind"], _params_text(r), f"{r['build_s']:.1f}",
             f"{r['bytes_per_item']:.1f}", f"{r['recall_at_k']:.3f}", f"{r['ms_single']:.3g}",
             f"{r['ms_batched']:.3g}"] for r in results["indexes"]]
    rows += [[f"{s['n']:,}", s["kind"], f"skipped: {s['reason']}", "–", "–", "–", "–", "–"]
             for s in results["skipped"]]
    lines = [head, "", source, ""] + _table(
        ["n", "index", "parameters", "build s", "bytes / item", "recall@10",
         "ms / query, one at a time", f"ms / query, batch of {q:,}"], rows, numeric_from=3)
    storage = [[f"{r['n']:,}", r["kind"], r["code_bytes"],
                f"{4 * meta['dim'] / r['code_bytes']:.0f}x", f"{r['bytes_per_item']:.1f}"]
               for r in results["indexes"]]
    lines += ["", ("**Storage**: bytes per item, the vector's code alone and the whole serialised "
                   "index (ids, lists, graph links, centroids and codebooks included)"), ""]
    lines += _table(["n", "index", "code bytes", "float32 / code", "index bytes / item"],
                    storage, 2)
    sweep = [[f"{p['n']:,}", p["kind"], f"{p['knob']}={p['value']}", f"{p['recall_at_k']:.3f}",
              f"{p['ms_single']:.3g}", f"{p['ms_batched']:.3g}"] for p in results["sweep"]]
    lines += ["", "**Recall vs latency** as the search-time knob varies (the same built indexes)",
              "", *_table(["n", "index", "setting", "recall@10", "ms / query, one at a time",
                           "ms / query, batched"], sweep, 3)]
    threshold = meta["blas_threshold"]
    exact = [[f"{e['n']:,}", f"{e['queries']:,}", f"{e['gflop']:.1f}", f"{e['mm_gflops']:.1f}",
              f"{e['faiss_ms']:.0f}", f"{e['faiss_gflops']:.1f}", f"{e['fraction']:.2f}",
              "–" if e["default_ms"] is None else f"{e['default_ms']:.0f}",
              "–" if e["default_fraction"] is None else f"{e['default_fraction']:.2f}"]
             for e in results["exact_vs_mm"]]
    lines += ["", (f"**Exact batched search vs matrix multiply**: 2 Q N E flops; torch.mm of the "
                   f"same (Q, E) x (E, N) shape on the same threads. FAISS switches from its own "
                   f"loop to BLAS at Q E >= distance_compute_blas_threshold: {threshold['used']:,} "
                   f"in this study, {threshold['faiss_default']:,} by default (timed up to n = "
                   f"{threshold['default_timed_up_to']:,})"), ""]
    lines += _table(["n", "Q", "GFLOP", "torch.mm GFLOP/s", "FAISS ms", "FAISS GFLOP/s",
                     "fraction of mm", "FAISS ms, default switch", "fraction, default switch"],
                    exact)
    return "\n".join(lines) + "\n"
