"""Fixed-shape decoding steps compiled once and replayed: torch.compile graphs, CUDA graphs
on a GPU. Shared by the target's and the drafter's static caches and the batch decoders."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compiled_steps(step: Callable, compile: bool) -> Callable:
    """`step` compiled for fixed shapes, one graph per step shape (CUDA graphs on a GPU:
    mode "reduce-overhead"), or `step` itself. torch.compile falls back to eager after 8
    recompiles of one function by default; a decoding loop needs one per step shape."""
    if not compile:
        return step
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def graph_step(*args: object, **kwargs: object):
        # Each call is a new step: CUDA-graph trees may then reuse the previous call's
        # output memory (callers copy what they keep) instead of leaving the fast path
        # (seen on the H200: "Unable to hit fast path of CUDAGraphs").
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return graph_step
