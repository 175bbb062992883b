"""Run registered methods over a corpus: stream → shards → length-sorted batches → Parquet + partial sums.

The input stream is cut into shards of `shard_size` readable examples, in input order; a shard is the
sorting window (examples are sorted by token length inside it and packed into batches of at most
`batch_size` examples and `max_tokens` padded tokens). Shards are independent units of work, so the
same shard gives the same result in-process, in a worker process or on a Ray actor, and a rerun skips
the shards whose files already exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from mixlens.corpus import shards as sh
from mixlens.corpus.readers import Example, ReadStats, count_records, examples_from, open_records, resolve_columns
from mixlens.errors import MixlensError
from mixlens.methods import get as get_method
from mixlens.methods.norms import RATIO_VARIANTS, block_norms
from mixlens.stats.tokens import row_entropy, token_kinds, token_type_masses

if TYPE_CHECKING:
    from mixlens.corpus.ray_backend import RayBackend

STORES = ("summary", "full")
BACKENDS = ("local", "ray")
# Keys of the job that change results: a rerun with other values is refused unless --overwrite.
IDENTITY = ("model", "head", "data", "fmt", "text_column", "pair_column", "methods", "heads", "options", "store",
            "shard_size", "max_length")


@dataclass(frozen=True)
class Job:
    """What to compute. `model` is what workers load (None = bundled); `model_name` identifies it."""

    model: str | None
    model_name: str
    data: str
    fmt: str | None
    text_column: str
    pair_column: str | None
    methods: tuple[str, ...]
    heads: bool = False
    options: dict[str, dict[str, object]] = field(default_factory=dict)
    store: str = "summary"
    shard_size: int = 256
    max_length: int | None = None
    batch_size: int = 32
    max_tokens: int = 8192
    head: str | None = None  # model head class for `mixlens.load`
    device: str = "cpu"
    allow_random_head: bool = False  # `mixlens.load(allow_random_head=...)`

    def identity(self) -> dict[str, object]:
        d = asdict(self)
        d["model"] = self.model_name
        d["methods"] = list(self.methods)
        return {k: d[k] for k in IDENTITY}

    @property
    def job_id(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- one shard


def plan_batches(lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Positions grouped into batches, longest first: ≤ batch_size items and ≤ max_tokens padded tokens
    (an input longer than max_tokens gets a batch of its own). Ties keep input order (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    for k in order:
        b = batches[-1] if batches else None
        if b is not None and len(b) < batch_size and (len(b) + 1) * lengths[b[0]] <= max_tokens:
            b.append(k)
        else:
            batches.append([k])
    return batches


def _rows_normalised(values: torch.Tensor) -> torch.Tensor:
    """|A| with each row scaled to sum to 1 (padded rows stay 0): [..., target, source]."""
    a = values.float().abs()
    return a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)


def _nested(a: np.ndarray) -> pa.Array:
    """[rows, d1, d2, ...] → nested fixed-size lists (one row per example)."""
    out = pa.array(a.reshape(-1))
    for size in reversed(a.shape[1:]):
        out = pa.FixedSizeListArray.from_arrays(out, size)
    return out


def _has_maps(dims: tuple[str, ...]) -> bool:
    return dims[:1] == ("layer",) and dims[-2:] == ("target", "source")


def compute_shard(lens, job: Job, shard_id: int, examples: list[Example],
                  on_batch: Callable[[int], None] | None = None) -> tuple[bytes, dict]:
    """Run the job's methods over one shard; returns (Parquet bytes with partial sums in metadata, info).

    Per example (row): index, text(s), fields (JSON), n_tokens, truncated_from, per-layer mean mixing ratio
    per variant [L], reconstruction error [L], and per method with [layer, (head,) target, source] maps the
    per-layer entropy and token-type masses of the row-normalised |map| ([L], or [L][H] under
    `<method>.heads.*`); store=full adds the tokens and each method's matrix flattened with its shape.
    """
    specs = [get_method(m) for m in job.methods]
    firsts = [e.text[0] if isinstance(e.text, tuple) else e.text for e in examples]
    pairs = [e.text[1] for e in examples] if isinstance(examples[0].text, tuple) else None
    limit = min(job.max_length or lens.max_length, lens.max_length)
    lengths = [min(len(ids), limit) for ids in lens.tokenizer(firsts, pairs, truncation=False)["input_ids"]]
    n_ex = len(examples)
    summary: dict[str, np.ndarray] = {}  # column → [examples, layer(, head)]
    samples: dict[tuple[str, str, int], list[np.ndarray]] = {}  # (stat, method, ndim) → [samples, layer(, head)]
    n_tokens, trunc_from = np.zeros(n_ex, np.int64), np.zeros(n_ex, np.int64)
    tokens: list[list[str]] = [[] for _ in range(n_ex)]
    full: dict[str, list[np.ndarray]] = {s.name: [np.empty(0)] * n_ex for s in specs} if job.store == "full" else {}
    shapes: dict[str, list[list[int]]] = {s.name: [[]] * n_ex for s in specs}

    def put(column: str, stat: str, method: str, pos: list[int], values: np.ndarray) -> None:
        if column not in summary:
            summary[column] = np.zeros((n_ex, *values.shape[1:]), np.float32)
        summary[column][pos] = values
        samples.setdefault((stat, method, values.ndim), []).append(values)

    for batch in plan_batches(lengths, job.batch_size, job.max_tokens):
        enc = lens.encode([examples[k].text for k in batch], job.max_length, truncate=True)
        tr = lens.trace(enc, ffn=any(s.needs_ffn for s in specs), full=any(s.needs_output for s in specs))
        mask = tr.mask
        n_tok = mask.sum(1)
        n_tokens[batch] = n_tok.cpu().numpy()
        trunc_from[batch] = enc.truncated
        with torch.no_grad():
            bn = block_norms(tr)
            outs = {s.name: s(tr, heads=job.heads, **job.options.get(s.name, {})) for s in specs}
            summed = {s.name: s(tr, heads=False, **job.options.get(s.name, {})) for s in specs
                      if job.heads and s.head_dims}
            kinds = token_kinds(lens, enc.inputs["input_ids"], mask)
            put("recon_error", "reconstruction_error", "", batch, bn.error.cpu().numpy())
            tok_mask = mask.cpu()
            for v in RATIO_VARIANTS:
                r = bn.ratio[v].cpu()  # [B, L, n], padded tokens 0
                summary.setdefault(f"ratio.{v}", np.zeros((n_ex, r.shape[1]), np.float32))[batch] = \
                    (r.sum(-1) / n_tok.cpu()[:, None]).numpy()
                samples.setdefault(("mixing_ratio", v, 2), []).append(r.permute(0, 2, 1)[tok_mask].numpy())  # [T, L]
            for s in specs:
                maps = {"": summed[s.name], "heads.": outs[s.name]} if s.name in summed else \
                    {("heads." if job.heads and s.head_dims else ""): outs[s.name]}
                for prefix, m in maps.items():
                    if not _has_maps(s.dims_for(bool(prefix))):
                        continue
                    a = _rows_normalised(m)
                    stats = {"entropy": row_entropy(a, mask),
                             **{f"mass.{t}": x for t, x in token_type_masses(a, kinds, mask).items()}}
                    for stat, x in stats.items():
                        put(f"{s.name}.{prefix}{stat}", stat.replace(".", ":"), s.name, batch, x.cpu().numpy())
            for name in full:
                vals = outs[name].float().cpu().numpy()
                dims = get_method(name).dims_for(job.heads)
                for b, k in enumerate(batch):
                    n = int(n_tok[b])
                    v = vals[b][tuple(slice(0, n) if d in ("target", "source") else slice(None) for d in dims)]
                    full[name][k] = np.ascontiguousarray(v).reshape(-1)
                    shapes[name][k] = list(v.shape)
        for b, k in enumerate(batch):
            tokens[k] = enc.tokens[b]
        if on_batch:
            on_batch(len(batch))
    sums = sh.Sums()
    sums.add_scalar("tokens", "", n_tokens)
    for (stat, method, _), parts in samples.items():
        sums.add(stat, method, np.concatenate(parts))
    cols: dict[str, pa.Array] = {"index": pa.array([e.index for e in examples], pa.int64()), "text": pa.array(firsts)}
    if pairs is not None:
        cols["text_pair"] = pa.array(pairs)
    cols["fields"] = pa.array([json.dumps(e.fields, default=str, ensure_ascii=False) for e in examples])
    cols["n_tokens"], cols["truncated_from"] = pa.array(n_tokens), pa.array(trunc_from)
    cols.update({k: _nested(v) for k, v in summary.items()})
    if full:
        cols["tokens"] = pa.array(tokens, pa.list_(pa.string()))
        for name, arrays in full.items():
            cols[name] = pa.array(arrays, pa.list_(pa.float32()))
            cols[f"{name}.shape"] = pa.array(shapes[name], pa.list_(pa.int32()))
    info = {"job_id": job.job_id, "shard": shard_id, "examples": n_ex, "first_index": examples[0].index,
            "last_index": examples[-1].index, "tokens": int(n_tokens.sum()), "truncated": int((trunc_from > 0).sum())}
    return sh.shard_bytes(pa.table(cols), sums, info), info


# ---------------------------------------------------------------------------------------------- backends


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


_WORKER_LENS: Any = None  # the worker process's Lens, or the MixlensError that loading it raised


def _init_worker(job: Job, threads: int) -> None:
    global _WORKER_LENS
    from mixlens.lens import load

    torch.set_num_threads(threads)
    try:
        _WORKER_LENS = load(job.model, head=job.head, device=job.device, allow_random_head=job.allow_random_head)
    except MixlensError as e:  # re-raised with each task, so the user sees the message, not a broken pool
        _WORKER_LENS = e


def _worker_compute(job: Job, shard_id: int, examples: list[Example]) -> tuple[int, bytes, dict]:
    if isinstance(_WORKER_LENS, MixlensError):
        raise _WORKER_LENS
    return (shard_id, *compute_shard(_WORKER_LENS, job, shard_id, examples))


class ProcessBackend:
    """N local worker processes (spawned, each holding the model); at most 2 shards in flight per worker."""

    def __init__(self, job: Job, workers: int) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // workers)
        self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                        initargs=(job, threads))
        self.futures: set[Future[Any]] = set()
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


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class CorpusResult:
    """A finished (or partly finished) corpus directory."""

    out: Path
    manifest: dict

    @classmethod
    def open(cls, out: str | Path) -> CorpusResult:
        out = Path(out)
        m = sh.read_manifest(out)
        if m is None:
            raise MixlensError(f"{out} holds no mixlens corpus run (no {sh.MANIFEST})")
        return cls(out, m)

    def aggregate(self):
        """The aggregate table as a pandas DataFrame (stat, method, layer, head, count, mean, std, min, max)."""
        import pyarrow.parquet as pq

        return pq.read_table(self.out / sh.AGGREGATE).to_pandas()

    def examples(self, columns: list[str] | None = None):
        """All per-example rows, in input order, as a pandas DataFrame."""
        import pyarrow.parquet as pq

        ids = sorted(int(s["shard"]) for s in self.manifest["shards"])
        return pa.concat_tables([pq.read_table(sh.shard_path(self.out, s), columns=columns) for s in ids]).to_pandas()


def _check_out(out: Path, job: Job, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MixlensError(f"--out {out} exists and is not a directory")
    old = sh.read_manifest(out) if out.is_dir() and not overwrite else None
    if old is not None:
        diff = [k for k in IDENTITY if old.get("job", {}).get(k) != job.identity()[k]]
        if diff:
            what = "; ".join(f"{k}: {old.get('job', {}).get(k)!r} → {job.identity()[k]!r}" for k in diff[:3])
            raise MixlensError(f"{out} holds a different run ({what}); use --overwrite to replace it or another --out")
    elif out.is_dir() and any(out.iterdir()) and not overwrite:
        raise MixlensError(f"--out {out} is not empty and holds no mixlens run; use --overwrite or another --out")
    if overwrite and out.is_dir():
        sh.clear_run(out)


def _chunks(examples: Iterator[Example], size: int) -> Iterator[list[Example]]:
    chunk: list[Example] = []
    for e in examples:
        chunk.append(e)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run_corpus(
    data: str | Path,
    out: str | Path,
    methods: list[str] | tuple[str, ...] | None = None,
    *,
    model: str | None = None,
    lens=None,
    text_column: str | None = None,
    pair_column: str | None = None,
    fmt: str | None = None,
    heads: bool = False,
    options: dict[str, dict[str, object]] | None = None,
    store: str = "summary",
    batch_size: int = 32,
    max_tokens: int = 8192,
    max_length: int | None = None,
    shard_size: int = 256,
    strict: bool = False,
    overwrite: bool = False,
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    head: str | None = None,
    device: str = "cpu",
    progress: bool = False,
    allow_random_head: bool = False,
) -> CorpusResult:
    """Run `methods` over every example of `data` and write shards, aggregate and manifest to `out`.

    `data`: a TSV/CSV/JSONL/Parquet/text file or `hf:NAME[:CONFIG]:SPLIT`. `lens` (in-process only) overrides
    `model`. Rerunning the same call resumes: finished shards are kept and not recomputed. `backend='local'`
    with `workers` > 1 uses worker processes; `backend='ray'` uses Ray actors (`address`: an existing cluster).
    """
    from mixlens.lens import DEFAULT_METHODS

    methods = tuple(dict.fromkeys(methods or DEFAULT_METHODS))
    specs = [get_method(m) for m in methods]  # unknown names fail before anything loads
    options = options or {}
    for name, opts in options.items():
        if name not in methods:
            raise MixlensError(f"options given for '{name}', which is not among the methods")
        unknown = set(opts) - set(get_method(name).options())
        if unknown:
            raise MixlensError(f"method '{name}' has no option {sorted(unknown)}; options: "
                               f"{sorted(get_method(name).options()) or 'none'}")
    if store not in STORES:
        raise MixlensError(f"unknown --store '{store}'; valid: {', '.join(STORES)}")
    if backend not in BACKENDS:
        raise MixlensError(f"unknown --backend '{backend}'; valid: {', '.join(BACKENDS)}")
    for name, v in (("--batch-size", batch_size), ("--max-tokens", max_tokens), ("--shard-size", shard_size),
                    ("--workers", workers or 1)):
        if v < 1:
            raise MixlensError(f"{name} must be at least 1 (got {v})")
    if lens is not None and (backend == "ray" or (workers or 1) > 1):
        raise MixlensError("a Lens object can only run in-process; pass a model path for workers or Ray")
    if heads and not any(s.head_dims for s in specs):
        raise MixlensError(f"--heads: none of {', '.join(methods)} has per-head matrices")

    stats = ReadStats()
    columns, records = open_records(data, fmt)  # missing/empty file, bad format: before the model loads
    tcol, pcol = resolve_columns(columns, text_column, pair_column, str(data))
    is_file = not (isinstance(data, str) and data.startswith("hf:"))
    data_id = str(Path(data).expanduser().resolve()) if is_file else str(data)
    model_name = lens.name if lens is not None else (str(model) if model else "all-MiniLM-L6-v2")  # as load()
    job = Job(model, model_name, data_id, fmt, tcol, pcol, methods, heads, options, store, shard_size, max_length,
              batch_size, max_tokens, head, device, allow_random_head)
    out = Path(out)
    _check_out(out, job, overwrite)  # refuse a different run before the model loads
    if lens is None and backend == "local" and (workers or 1) == 1:
        from mixlens.lens import load

        lens = load(model, head=head, device=device, allow_random_head=allow_random_head)
    (out / sh.SHARD_DIR).mkdir(parents=True, exist_ok=True)
    sh.remove_stale_temps(out)
    done = sh.finished_shards(out, job.job_id)
    resumed = len(done)

    from mixlens import __version__

    def manifest(complete: bool) -> dict:
        infos = [done[k] for k in sorted(done)]
        return {
            "format": sh.FORMAT, "version": __version__, "job_id": job.job_id, "job": job.identity(),
            "params": {"batch_size": batch_size, "max_tokens": max_tokens, "strict": strict},
            "model": model_name, "methods": list(methods), "complete": complete, "resumed_shards": resumed,
            "shards": [{"shard": i["shard"], "file": str(sh.shard_path(out, i["shard"]).relative_to(out)),
                        "examples": i["examples"], "truncated": i["truncated"]} for i in infos],
            "counts": {"examples": sum(i["examples"] for i in infos), "tokens": sum(i["tokens"] for i in infos),
                       "truncated": sum(i["truncated"] for i in infos), **{k: v for k, v in stats.as_dict().items()
                                                                             if k != "read"}},
        }

    sh.write_manifest(out, manifest(False))
    bar = _Progress(count_records(data, fmt) if is_file else None) if progress else None
    on_batch = bar.advance if bar else None
    pool: RayBackend | ProcessBackend | LocalBackend
    if backend == "ray":
        from mixlens.corpus.ray_backend import RayBackend

        pool = RayBackend(job, workers, address)
    elif lens is None:
        pool = ProcessBackend(job, workers or 1)
    else:
        pool = LocalBackend(lens, job, on_batch)

    def collect() -> None:
        shard_id, payload, info = pool.next_done()
        sh.atomic_write(sh.shard_path(out, shard_id), payload)
        done[shard_id] = info
        sh.write_manifest(out, manifest(False))
        if bar and not isinstance(pool, LocalBackend):
            bar.advance(info["examples"])

    try:
        with bar or contextlib.nullcontext():
            for shard_id, chunk in enumerate(_chunks(examples_from(records, tcol, pcol, strict, stats, str(data)),
                                                     shard_size)):
                if shard_id in done:
                    if bar:
                        bar.advance(len(chunk), resumed=True)
                    continue
                pool.submit(shard_id, chunk)
                while pool.pending() >= pool.capacity:
                    collect()
            while pool.pending():
                collect()
    finally:  # on an error mid-stream (e.g. --strict), keep every shard that still finishes
        while pool.pending():
            try:
                collect()
            except Exception:  # the first error is already on its way to the user
                continue
        pool.close()
    sh.write_aggregate(out, sh.merge_shards(out, list(done)))
    final = manifest(True)
    sh.write_manifest(out, final)
    return CorpusResult(out, final)


class _Progress:
    """A rich progress bar on stderr with examples/s and ETA (total: an upper bound from a line count)."""

    def __init__(self, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task) -> Text:
                return Text(f"{task.speed:.1f} ex/s" if task.speed else "… ex/s")

        self.p = Progress(TextColumn("corpus"), BarColumn(), MofNCompleteColumn(), Rate(), TimeElapsedColumn(),
                          TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))
        self.task = self.p.add_task("corpus", total=total)

    def advance(self, n: int, resumed: bool = False) -> None:
        """Count n examples done; examples finished by an earlier run shrink the total instead."""
        t = self.p.tasks[0]
        if resumed:
            self.p.update(self.task, total=max(t.total - n, t.completed) if t.total is not None else None)
        else:
            self.p.advance(self.task, n)

    def __enter__(self) -> _Progress:
        self.p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.p.stop()
