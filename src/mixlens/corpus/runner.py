"""Run registered methods over a corpus: stream → shards → length-sorted batches → Parquet + partial sums.

The input stream is cut into shards of `shard_size` readable examples, in input order; a shard is the
sorting window (examples are sorted by token length inside it and packed into batches of at most
`batch_size` examples and `max_tokens` padded tokens, see `Lens.batches`). Shards are independent units of work,
so the same shard gives the same result in-process, in a worker process or on a Ray actor, and a rerun skips
the shards whose files already exist. Modules: `job` (what and identity), `compute` (one shard), `backends`
(where), this one (the run loop).
"""

from __future__ import annotations

import contextlib
import itertools
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from mixlens.corpus import shards as sh
from mixlens.corpus.backends import Backend, LocalBackend, ProcessBackend, RayBackend
from mixlens.corpus.job import BACKENDS, IDENTITY, OLD_DEFAULTS, STORES, Job, chunks, file_stamp
from mixlens.corpus.outdir import OutDir, is_uri
from mixlens.corpus.readers import ReadStats, count_records, examples_from, open_records, resolve_columns
from mixlens.errors import MixlensError
from mixlens.methods import check_options
from mixlens.methods import get as get_method
from mixlens.pipeline import plan_batches
from mixlens.runlock import run_lock

if TYPE_CHECKING:
    from mixlens.lens import Lens

__all__ = ["CorpusResult", "Job", "plan_batches", "run_corpus"]


@dataclass
class CorpusResult:
    """A finished (or partly finished) corpus directory (`out`: a local path, or the URI it was written to)."""

    out: Path | str | OutDir
    manifest: dict

    @property
    def dir(self) -> OutDir:
        return OutDir.of(self.out)

    @classmethod
    def open(cls, out: str | Path | OutDir) -> CorpusResult:
        d = OutDir.of(out)
        m = sh.read_manifest(d)
        if m is None:
            raise MixlensError(f"{d} holds no mixlens corpus run (no {sh.MANIFEST})")
        return cls(_shown(out), m)

    def aggregate(self):
        """The aggregate table as a pandas DataFrame (stat, method, layer, head, count, mean, std, min, max)."""
        import pyarrow.parquet as pq

        d = self.dir
        with d.open(sh.AGGREGATE) as f:
            return pq.read_table(f).to_pandas()

    def examples(self, columns: list[str] | None = None):
        """All per-example rows, in input order, as a pandas DataFrame."""
        import pyarrow.parquet as pq

        d = self.dir
        ids = sorted(int(s["shard"]) for s in self.manifest["shards"])
        tables = []
        for s in ids:
            with d.open(sh.shard_file(s)) as f:
                tables.append(pq.read_table(f, columns=columns))
        t = pa.concat_tables(tables)
        if self.manifest.get("job", {}).get("layout") == "index" and "index" in t.column_names:
            t = t.sort_by("index")  # Ray Data shards hold the rows in the order they streamed in
        return t.to_pandas()


def _shown(out: str | Path | OutDir) -> Path | str | OutDir:
    """What `CorpusResult.out` holds: a Path for a local folder, the URI (or the OutDir) otherwise."""
    return out if isinstance(out, OutDir) or is_uri(out) else Path(out)


def _check_model(
    model: str | None, gguf_file: str | None, lens: Lens | None, max_length: int | None, pair: bool
) -> None:
    """Model errors that need no weights, before --out is made (also for workers and Ray, which load the model
    elsewhere): a missing model folder or GGUF file, a --max-length below what the special tokens need."""
    from mixlens.lens import check_max_length, resolve_source

    if lens is not None:
        if max_length is not None:
            check_max_length(lens.tokenizer, max_length, pair)
        return
    src, _ = resolve_source(model, gguf_file)
    if max_length is None:
        return
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(src, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError):
        return  # loading the model says why
    check_max_length(tok, max_length, pair)


LOCK = ".mixlens-corpus.lock"  # in --out: held (flock) by the run writing there; holds its pid and command


def _locked(out: OutDir) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive lock on a local output directory for the whole run: a second run into the same --out
    (another job or the same one) is refused with one line naming the running one. A folder this run created is
    removed again when the run fails before writing its manifest (nothing is left behind). A directory on another
    filesystem (an object store) is not locked: two runs into the same URI at once are the user's to avoid."""
    from mixlens.commands.options import INVOCATION

    if out.local is None:
        return contextlib.nullcontext()
    command = shlex.join(["mixlens", *INVOCATION]) if INVOCATION else sys.argv[0]
    return run_lock(out.local, LOCK, command, "corpus", (out.local / sh.MANIFEST).exists)


def _check_out(out: OutDir, job: Job, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MixlensError(f"--out {out} exists and is not a directory")
    old = sh.read_manifest(out) if out.is_dir() and not overwrite else None
    if old is not None:
        was, now = old.get("job", {}).get("data_file"), job.identity()["data_file"]
        same_file = old.get("job", {}).get("data") == job.identity()["data"]  # else: another file's run (below)
        if same_file and was is not None and now is not None and was != now:
            raise MixlensError(
                f"{job.data} changed since the run in {out} began (size, modification time or content "
                "differ); use --overwrite to start afresh"
            )
        was_job, now_job = {**OLD_DEFAULTS, **old.get("job", {})}, {**OLD_DEFAULTS, **job.identity()}
        diff = [k for k in (*IDENTITY, "layout") if was_job.get(k) != now_job[k]]
        if diff:
            what = "; ".join(f"{k}: {was_job.get(k)!r} → {now_job[k]!r}" for k in diff[:3])
            raise MixlensError(f"{out} holds a different run ({what}); use --overwrite to replace it or another --out")
    elif out.is_dir() and any(name != LOCK for name in out.names()) and not overwrite:
        raise MixlensError(f"--out {out} is not empty and holds no mixlens run; use --overwrite or another --out")
    if overwrite and out.is_dir():
        sh.clear_run(out)


def build_manifest(
    out: OutDir, job: Job, done: dict[int, dict], resumed: int, skipped: dict[str, int], params: dict, complete: bool
) -> dict:
    """The manifest of a run: job identity, parameters, the finished shards (`done`: shard id → info) and counts
    (`skipped`: undecodable / malformed / empty records)."""
    from mixlens.version import __version__

    infos = [done[k] for k in sorted(done)]
    return {
        "format": sh.FORMAT,
        "version": __version__,
        "job_id": job.job_id,
        "job": job.identity(),
        "params": params,
        "model": job.model_name,
        "methods": list(job.methods),
        "complete": complete,
        "resumed_shards": resumed,
        "shards": [
            {
                "shard": i["shard"],
                "file": sh.shard_file(i["shard"]),
                "examples": i["examples"],
                "truncated": i["truncated"],
            }
            for i in infos
        ],
        "counts": {
            "examples": sum(i["examples"] for i in infos),
            "tokens": sum(i["tokens"] for i in infos),
            "truncated": sum(i["truncated"] for i in infos),
            **skipped,
        },
    }


def run_corpus(
    data: str | Path,
    out: str | Path | OutDir,
    methods: list[str] | tuple[str, ...] | None = None,
    *,
    model: str | None = None,
    gguf_file: str | None = None,
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
    dtype: str = "float32",
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    tokenize_cpus: float | None = None,
) -> CorpusResult:
    """Run `methods` over every example of `data` and write shards, aggregate and manifest to `out`.

    `data`: a TSV/CSV/JSONL/Parquet/text file or `hf:NAME[:CONFIG]:SPLIT`. `out`: a local folder, a pyarrow
    filesystem URI (`file://`, `s3://`, `gs://`, ...) or an `OutDir` (a folder on any `pyarrow.fs.FileSystem`).
    `lens` (in-process only) overrides `model` (`gguf_file`: a GGUF file in the `model` directory). Rerunning the
    same call resumes: finished shards are kept and not recomputed. `backend='local'` with `workers` > 1 uses worker
    processes; `backend='ray'` uses Ray actors (`address`: an existing cluster); `backend='ray-data'` runs on Ray
    Data (`workers` actors with `num_cpus` / `num_gpus` each, tokenising tasks of `tokenize_cpus` CPUs; `data` may
    also be a folder of Parquet files or a pyarrow filesystem URI).
    `dtype`, `device`: as `mixlens.load` takes them.
    """
    from mixlens.lens import DEFAULT_METHODS, dtype_name, resolve_device

    dtype = dtype_name(lens.dtype if lens is not None else dtype)  # before anything loads, as the device
    device = str(lens.device) if lens is not None else resolve_device(device)
    methods = tuple(dict.fromkeys(methods or DEFAULT_METHODS))
    specs = [get_method(m) for m in methods]  # unknown names fail before anything loads
    options = check_options(methods, options)  # typed and checked before anything loads
    if store not in STORES:
        raise MixlensError(f"unknown --store '{store}'; valid: {', '.join(STORES)}")
    if backend not in BACKENDS:
        raise MixlensError(f"unknown --backend '{backend}'; valid: {', '.join(BACKENDS)}")
    for name, v in (
        ("--batch-size", batch_size),
        ("--max-tokens", max_tokens),
        ("--shard-size", shard_size),
        ("--workers", 1 if workers is None else workers),
        ("--max-length", 1 if max_length is None else max_length),
    ):
        if v < 1:
            raise MixlensError(f"{name} must be at least 1 (got {v})")
    for name, r in (("--num-cpus", num_cpus), ("--num-gpus", num_gpus), ("--tokenize-cpus", tokenize_cpus)):
        if r is not None and not (0 <= r < float("inf")):
            raise MixlensError(f"{name} must be a number of at least 0 (got {r})")
        if r is not None and backend != "ray-data":
            raise MixlensError(f"{name} applies to --backend ray-data only")
    if lens is not None and (backend != "local" or (workers or 1) > 1):
        raise MixlensError("a Lens object can only run in-process; pass a model path for workers or Ray")
    if heads and not any(s.head_dims for s in specs):
        raise MixlensError(f"--heads: none of {', '.join(methods)} has per-head matrices")

    model_name = lens.name if lens is not None else (str(model) if model else "all-MiniLM-L6-v2")  # as load()
    params = {"batch_size": batch_size, "max_tokens": max_tokens, "strict": strict}

    def job_for(data_name: str, tcol: str, pcol: str | None, data_file: dict[str, object] | None = None) -> Job:
        """The run's identity over `data_name` (the model, methods and batching are the same on every backend)."""
        return Job(
            model,
            model_name,
            data_name,
            fmt,
            tcol,
            pcol,
            methods,
            heads,
            options,
            store,
            shard_size,
            max_length,
            batch_size,
            max_tokens,
            head=head,
            device=device,
            allow_random_head=allow_random_head,
            dtype=dtype,
            data_file=data_file,
            gguf_file=gguf_file,
        )

    if backend == "ray-data":
        from mixlens.corpus import raydata

        template = job_for(str(data), "", None)
        cluster = raydata.Cluster(address, workers, num_cpus, num_gpus, tokenize_cpus or 0.0)
        return raydata.run(
            str(data), out, template, fmt, text_column, pair_column, strict, overwrite, cluster, params, progress
        )
    stats = ReadStats()
    # Everything that needs no model fails here, before it loads and before --out is made: missing/empty file, bad
    # format, unknown columns, no readable row (the first example is read ahead), a changed file or another run.
    columns, records = open_records(data, fmt)
    tcol, pcol = resolve_columns(columns, text_column, pair_column, str(data))
    examples = examples_from(records, tcol, pcol, strict, stats, str(data))
    examples = itertools.chain([next(examples)], examples)  # examples_from raises rather than end without a row
    is_file = not (isinstance(data, str) and data.startswith("hf:"))
    path = Path(data).expanduser().resolve() if is_file else None
    job = job_for(str(path or data), tcol, pcol, file_stamp(path) if path else None)
    shown, out = _shown(out), OutDir.of(out)
    _check_model(model, gguf_file, lens, max_length, pcol is not None)
    if out.exists() and not out.is_dir():
        raise MixlensError(f"--out {out} exists and is not a directory")
    with _locked(out):  # checked and written by one run at a time
        _check_out(out, job, overwrite)
        if lens is None and backend == "local" and (workers or 1) == 1:
            lens = job.load()
        out.mkdir(sh.SHARD_DIR)
        sh.remove_stale_temps(out)
        done = sh.finished_shards(out, job.job_id)
        resumed = len(done)

        def manifest(complete: bool) -> dict:
            counts = {k: v for k, v in stats.as_dict().items() if k != "read"}
            return build_manifest(out, job, done, resumed, counts, params, complete)

        sh.write_manifest(out, manifest(False))
        bar = _Progress(count_records(data, fmt) if is_file else None) if progress else None
        on_batch = bar.advance if bar else None
        pool: Backend
        if backend == "ray":
            pool = RayBackend(job, workers, address)
        elif lens is None:
            pool = ProcessBackend(job, workers or 1)
        else:
            pool = LocalBackend(lens, job, on_batch)

        def collect() -> None:
            shard_id, payload, info = pool.next_done()
            out.write(sh.shard_file(shard_id), payload)
            done[shard_id] = info
            sh.write_manifest(out, manifest(False))
            if bar and not isinstance(pool, LocalBackend):
                bar.advance(info["examples"])

        try:
            with bar or contextlib.nullcontext():
                for shard_id, chunk in enumerate(chunks(examples, shard_size)):
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
        return CorpusResult(shown, final)


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

        self.p = Progress(
            TextColumn("corpus"),
            BarColumn(),
            MofNCompleteColumn(),
            Rate(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
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
