"""The compiled (CPU) passes of the norm engine: torch computes the head vectors C f in blocks, the numba kernels of
`_kernels` do the rest on torch's threads (`parallel`). Inputs and outputs are the named structures built by
`norms`; here they only become plain tuples of numpy views (`_kernels.kernel_args`).

torch's OpenMP workers spin for about 10 ms after each torch call, so each group's torch work goes first and its
compiled work after it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from mixlens.methods._kernels import Maps, TokenResults, attention_pass, kernel_args, token_pass

if TYPE_CHECKING:
    from mixlens.methods.norms import LayerState, RealTokens

PAIRS_PER_CALL = 32768  # (target, source) pairs per attention-pass call when a layer is split over threads
TOKENS_PER_CALL = 32  # tokens per token-pass call when a block is split over threads


def token_passes(layers: list[LayerState], tok: RealTokens, maps: Maps, token_block: int, cf_budget: int) -> None:
    """Everything per token of every layer (sets each layer's `results` and writes f_norm, ratio and scale of `maps`).

    C f = v W_O^h C by torch for blocks of `token_block` tokens of many layers first (up to `cf_budget` floats), then
    `token_pass` over all those blocks on torch's threads, so that torch's spinning OpenMP workers are in the way
    only once per group."""
    where, out = kernel_args(tok.layout), kernel_args(maps)
    args, jobs = {}, []
    for st in layers:
        h, t_len, _ = st.inputs.vh.shape
        p = st.weights.consts.probes.shape[0]
        new = st.inputs.vh.new_empty
        st.results = TokenResults(
            grams=new(2, h * (h + 1) // 2, t_len),
            probe_f=new(h, p, t_len),
            diag=new(2, t_len),
            total_r=new(t_len, p),
            check=new(2, t_len),
            probe_err=new(t_len) if tok.all_rows else st.inputs.vh.new_zeros(t_len),
        )
        args[st.index] = (
            st.index,
            kernel_args(st.inputs),
            kernel_args(st.weights.consts),
            where,
            kernel_args(st.results),
            out,
        )
        jobs += [(st, s, min(s + token_block, t_len)) for s in range(0, t_len, token_block)]
    for group in _groups(jobs, cf_budget):
        sizes = [st.inputs.vh.shape[0] * (e - s) * st.weights.w_c.shape[-1] for st, s, e in group]
        space, at, cfs = _scratch(sum(sizes), tok.mask.device), 0, []
        for (st, s, e), size in zip(group, sizes, strict=True):
            cf = space[at : at + size].view(st.inputs.vh.shape[0], e - s, -1)  # [H, c, d], a view of one buffer
            cfs.append(torch.matmul(st.inputs.vh[:, s:e], st.weights.w_c, out=cf))
            at += size
        parallel(
            [
                (token_pass, cf.numpy(), s, a, b, *args[st.index])
                for (st, s, e), cf in zip(group, cfs, strict=True)
                for a, b in token_splits(e - s)
            ]
        )


def attention_passes(layers: list[LayerState], tok: RealTokens, maps: Maps, causal: bool) -> None:
    """The per-(target, source) part of every layer: writes n, n_res, n_resln and alpha_mean of `maps` and each
    layer's results.probe_err. All layers' row ranges go to the threads of `parallel` at once."""
    where, out = kernel_args(tok.layout), kernel_args(maps)
    splits = row_splits(tok.layout.lengths.numpy(), tok.layout.targets.numpy(), causal)
    per_layer = [(st.index, kernel_args(st.inputs), kernel_args(st.done)) for st in layers]
    parallel(
        [
            (attention_pass, r0, r1, index, causal, inputs, where, results, out)
            for index, inputs, results in per_layer
            for r0, r1 in splits
        ]
    )


def _groups(jobs: list[tuple[LayerState, int, int]], cf_budget: int) -> list[list[tuple[LayerState, int, int]]]:
    """(layer, first token, end token) blocks in consecutive groups of at most `cf_budget` floats of C f each."""
    groups: list[list[tuple[LayerState, int, int]]] = [[]]
    size = 0
    for st, s, e in jobs:
        floats = st.inputs.vh.shape[0] * (e - s) * st.weights.w_c.shape[-1]
        if groups[-1] and size + floats > cf_budget:
            groups.append([])
            size = 0
        groups[-1].append((st, s, e))
        size += floats
    return groups


_SCRATCH = threading.local()


def _scratch(size: int, device: torch.device) -> torch.Tensor:
    """A flat float buffer of at least `size` elements, kept per thread and device: fresh memory costs page faults
    on every call, about as much as the matmul that fills it."""
    buf = getattr(_SCRATCH, str(device), None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(size, device=device)
        setattr(_SCRATCH, str(device), buf)
    return buf


_POOLS: dict[int, ThreadPoolExecutor] = {}  # helper threads by count
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads


def parallel(calls: list[tuple]) -> None:
    """Run kernel calls (fn, *args) on torch.get_num_threads() threads, the calling one included, each thread taking
    the next call when it is free (a core still held by torch's spinning OpenMP workers then simply takes fewer).
    Each call must write its own part of the outputs."""
    threads = min(torch.get_num_threads(), len(calls))
    if threads <= 1:
        for fn, *args in calls:
            fn(*args)
        return
    if threads - 1 not in _POOLS:
        _POOLS[threads - 1] = ThreadPoolExecutor(threads - 1, thread_name_prefix="mixlens")
    todo = iter(calls)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                call = next(todo, None)
            if call is None:
                return
            call[0](*call[1:])

    helpers = [_POOLS[threads - 1].submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for fut in helpers:
            fut.result()


def token_splits(count: int) -> list[tuple[int, int]]:
    """[0, count) in ranges of TOKENS_PER_CALL (one range when torch runs on one thread)."""
    step = count if torch.get_num_threads() == 1 else TOKENS_PER_CALL
    return [(a, min(a + step, count)) for a in range(0, count, step)]


def row_splits(lengths: np.ndarray, targets: np.ndarray, causal: bool) -> list[tuple[int, int]]:
    """Split the flattened [B·K] target rows (positions `targets` [B, K]) into ranges of about PAIRS_PER_CALL
    (target, source) pairs each (one range when torch runs on one thread)."""
    cost = np.where(targets < lengths[:, None], (targets + 1) if causal else lengths[:, None], 0).ravel()
    total = int(cost.sum())
    parts = 1 if torch.get_num_threads() == 1 else max(1, total // PAIRS_PER_CALL)
    edges = np.searchsorted(np.cumsum(cost), np.linspace(0, total, parts + 1)[1:-1])
    bounds = [0, *sorted(set(int(e) + 1 for e in edges)), cost.size]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
