"""The arithmetic floor of a query: how many floating-point operations it does, how fast this
machine does them, and so how long it could take at best (its roofline).

    count_flops(fn)                 2 x the multiply-adds of fn's matrix products and attention
                                    (torch's FlopCounterMode; element-wise work, a few percent of
                                    a transformer's FLOPs, is not counted)
    count_operators(fn)             the ATen operators fn dispatches: what eager execution pays for
    matmul_gflops(size, threads=1)  measured GFLOP/s of a square float32 torch.mm on this machine
    roofline_ms(flops, gflops)      the time those FLOPs take at that rate
    exact_search_flops(q, n, dim)   2 q n dim: exact search of q queries over n items
    gflops(flops, ms)               the rate of flops done in ms

Notebook 03 (section 10) sets one query's measured time beside its roofline: the encoder's FLOPs
at this machine's single-thread matmul rate, plus the search."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from course_lib.core.timing import measure


def gflops(flops: float, ms: float) -> float:
    """GFLOP/s of `flops` done in `ms` milliseconds."""
    if ms <= 0:
        raise ValueError(f"a time must be positive, got {ms} ms")
    return flops / (ms / 1e3) / 1e9


def exact_search_flops(n_queries: int, n_items: int, dim: int) -> int:
    """Multiplies and adds of exact search: each of Q x N scores is a dim-long dot product."""
    return 2 * int(n_queries) * int(n_items) * int(dim)


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Q K^T and A V of (B, h, L, d) queries over S keys: 2 B h L S (d + d_v). torch's counter
    knows the fused kernels only, and on the CPU the composite op reaches it unfused."""
    *batch, L, d = query
    S, d_v = key[-2], value[-1]
    return 2 * int(np.prod(batch)) * L * S * (d + d_v)


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one fn() call, as torch.utils.flop_counter counts them (matmuls, convolutions,
    attention: 2 per multiply-add), under inference_mode."""
    from torch.utils.flop_counter import FlopCounterMode

    # counted whole: the overload stops the decomposition, the packet counts
    sdpa = torch.ops.aten.scaled_dot_product_attention
    attention = {sdpa.default: _attention_flops, sdpa: _attention_flops}
    with (torch.inference_mode(),
          FlopCounterMode(display=False, custom_mapping=attention) as counter):
        fn()
    return int(counter.get_total_flops())


def count_operators(fn: Callable[[], object]) -> int:
    """ATen operators one fn() call dispatches, under inference_mode: in eager PyTorch each is a
    trip from Python through the dispatcher, on a GPU a kernel launch (views, reshapes included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Count() as counter:
        fn()
    return counter.calls


def matmul_gflops(size: int = 256, threads: int | None = 1, repeats: int = 20) -> float:
    """GFLOP/s of a (size, size) x (size, size) float32 torch.mm on `threads` torch threads (None:
    the current setting; restored after): the rate BLAS reaches on one core when the matrices hide
    every overhead. The median of `repeats` products."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
        out = torch.empty(size, size)
        result = measure(lambda: torch.mm(a, b, out=out), warmup=3, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return gflops(2 * size ** 3, result.median_ms)


def roofline_ms(flops: float, rate_gflops: float) -> float:
    """Milliseconds `flops` take at `rate_gflops`: the least a computation of them can cost."""
    if rate_gflops <= 0:
        raise ValueError(f"a rate must be positive, got {rate_gflops} GFLOP/s")
    return flops / (rate_gflops * 1e9) * 1e3


__all__ = ["gflops", "exact_search_flops", "count_flops", "count_operators", "matmul_gflops",
           "roofline_ms"]
