"""Corpus runs on Ray Data (`--backend ray-data`): the cluster reads, computes and writes; the driver only keeps
the books.

    read     one Ray Data read task per file, or per range of Parquet row groups (a file or folder, local or any
             pyarrow filesystem URI, or `hf:`), parsed by the mixlens readers: the same examples, source indexes and
             bad-record counts as a local run; rows some finished shard already holds are dropped here. Each
             Ray Data row is one shard (≤ `shard_size` examples as lists, `shard_row`) and each block one row, so
             Ray Data's byte-sized block shaping never cuts or joins shards
    tokenise only with GPU actors or `tokenize_cpus` > 0: Ray Data tasks (fused with the read tasks) load the
             model's tokenizer and config once per worker process, no weights, and add each example's token ids,
             types, word ids and lengths (`tokenize_block`); otherwise the actors tokenise (CPU actors that hold
             every core gain nothing from a separate stage: it would load a tokenizer in another process and
             compete with them for the same cores)
    compute  an actor pool (`concurrency` actors, `num_cpus` / `num_gpus` each): every actor loads the job's model
             once and turns each shard row into one shard with `compute_shard` (the local path: the same `Lens`,
             methods and statistics, packing the given token ids as it packs texts), written straight to
             DIR/shards/shard-<first index>
    driver   streams the shards' small info rows (manifest, progress), then merges the partial sums exactly as a
             local run does

A shard is named by the first source index it holds (layout "index" of the job), so a rerun of the same command
reads the shards' `index` columns and computes only the source indexes no shard holds: no duplicated and no
missing index, whatever Ray retried or the driver lost. Output goes to a directory every node can write (one
machine, or a shared filesystem).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixlens.corpus import shards as sh
from mixlens.corpus.job import Job
from mixlens.corpus.outdir import OutDir
from mixlens.corpus.readers import (
    FORMATS,
    HF_PREFIX,
    Example,
    FsFile,
    ReadStats,
    count_records,
    detect_format,
    examples_from,
    open_records,
    resolve_columns,
)
from mixlens.errors import MixlensError

SKIP_DIR = sh.SKIPPED_DIR  # DIR/skipped/part-00000.json: each read task's bad-record counts (a rerun rewrites them)
PART_ROWS = 16384  # Parquet rows per read task (whole row groups)
OOM_WORDS = ("running low on memory", "node_out_of_memory")  # how Ray says its memory monitor killed a worker
RETRIES = 2  # restarts of a dead actor, and retries of its batch on another one


@dataclass(frozen=True)
class Part:
    """What one read task reads: a file (or an `hf:` name), from source index `start`."""

    pid: int
    src: FsFile | str
    start: int = 0
    rows: int | None = None  # known for Parquet
    row_groups: tuple[int, ...] | None = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def input_files(data: str, fmt: str | None) -> list[FsFile]:
    """The files of DATA: one file, or every file under a folder (Parquet only), local or a pyarrow filesystem URI."""
    import pyarrow.fs as pafs

    try:
        if "://" in data:
            fs, path = pafs.FileSystem.from_uri(data)
        else:
            fs, path = pafs.LocalFileSystem(), str(Path(data).expanduser().resolve())
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = sorted(
                (
                    i
                    for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                    if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))
                ),
                key=lambda i: i.path,
            )
        else:
            infos = [info]
    except (pa.ArrowException, OSError, ValueError) as e:
        raise MixlensError(f"cannot open data '{data}': {_first_line(e)}") from None
    if info.type == pafs.FileType.NotFound:
        raise MixlensError(f"data file '{data}' does not exist")
    if not infos:
        raise MixlensError(f"data folder '{data}' holds no files")
    base = data.rstrip("/")
    files = [
        FsFile(fs, i.path, data if i.path == path else f"{base}/{i.path[len(path) :].lstrip('/')}", i.size)
        for i in infos
    ]
    if len(files) > 1:
        other = [f for f in files if (fmt or detect_format(f)) != "parquet"]
        if other:
            raise MixlensError(f"a data folder must hold Parquet files only ({other[0]} is not); give one file instead")
    return files


def plan_parts(files: list[FsFile], fmt: str) -> list[Part]:
    """Read tasks: ranges of whole row groups of ≤ PART_ROWS rows for Parquet (the files' schemas must match, their
    rows are numbered on across files), one task per file otherwise."""
    if fmt != "parquet":
        return [Part(k, f) for k, f in enumerate(files)]
    parts: list[Part] = []
    start, schema0 = 0, None
    for f in files:
        try:
            meta = pq.ParquetFile(f.fs.open_input_file(f.path)).metadata
        except Exception as e:  # pyarrow raises several types for non-Parquet bytes
            raise MixlensError(f"{f} is not a readable Parquet file ({_first_line(e)})") from None
        schema = meta.schema.to_arrow_schema()
        if schema0 is None:
            schema0 = (f, schema)
        elif not schema.equals(schema0[1]):
            a, b = (
                dict(zip(schema0[1].names, schema0[1].types, strict=True)),
                dict(zip(schema.names, schema.types, strict=True)),
            )
            diff = [
                f"{c}: {a.get(c, 'missing')} vs {b.get(c, 'missing')}"
                for c in dict.fromkeys([*a, *b])
                if a.get(c) != b.get(c)
            ]
            raise MixlensError(f"{f} does not have the schema of {schema0[0]} ({'; '.join(diff[:3])})")
        group: list[int] = []
        rows = 0
        for g in range(meta.num_row_groups):
            group.append(g)
            rows += meta.row_group(g).num_rows
            if rows >= PART_ROWS or g == meta.num_row_groups - 1:
                parts.append(Part(len(parts), f, start, rows, tuple(group)))
                start, group, rows = start + rows, [], 0
    return parts


def shard_row(examples: list[Example], pair: bool) -> pa.Table:
    """One Ray Data row that is one shard: the examples' source `index`, `text` (and `text_pair`) and JSON `fields`,
    each a list over the examples."""

    def one(values: list, kind: pa.DataType) -> pa.Array:
        return pa.array([values], pa.list_(kind))

    cols: dict[str, Any] = {"index": one([e.index for e in examples], pa.int64())}
    cols["text"] = one([e.text[0] if isinstance(e.text, tuple) else e.text for e in examples], pa.string())
    if pair:
        cols["text_pair"] = one([e.text[1] for e in examples], pa.string())
    cols["fields"] = one([json.dumps(e.fields, default=str, ensure_ascii=False) for e in examples], pa.string())
    return pa.table(cols)


def shard_examples(row: dict[str, Any]) -> list[Example]:
    """The examples of one shard row (as `Table.to_pylist` gives it), in source order."""
    return [Example(i, t, json.loads(f)) for i, t, f in zip(row["index"], row_texts(row), row["fields"], strict=True)]


def row_texts(row: dict[str, Any]) -> list:
    """The texts of one shard row: strings, or (text, pair) tuples when it has a `text_pair` column."""
    return list(zip(row["text"], row["text_pair"], strict=True)) if "text_pair" in row else row["text"]


def read_part(
    part: Part, fmt: str, tcol: str, pcol: str | None, strict: bool, done: Any, out: OutDir, block_rows: int
) -> Iterator[pa.Table]:
    """One read task: the part's examples not yet in a shard, as shard rows of `block_rows` examples (each its own
    block, so one task of the actor pool); its bad-record counts go to DIR/skipped."""
    import ray

    claimed: np.ndarray = ray.get(done) if isinstance(done, ray.ObjectRef) else done  # sorted source indexes
    stats = ReadStats()
    if isinstance(part.src, str):
        _, records = open_records(part.src)
    else:
        _, records = open_records(part.src, fmt, row_groups=list(part.row_groups) if part.row_groups else None)
    buf: list[Example] = []
    for e in examples_from(records, tcol, pcol, strict, stats, str(part.src), start=part.start, require_row=False):
        k = np.searchsorted(claimed, e.index)
        if k < claimed.size and claimed[k] == e.index:
            continue
        buf.append(e)
        if len(buf) == block_rows:
            yield shard_row(buf, pcol is not None)
            buf = []
    if buf:
        yield shard_row(buf, pcol is not None)
    counts = {k: v for k, v in stats.as_dict().items() if k != "read"}
    out.write(f"{SKIP_DIR}/part-{part.pid:05d}.json", json.dumps(counts).encode())


def skipped_counts(out: OutDir) -> dict[str, int]:
    """Bad records skipped so far, summed over the read tasks that finished."""
    total = {k: 0 for k in ("undecodable", "malformed", "empty")}
    for name in out.names(SKIP_DIR):
        if not (name.startswith("part-") and name.endswith(".json")):
            continue
        with contextlib.suppress(MixlensError, ValueError, TypeError, AttributeError):
            for k, v in json.loads(out.read(f"{SKIP_DIR}/{name}")).items():
                total[k] = total.get(k, 0) + int(v)
    return total


@functools.cache
def _tokenizer(model: str | None, gguf_file: str | None, max_length: int | None) -> tuple[Any, int]:
    """(the job model's tokenizer, the token limit of the job): loaded once per worker process from the tokenizer
    files and the config alone, no weights (what `mixlens.load` and `Lens.limit` give)."""
    import transformers

    from mixlens.lens import input_limit, resolve_source

    src, _ = resolve_source(model, gguf_file)
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    tok = transformers.AutoTokenizer.from_pretrained(src, **gguf)
    limit = input_limit(transformers.AutoConfig.from_pretrained(src, **gguf), tok)
    return tok, limit if max_length is None else min(max_length, limit)


def tokenize_block(batch: pa.Table, job: Job) -> pa.Table:
    """The tokenizing stage (CPU tasks): each shard row gains, per example, its token ids as the model's batching
    makes them (`ids`, `types` when the tokenizer has token types, `words`), `n_tokens` after truncation and
    `truncated_from` (its length before, 0 if not cut); the compute actors pack and pad these without tokenizing
    again."""
    from mixlens.batching import Tokenized, check_texts

    tok, limit = _tokenizer(job.model, job.gguf_file, job.max_length)
    cols: dict[str, list] = {k: [] for k in ("ids", "types", "words", "n_tokens", "truncated_from")}
    for row in batch.to_pylist():
        t = Tokenized(tok, check_texts(row_texts(row)), limit, True, limit)
        for name, value in (
            ("ids", t.ids),
            ("types", t.types),
            ("words", t.words),
            ("n_tokens", t.lengths),
            ("truncated_from", t.truncated),
        ):
            cols[name].append(value)
    nested = pa.list_(pa.list_(pa.int64()))
    kinds = {"ids": nested, "types": nested, "words": nested, "n_tokens": pa.list_(pa.int64())}
    for name, values in cols.items():
        batch = batch.append_column(name, pa.array(values, kinds.get(name, pa.list_(pa.int64()))))
    return batch


class ShardWriter:
    """An actor of the pool: holds one loaded model; each batch becomes one shard file written to DIR/shards."""

    def __init__(self, job: Job, out: OutDir, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.job, self.out = job, out
        import ray

        # the driver's summary counts examples per node: its IP and the start of its id (nodes may share an IP)
        self.node = f"{ray.util.get_node_ip_address()} {ray.get_runtime_context().get_node_id()[:8]}"
        self.lens: Any
        try:
            self.lens = job.load()
        except MixlensError as e:  # raised again by each batch, where the driver turns it into one line
            self.lens = e

    def __call__(self, batch: pa.Table) -> pa.Table:
        """`batch`: shard rows (one, as a rule); returns one info row per shard written."""
        from mixlens.batching import Tokenized
        from mixlens.corpus.compute import compute_shard

        if isinstance(self.lens, MixlensError):
            raise self.lens
        infos = []
        for row in batch.to_pylist():
            examples = shard_examples(row)
            shard_id = examples[0].index
            tokenized = None
            if "ids" in row:  # tokenized by the CPU stage
                tokenized = Tokenized.restore(row["ids"], row["types"], row["words"], row["truncated_from"])
            payload, info = compute_shard(self.lens, self.job, shard_id, examples, tokenized=tokenized)
            self.out.write(sh.shard_file(shard_id), payload)
            infos.append(json.dumps(info))
        return pa.table({"info": infos, "node": [self.node] * len(infos)})


def claimed_indexes(out: OutDir, done: dict[int, dict]) -> np.ndarray:
    """The sorted source indexes the finished shards hold. A shard whose every index another (lower-numbered) shard
    holds too (a batch Ray ran again after its first result was written) is removed; a partial overlap is an error."""
    seen: list[np.ndarray] = []
    have = np.empty(0, np.int64)
    for s in sorted(done):
        with out.open(sh.shard_file(s)) as f:
            idx = pq.read_table(f, columns=["index"])["index"].to_numpy()
        dup = np.isin(idx, have)
        if dup.all():
            out.delete(sh.shard_file(s))
            del done[s]
            continue
        if dup.any():
            raise MixlensError(
                f"{out.show(sh.shard_file(s))} repeats source indexes another shard holds; use --overwrite"
            )
        seen.append(idx)
        have = np.union1d(have, idx)
    return have


def _reachable(address: str) -> None:
    """Fail fast on a host:port no one listens on (ray.init would wait a minute or more)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except (OSError, ValueError) as e:
        raise MixlensError(f"cannot connect to Ray at {address}: {getattr(e, 'strerror', None) or e}") from None


def start_ray(address: str | None) -> tuple[Any, bool, str]:
    """(the ray module, whether we started it, its log folder): connect to `address`, or start a local Ray with the
    machine's CPUs."""
    try:
        import ray
    except ImportError:
        raise MixlensError("--backend ray-data needs Ray Data: pip install 'mixlens[ray]'") from None
    started = not ray.is_initialized()
    if started:
        if address:
            _reachable(address)
        try:
            ctx = ray.init(
                address=address,
                num_cpus=None if address else os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise MixlensError(
                f"cannot connect to Ray at {address or 'a new local cluster'}: {_first_line(e)}"
            ) from None
        session = getattr(ctx, "address_info", {}).get("session_dir")
        logs = str(Path(session) / "logs") if session else ""
    else:
        logs = ""
    return ray, started, logs


def explain_failure(e: BaseException, ray: Any) -> str:
    """One line for why the pipeline stopped: a MixlensError from a reader or an actor, an actor killed for memory,
    an actor that died more often than it may restart, or Ray's own first line."""
    seen: set[int] = set()
    x: BaseException | None = e
    found: str | None = None
    plain: str | None = None  # the first error raised by code outside Ray (a bug, a missing module, ...)
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, ray.exceptions.OutOfMemoryError) or any(k in str(x).lower() for k in OOM_WORDS):
            return (
                "an actor was killed by Ray's out-of-memory killer (use fewer --concurrency or more memory per actor)"
            )
        if isinstance(x, ray.exceptions.ActorDiedError | ray.exceptions.WorkerCrashedError):
            found = f"an actor died and was restarted {RETRIES} times ({_first_line(x)})"
        elif isinstance(x, MixlensError) and not isinstance(x, ray.exceptions.RayError):
            return str(x)
        elif plain is None and not type(x).__module__.startswith("ray"):
            plain = f"{type(x).__name__}: {_first_line(x)}"
        x = getattr(x, "cause", None) or x.__cause__ or x.__context__
    return found or plain or _first_line(e)


def missing_ranges(claimed: np.ndarray, total: int, most: int = 4) -> tuple[int, str]:
    """(how many of the source indexes 0..total-1 no shard holds, those indexes as ranges: '16–23, 40–59, …')."""
    missing = np.setdiff1d(np.arange(total, dtype=np.int64), claimed)
    if not missing.size:
        return 0, ""
    cut = np.flatnonzero(np.diff(missing) != 1)
    starts, ends = np.r_[missing[0], missing[cut + 1]], np.r_[missing[cut], missing[-1]]
    ranges = [f"{a}" if a == b else f"{a}–{b}" for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    more = f", … ({len(ranges) - most} more ranges)" if len(ranges) > most else ""
    return int(missing.size), ", ".join(ranges[:most]) + more


def staged(tokenize_cpus: float, gpus: float) -> bool:
    """Whether tokenizing is a stage of CPU tasks of its own: when it is given CPUs, or the actors compute on GPUs;
    CPU actors that take every core tokenize their shards themselves."""
    return tokenize_cpus > 0 or gpus > 0


def check_resources(ray: Any, actors: int, cpus: float, gpus: float, tokenize_cpus: float) -> None:
    """Fail with one line on a pool the cluster cannot place (Ray Data would wait for it for ever): an actor or a
    tokenising task larger than every node, or actors that leave no CPU for the tokenising tasks that ask for some."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total = sum(r.get("CPU", 0.0) for r in nodes)
    asks = (("--num-cpus", cpus, "CPU"), ("--num-gpus", gpus, "GPU"), ("--tokenize-cpus", tokenize_cpus, "CPU"))
    for flag, want, kind in asks:
        most = max((r.get(kind, 0.0) for r in nodes), default=0.0)
        if want > most:
            raise MixlensError(f"{flag} {want:g}: no node of the Ray cluster has {want:g} {kind}s (the most: {most:g})")
    if tokenize_cpus and actors * cpus + tokenize_cpus > total:
        raise MixlensError(
            f"{actors} actors of {cpus:g} CPUs and tokenising tasks of --tokenize-cpus {tokenize_cpus:g} need more "
            f"than the cluster's {total:g} CPUs; use a smaller --concurrency or --tokenize-cpus"
        )


@contextlib.contextmanager
def _data_context() -> Iterator[None]:
    """Ray Data's settings for one run (restored after): nothing of its own on the terminal, no progress bars, INFO
    lines or error tracebacks (ours counts examples and a failure is one line; its log file keeps everything), and
    one row per block: a row is a shard, and Ray Data cuts a block larger than its byte target into pieces (or
    joins smaller ones) whatever its rows, so with any larger target a shard would reach an actor in pieces of a few
    examples each."""
    import logging
    import warnings

    from ray.data import DataContext

    ctx = DataContext.get_current()
    log = logging.getLogger("ray.data")
    saved = (ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.target_max_block_size, log.level)
    ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.target_max_block_size = False, False, 1
    consoles = [  # the terminal's handler, not the session's log file
        h for h in log.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    levels = [h.level for h in consoles]
    for h in consoles:
        h.setLevel(logging.CRITICAL + 1)
    if not consoles:
        log.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            yield
    finally:
        ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.target_max_block_size, level = saved
        log.setLevel(level)
        for h, lv in zip(consoles, levels, strict=True):
            h.setLevel(lv)


@dataclass
class Cluster:
    """Where and how wide: `address` (None: a new local Ray), actors and resources per actor."""

    address: str | None = None
    concurrency: int | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    # CPUs each tokenizing task asks for. Above 0 (or with GPU actors) the tokenizing is a stage of tasks of its own
    # (`staged`); at 0 with CPU actors, the default, the actors tokenize: the default pool takes every cluster CPU
    tokenize_cpus: float = 0.0


def run(
    data: str,
    out_arg: str | Path | OutDir,
    job: Job,
    fmt: str | None,
    text_column: str | None,
    pair_column: str | None,
    strict: bool,
    overwrite: bool,
    cluster: Cluster,
    params: dict,
    progress: bool,
):
    """The Ray Data run of `job` (its data, columns and stamp are filled in here); see the module doc."""
    from mixlens.corpus.runner import (
        CorpusResult,
        _check_model,
        _check_out,
        _locked,
        _Progress,
        _shown,
        build_manifest,
    )

    out = OutDir.of(out_arg)

    is_hf = data.startswith(HF_PREFIX)
    files = [] if is_hf else input_files(data, fmt)
    fmt = None if is_hf else (fmt or detect_format(files[0]))
    if fmt is not None and fmt not in FORMATS:
        raise MixlensError(f"unknown data format '{fmt}'; valid: {', '.join(FORMATS)}")
    parts = [Part(0, data)] if is_hf else plan_parts(files, fmt or "text")
    # the first readable example, before the model and --out: empty files, unknown columns fail here
    columns, records = open_records(data if is_hf else files[0], fmt)
    tcol, pcol = resolve_columns(columns, text_column, pair_column, data)
    list(itertools.islice(examples_from(records, tcol, pcol, strict, None, data), 1))
    stamp = [{"file": str(f), "size": f.size, "mtime_ns": f.fs.get_file_info(f.path).mtime_ns} for f in files]
    job = replace(
        job,
        data=data if (is_hf or "://" in data) else str(Path(data).expanduser().resolve()),
        fmt=fmt,
        text_column=tcol,
        pair_column=pcol,
        data_file={"files": stamp} if stamp else None,
        layout="index",
    )
    _check_model(job.model, job.gguf_file, None, job.max_length, pcol is not None)
    with _locked(out):
        _check_out(out, job, overwrite)
        out.mkdir(sh.SHARD_DIR)
        out.mkdir(SKIP_DIR)
        sh.remove_stale_temps(out)
        old = sh.read_manifest(out)
        done = sh.finished_shards(out, job.job_id)
        claimed = claimed_indexes(out, done)
        resumed = len(done)
        was_complete = bool(old and old.get("complete") and old.get("job_id") == job.job_id)
        was_complete = was_complete and {int(i["shard"]) for i in old["shards"]} <= set(done)  # type: ignore[index]
        ray_info: dict[str, Any] = dict(old.get("ray", {})) if was_complete and old else {}

        def manifest(complete: bool) -> dict:
            m = build_manifest(out, job, done, resumed, skipped_counts(out), params, complete)
            return {**m, "ray": ray_info} if ray_info else m

        sh.write_manifest(out, manifest(False))
        if not was_complete:  # a finished run is only checked and its aggregate rewritten: no Ray is started
            ray, started, logs = start_ray(cluster.address)
            total: int | None = None
            try:
                res = ray.cluster_resources()
                gpus = (
                    cluster.num_gpus
                    if cluster.num_gpus is not None
                    else (1.0 if job.device.startswith("cuda") else 0.0)
                )
                cpus = cluster.num_cpus if cluster.num_cpus is not None else (0.0 if gpus else 1.0)
                free = res.get("CPU", 1) - cluster.tokenize_cpus  # CPUs the tokenising tasks leave to the actors
                n = cluster.concurrency or max(1, int(res.get("GPU", 0) / gpus if gpus else free / max(cpus, 1)))
                check_resources(ray, n, cpus, gpus, cluster.tokenize_cpus)
                ray_info.update(
                    {
                        "address": cluster.address or "local",
                        "actors": n,
                        "num_cpus": cpus,
                        "num_gpus": gpus,
                        "tokenize_cpus": cluster.tokenize_cpus,
                        "tokenize_stage": staged(cluster.tokenize_cpus, gpus),
                        "logs": logs,
                    }
                )
                total = (
                    sum(p.rows or 0 for p in parts)
                    if fmt == "parquet"
                    else (count_records(data, fmt) if not is_hf and "://" not in data and len(files) == 1 else None)
                )
                bar = _Progress(max(total - claimed.size, 0) if total is not None else None) if progress else None
                from ray.data import Datasource, ReadTask
                from ray.data.block import BlockMetadata

                done_ref = ray.put(claimed)

                class _Source(Datasource):
                    def estimate_inmemory_data_size(self) -> int | None:
                        return None

                    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
                        return [
                            ReadTask(
                                functools.partial(
                                    read_part, p, fmt or "text", tcol, pcol, strict, done_ref, out, job.shard_size
                                ),
                                BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None),
                            )
                            for p in parts
                        ]

                # one block per shard: each is one task of the actor pool, spread over actors and nodes
                with _data_context(), bar or contextlib.nullcontext():
                    ds = ray.data.read_datasource(_Source(), override_num_blocks=len(parts), num_cpus=0)
                    if staged(cluster.tokenize_cpus, gpus):
                        ds = ds.map_batches(  # CPU tasks: one shard at a time, tokenizer cached per worker
                            tokenize_block,
                            fn_args=(job,),
                            batch_size=None,
                            batch_format="pyarrow",
                            num_cpus=cluster.tokenize_cpus,
                        )
                    ds = ds.map_batches(
                        ShardWriter,
                        fn_constructor_args=(job, out, max(1, int(cpus or 1))),
                        batch_size=None,
                        batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=n),
                        num_cpus=cpus,
                        num_gpus=gpus,
                        max_restarts=RETRIES,
                        max_task_retries=RETRIES,
                    )
                    nodes: dict[str, int] = dict(ray_info.get("nodes", {}))  # examples computed per node
                    for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                        for text, node in zip(b["info"].to_pylist(), b["node"].to_pylist(), strict=True):
                            info = json.loads(text)
                            done[int(info["shard"])] = info
                            nodes[node] = nodes.get(node, 0) + int(info["examples"])
                            if bar:
                                bar.advance(info["examples"])
                        ray_info["nodes"] = dict(sorted(nodes.items()))
                        sh.write_manifest(out, manifest(False))
            except KeyboardInterrupt:  # the manifest names every shard written so far, then the CLI says how to resume
                done.update(sh.finished_shards(out, job.job_id))
                sh.write_manifest(out, manifest(False))
                raise
            except Exception as e:
                from_ray = isinstance(e, ray.exceptions.RayError) or type(e).__module__.startswith("ray")
                if not from_ray:
                    raise
                done.update(sh.finished_shards(out, job.job_id))
                why = explain_failure(e, ray)
                kept = sum(i["examples"] for i in done.values())
                lost = ""
                if total is not None:
                    m, ranges = missing_ranges(claimed_indexes(out, done), total)
                    lost = f"; {m} of {total} rows are in no shard (source indexes {ranges})" if m else ""
                    ray_info["lost_rows"] = m
                ray_info["stopped"] = why
                sh.write_manifest(out, manifest(False))
                raise MixlensError(
                    f"the Ray Data run stopped: {why}; {len(done)} shards ({kept} examples) are kept in {out}{lost}; "
                    "rerun the same command to compute the rest" + (f" (Ray logs: {logs})" if logs else "")
                ) from None
            finally:
                if started:
                    ray.shutdown()
        done.update(sh.finished_shards(out, job.job_id))  # files the actors wrote (the info rows say the same)
        claimed_indexes(out, done)
        sh.write_aggregate(out, sh.merge_shards(out, list(done)))
        final = manifest(True)
        sh.write_manifest(out, final)
        return CorpusResult(_shown(out_arg), final)
