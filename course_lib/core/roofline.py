"""The arithmetic floor of a query: how many floating-point operations it does, how fast this
machine does them, and so how long it could take at best (its roofline). Notebook 03 (section 10)
sets one query's measured time beside the encoder's FLOPs at the single-thread matmul rate."""

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
    """2 Q N dim: multiplies and adds of exact search."""
    return 2 * int(n_queries) * int(n_items) * int(dim)


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Q K^T and A V of (B, h, L, d) queries over S keys: 2 B h L S (d + d_v) (torch's counter
    knows only the fused kernels, which the CPU does not use)."""
    *batch, L, d = query
    S, d_v = key[-2], value[-1]
    return 2 * int(np.prod(batch)) * L * S * (d + d_v)


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one fn() call: 2 per multiply-add of matmuls, convolutions and attention."""
    from torch.utils.flop_counter import FlopCounterMode
    # counted whole: the overload stops the decomposition, the packet counts
    sdpa = torch.ops.aten.scaled_dot_product_attention
    attention = {sdpa.default: _attention_flops, sdpa: _attention_flops}
    with (torch.inference_mode(),
          FlopCounterMode(display=False, custom_mapping=attention) as counter):
        fn()
    return int(counter.get_total_flops())


def count_operators(fn: Callable[[], object]) -> int:
    """ATen operators one fn() call dispatches (views included): what eager execution pays for."""
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
    """Median GFLOP/s of a square float32 torch.mm on `threads` threads (None: as set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(before if threads is None else threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
        out = torch.empty(size, size)
        result = measure(lambda: torch.mm(a, b, out=out), warmup=3, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return gflops(2 * size ** 3, result.median_ms)


def roofline_ms(flops: float, rate_gflops: float) -> float:
    """Milliseconds `flops` take at `rate_gflops`: the least they can cost."""
    if rate_gflops <= 0:
        raise ValueError(f"a rate must be positive, got {rate_gflops} GFLOP/s")
    return flops / (rate_gflops * 1e9) * 1e3
