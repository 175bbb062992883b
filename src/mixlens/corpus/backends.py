"""Where shards are computed, behind one `Backend` protocol: in-process (`LocalBackend`), local worker processes
(`ProcessBackend`), or Ray actors (`RayBackend`; Ray is optional: `pip install mixlens[ray]`).

Workers return each shard's Parquet bytes; the driver writes every file, so the output directory need not be
on a filesystem the workers share.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, cast

import torch

from mixlens.corpus.compute import compute_shard
from mixlens.corpus.job import Job
from mixlens.corpus.readers import Example
from mixlens.errors import MixlensError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mixlens.lens import Lens


class Backend(Protocol):
    """Computes submitted shards; `capacity` shards may be in flight before the driver collects one."""

    capacity: int

    def submit(self, shard_id: int, examples: list[Example]) -> None: ...

    def pending(self) -> int: ...

    def next_done(self) -> tuple[int, bytes, dict]:
        """(shard id, Parquet bytes, info) of a finished shard; blocks until one is done."""
        ...

    def close(self) -> None: ...


class LocalBackend:
    """In-process: each shard is computed when submitted."""

    def __init__(self, lens, job: Job, on_batch: Callable[[int], None] | None = None) -> None:
        self.lens, self.job, self.on_batch = lens, job, on_batch
        self.done: deque[tuple[int, bytes, dict]] = deque()
        self.capacity = 1

    def submit(self, shard_id: int, examples: list[Example]) -> None:
        self.done.append((shard_id, *compute_shard(self.lens, self.job, shard_id, examples, self.on_batch)))

    def pending(self) -> int:
        return len(self.done)

    def next_done(self) -> tuple[int, bytes, dict]:
        return self.done.popleft()

    def close(self) -> None:
        pass


_WORKER_LENS: Lens | MixlensError | None = None  # the worker process's Lens, or the MixlensError that loading it raised


def _init_worker(job: Job, threads: int) -> None:
    global _WORKER_LENS
    torch.set_num_threads(threads)
    try:
        _WORKER_LENS = job.load()
    except MixlensError as e:  # re-raised with each task, so the user sees the message, not a broken pool
        _WORKER_LENS = e


def _worker_compute(job: Job, shard_id: int, examples: list[Example]) -> tuple[int, bytes, dict]:
    if isinstance(_WORKER_LENS, MixlensError):
        raise _WORKER_LENS
    assert _WORKER_LENS is not None  # set by _init_worker before any task
    return (shard_id, *compute_shard(_WORKER_LENS, job, shard_id, examples))


class ProcessBackend:
    """N local worker processes (spawned, each holding the model); at most 2 shards in flight per worker."""

    def __init__(self, job: Job, workers: int) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // workers)
        self.pool = ProcessPoolExecutor(
            workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(job, threads)
        )
        self.futures: set[Future[tuple[int, bytes, dict]]] = set()
        self.job, self.capacity = job, 2 * workers

    def submit(self, shard_id: int, examples: list[Example]) -> None:
        self.futures.add(self.pool.submit(_worker_compute, self.job, shard_id, examples))

    def pending(self) -> int:
        return len(self.futures)

    def next_done(self) -> tuple[int, bytes, dict]:
        from concurrent.futures import FIRST_COMPLETED, wait

        done, _ = wait(self.futures, return_when=FIRST_COMPLETED)
        f = next(iter(done))
        self.futures.discard(f)
        return f.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """`workers` actors (default: one per CPU of the cluster, or one per GPU with a CUDA device)."""

    def __init__(self, job: Job, workers: int | None, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise MixlensError("--backend ray needs Ray: pip install 'mixlens[ray]'") from None
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise MixlensError(
                    f"cannot connect to Ray at {address or 'a new local cluster'}: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from None
        gpu = job.device.startswith("cuda")
        res = ray.cluster_resources()
        n = workers or max(1, int(res.get("GPU" if gpu else "CPU", 1)))
        actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)(_ShardActor)
        # remote() is typed as handle-or-class; on an actor class it returns a handle
        self.actors = [cast("ActorHandle[_ShardActor]", actor.remote(job)) for _ in range(n)]
        self.refs: dict = {}  # ObjectRef → actor slot
        self.capacity = 2 * n
        self.load = [0] * n

    def submit(self, shard_id: int, examples: list[Example]) -> None:
        slot = min(range(len(self.actors)), key=lambda k: self.load[k])
        self.load[slot] += 1
        self.refs[self.actors[slot].run.remote(shard_id, examples)] = slot

    def pending(self) -> int:
        return len(self.refs)

    def next_done(self) -> tuple[int, bytes, dict]:
        [ref], _ = self.ray.wait(list(self.refs), num_returns=1)
        self.load[self.refs.pop(ref)] -= 1
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, MixlensError):  # e.g. a model path the actors cannot load
                raise MixlensError(str(e.cause)) from None
            raise

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if self.started:
            self.ray.shutdown()


class _ShardActor:
    """Holds one loaded model; computes shards (one torch thread per CPU it was given)."""

    def __init__(self, job: Job) -> None:
        import torch

        torch.set_num_threads(1)
        self.job = job
        self.lens: Lens | MixlensError
        try:
            self.lens = job.load()
        except MixlensError as e:  # raised again by each task, where the driver turns it into one line
            self.lens = e

    def run(self, shard_id: int, examples: list[Example]) -> tuple[int, bytes, dict]:
        if isinstance(self.lens, MixlensError):
            raise self.lens
        return (shard_id, *compute_shard(self.lens, self.job, shard_id, examples))
