"""Ray backend: actors that each hold the model compute whole shards; the driver writes every file.

The driver streams the input and submits shards (at most 2 in flight per actor); actors return the
shard's Parquet bytes, so DIR need not be on a filesystem the cluster shares. Ray is optional:
`pip install mixlens[ray]`.
"""

from __future__ import annotations

from typing import Any

from mixlens.corpus.readers import Example
from mixlens.errors import MixlensError


class RayBackend:
    """`workers` actors (default: one per CPU of the cluster, or one per GPU with a CUDA device)."""

    def __init__(self, job, workers: int | None, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise MixlensError("--backend ray needs Ray: pip install 'mixlens[ray]'") from None
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise MixlensError(f"cannot connect to Ray at {address or 'a new local cluster'}: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        gpu = job.device.startswith("cuda")
        res = ray.cluster_resources()
        n = workers or max(1, int(res.get("GPU" if gpu else "CPU", 1)))
        actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)(_ShardActor)
        self.actors: list[Any] = [actor.remote(job) for _ in range(n)]  # ray ActorHandles
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

    def __init__(self, job) -> None:
        import torch

        from mixlens.lens import load

        torch.set_num_threads(1)
        self.job = job
        self.lens: Any  # the loaded Lens, or the MixlensError that loading raised
        try:
            self.lens = load(job.model, head=job.head, device=job.device, allow_random_head=job.allow_random_head)
        except MixlensError as e:  # raised again by each task, where the driver turns it into one line
            self.lens = e

    def run(self, shard_id: int, examples: list[Example]) -> tuple[int, bytes, dict]:
        from mixlens.corpus.runner import compute_shard

        if isinstance(self.lens, MixlensError):
            raise self.lens
        return (shard_id, *compute_shard(self.lens, self.job, shard_id, examples))
