"""The compiled (CPU) passes of the norm engine: jobs of torch (the head vectors C f of a block of tokens) and the
numba kernels of `_kernels`, run on torch's own OpenMP threads (`parallel`). Inputs and outputs are the named
structures built by `norms`; here they only become plain tuples of numpy views (`_kernels.kernel_args`).

The kernels run with subnormal floats flushed to zero (`flush_denormals`): α of long inputs
holds values below 1e-19 whose squares are subnormal, which cost Intel cores ~100 cycles each (one layer of a
512-token input took 7× as long); a flushed term is below 1e-38, far under the float32 rounding of any norm.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from mixlens.methods._kernels import Layout, Maps, TokenResults, attention_pass, kernel_args, token_pass

if TYPE_CHECKING:
    from mixlens.methods.norms import LayerState

PAIRS_PER_CALL = 32768  # (target, source) pairs per attention-pass call when a layer is split over threads


class RunArgs(NamedTuple):
    """The structures every layer of a run shares, as the kernels take them (`kernel_args`), built once per run."""

    layout: tuple  # Layout
    results: tuple  # TokenResults of every layer
    maps: tuple  # Maps
    splits: list[tuple[int, int]]  # the attention pass's row ranges (`row_splits`)

    @classmethod
    def of(cls, layout: Layout, results: TokenResults, maps: Maps, causal: bool) -> RunArgs:
        splits = row_splits(layout.lengths.numpy(), layout.targets.numpy(), causal)
        return cls(kernel_args(layout), kernel_args(results), kernel_args(maps), splits)


def passes(layers: list[LayerState], run: RunArgs, token_block: int, causal: bool) -> None:
    """`token_passes` and then `attention_passes` of every layer in one parallel region. Where the layers split evenly
    over the threads, each thread runs the token jobs and then the attention calls of its own layers (the layers cost
    the same, so nothing waits); else a layer's attention calls become ready once its last token job is done
    (`run_stages`), so no thread waits for the other layers' token jobs."""
    tokens, attention = token_calls(layers, run, token_block), attention_calls(layers, run, causal)
    threads = torch.get_num_threads()
    if threads > 1 and len(layers) % threads == 0:
        run_lists(
            [[c for i in range(k, len(layers), threads) for c in tokens[i] + attention[i]] for k in range(threads)]
        )
    else:
        run_stages(list(zip(tokens, attention, strict=True)))


def token_passes(layers: list[LayerState], run: RunArgs, token_block: int) -> None:
    """Everything per token of every layer: writes the layers' rows of the run's TokenResults and their f_norm,
    ratio and scale in its Maps (the calls of `token_calls`)."""
    parallel([call for calls in token_calls(layers, run, token_block) for call in calls])


def token_calls(layers: list[LayerState], run: RunArgs, token_block: int) -> list[list[tuple]]:
    """Per layer, its token jobs of `token_block` tokens: each job computes its block's head vectors
    C f = v W_O^h C by torch into its thread's own buffer, then runs `token_pass` on them while they are still in that
    core's cache."""
    jobs = []
    for st in layers:
        t_len = st.inputs.v.shape[0]
        args = (st.index, st.kernel_inputs, st.weights.kernel_consts, run.layout, run.results, run.maps)
        jobs.append(
            [
                (_token_job, st.inputs.v, st.weights.w_c, s, min(s + token_block, t_len), args)
                for s in range(0, t_len, token_block)
            ]
        )
    return jobs


def _token_job(v: torch.Tensor, w_c: torch.Tensor, start: int, end: int, args: tuple) -> None:
    """Tokens start .. end - 1 of one layer: C f [H, c, d] of the block (v [T, H, d_h], w_c [H, d_h, d]), then
    `token_pass` on it."""
    h, d = v.shape[1], w_c.shape[-1]
    size = h * (end - start) * d
    vh = v[start:end].transpose(0, 1)  # [H, c, d_h]: a strided view, which the batched matmul reads as it is
    cf = torch.matmul(vh, w_c, out=_scratch(size, v.device)[:size].view(h, end - start, d))
    token_pass(cf.numpy(), start, 0, end - start, *args)


def attention_passes(layers: list[LayerState], run: RunArgs, causal: bool, slot: int | None = None) -> None:
    """The per-(target, source) part of every layer: writes n, n_res, n_resln and alpha_mean of the run's maps (at
    each layer's index, or at `slot`) and the layers' rows of probe_err (after their token passes). All layers' row
    ranges go to `parallel` at once."""
    parallel([call for calls in attention_calls(layers, run, causal, slot) for call in calls])


def attention_calls(layers: list[LayerState], run: RunArgs, causal: bool, slot: int | None = None) -> list[list[tuple]]:
    """Per layer, its `attention_pass` calls over the run's row ranges (`RunArgs.splits`)."""
    return [
        [
            (attention_pass, r0, r1, st.index, st.index if slot is None else slot, causal, st.kernel_inputs)
            + (run.layout, run.results, run.maps)
            for r0, r1 in run.splits
        ]
        for st in layers
    ]


_SCRATCH: dict[tuple[int, str], torch.Tensor] = {}  # (thread, device) → buffer


def _scratch(size: int, device: torch.device) -> torch.Tensor:
    """A flat float buffer of at least `size` elements, kept per thread and device: fresh memory costs page faults
    on every call, about as much as the matmul that fills it. Keyed by the OS thread (an OpenMP worker runs each
    job under a new Python thread state, so `threading.local` would not keep it)."""
    key = (threading.get_ident(), str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        if len(_SCRATCH) >= 4 * (os.cpu_count() or 1):  # threads that have ended leave theirs behind
            _SCRATCH.clear()
        buf = _SCRATCH[key] = torch.empty(size, device=device)
    return buf


@contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush subnormal floats to zero (FTZ/DAZ) on the calling thread for the block, then restore its mode. The mode
    is per thread: read back by a product that is subnormal unless flushing is on."""
    was_on = np.float32(1e-30) * np.float32(1e-10) == 0
    if was_on:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _openmp_team() -> Callable[[Any, Any, int, int], None] | None:
    """GOMP_parallel(fn, data, threads, flags) of the GNU OpenMP runtime torch runs on (Linux), else None. Kernel
    calls started through it run on torch's own intra-op threads: a worker still spinning after torch's last call
    takes them at once, where a thread of ours would share its core with the spinning worker (2 cores: each kernel
    pass ran no faster on two threads than on one)."""
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with Path("/proc/self/maps").open() as fh:
            paths = {line.split()[-1] for line in fh if "libgomp" in line and "/" in line}
        if len(paths) > 1:  # another library brought its own: torch's is the one in torch's folder
            paths = {p for p in paths if p.startswith(str(Path(torch.__file__).parent))}
        lib = ctypes.CDLL(paths.pop()) if len(paths) == 1 else None
        fn = lib.GOMP_parallel if lib is not None else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    return fn


_OUTLINED = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # the body each OpenMP thread runs
_TEAM: dict[str, Callable[[Any, Any, int, int], None] | None] = {}  # "gomp": found when the engine first runs
_POOLS: dict[int, ThreadPoolExecutor] = {}  # helper threads by count, where there is no OpenMP team to use
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads
os.register_at_fork(after_in_child=lambda: _TEAM.update(gomp=None))  # nor a usable OpenMP team


def parallel(calls: list[tuple]) -> None:
    """Run kernel calls (fn, *args) on torch.get_num_threads() threads, the calling one included (torch's OpenMP
    team where there is one, else a pool of ours), each thread taking the next call when it is free, subnormals
    flushed to zero. Each call must write its own part of the outputs."""
    run_stages([(calls, [])])


def run_stages(stages: list[tuple[list[tuple], list[tuple]]]) -> None:
    """`parallel` over stages (first, then): the `then` calls of a stage are ready once all its `first` calls are
    done (and go ahead of the other ready calls); every other call is ready at once. Errors of any call are raised
    here once the threads have stopped."""
    ready: deque[tuple[int, tuple]] = deque((k, call) for k, (first, _) in enumerate(stages) for call in first)
    left = [len(first) for first, _ in stages]  # first calls of each stage not yet done
    for first, then in stages:
        if not first:
            ready.extend((-1, call) for call in then)
    total = sum(len(first) + len(then) for first, then in stages)
    done = [0]
    cond = threading.Condition()
    errors: list[BaseException] = []

    def work(_: object = None) -> None:
        try:
            with flush_denormals():
                while True:
                    with cond:
                        while not ready and done[0] < total and not errors:
                            cond.wait()
                        if errors or not ready:
                            return
                        k, call = ready.popleft()
                    call[0](*call[1:])
                    with cond:
                        done[0] += 1
                        if k >= 0:
                            left[k] -= 1
                            if left[k] == 0:
                                ready.extendleft((-1, c) for c in reversed(stages[k][1]))
                        cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            with cond:
                errors.append(e)
                cond.notify_all()

    _launch(work, min(torch.get_num_threads(), total))
    if errors:
        raise errors[0]


def run_lists(lists: list[list[tuple]]) -> None:
    """Each list of kernel calls (fn, *args) on a thread of its own (torch's OpenMP team, else a pool of ours), in
    order, subnormals flushed to zero; no thread waits for another. Errors of any call are raised here once the
    threads have stopped."""
    pending, errors = list(lists), []

    def work(_: object = None) -> None:
        try:
            with flush_denormals():
                while True:
                    try:
                        calls = pending.pop()  # list.pop holds the GIL: each list goes to one thread
                    except IndexError:
                        return
                    for call in calls:
                        call[0](*call[1:])
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(e)

    _launch(work, len(lists))
    if errors:
        raise errors[0]


def _launch(work: Callable[..., None], threads: int) -> None:
    """`work()` on `threads` threads at once, the calling one included: torch's OpenMP team where there is one, else
    a pool of ours."""
    if "gomp" not in _TEAM:  # found when the engine first runs, not at import
        _TEAM["gomp"] = _openmp_team()
    gomp = _TEAM["gomp"]
    if threads <= 1:
        work()
    elif gomp is not None:
        gomp(_OUTLINED(work), None, threads, 0)
    else:
        if threads - 1 not in _POOLS:
            _POOLS[threads - 1] = ThreadPoolExecutor(threads - 1, thread_name_prefix="mixlens")
        helpers = [_POOLS[threads - 1].submit(work) for _ in range(threads - 1)]
        work()
        for fut in helpers:
            fut.result()


def row_splits(lengths: np.ndarray, targets: np.ndarray, causal: bool) -> list[tuple[int, int]]:
    """Split the flattened [B·K] target rows (positions `targets` [B, K]) into ranges of about PAIRS_PER_CALL
    (target, source) pairs each (one range when torch runs on one thread)."""
    cost = np.where(targets < lengths[:, None], (targets + 1) if causal else lengths[:, None], 0).ravel()
    total = int(cost.sum())
    parts = 1 if torch.get_num_threads() == 1 else max(1, total // PAIRS_PER_CALL)
    edges = np.searchsorted(np.cumsum(cost), np.linspace(0, total, parts + 1)[1:-1])
    bounds = [0, *sorted(set(int(e) + 1 for e in edges)), cost.size]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
