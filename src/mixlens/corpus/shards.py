"""Shard files, mergeable partial sums and the run manifest of a corpus directory.

Layout of DIR (a local folder or a filesystem URI, read and written through `OutDir`):
    manifest.json              job identity, parameters, finished shards, counts (rewritten atomically)
    shards/shard-00000.parquet one row per example; its Parquet metadata holds the shard's partial sums
    aggregate.parquet          per (stat, method, layer, head): count, mean, std, min, max (when complete)

Partial sums (count, Σx, Σx², min, max in float64) are kept per key (stat, method, layer, head) so that
any set of shards merges in any order; the final merge runs in shard order, so a resumed run gives the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixlens import jsonio
from mixlens.corpus.outdir import OutDir
from mixlens.errors import MixlensError

FORMAT = "mixlens-corpus/1"
MANIFEST = "manifest.json"
AGGREGATE = "aggregate.parquet"
SHARD_DIR = "shards"
SKIPPED_DIR = "skipped"  # Ray Data runs: the bad-record counts of each read task, part-00000.json
SUMS_KEY = b"mixlens.sums"
INFO_KEY = b"mixlens.shard"
Key = tuple[str, str, int, int]  # (stat, method, layer, head); head = -1: all heads / not per head


def shard_file(shard_id: int) -> str:
    """The shard's file, relative to DIR."""
    return f"{SHARD_DIR}/shard-{shard_id:05d}.parquet"


@dataclass
class Sums:
    """Mergeable moments per key: count, sum, sum of squares, min, max (float64)."""

    data: dict[Key, np.ndarray] = field(default_factory=dict)  # key → [count, sum, sumsq, min, max]

    def add(self, stat: str, method: str, values: np.ndarray) -> None:
        """values [samples, layer] or [samples, layer, head]: one sample per row, per (layer, head) key."""
        v = np.asarray(values, dtype=np.float64)
        if v.shape[0] == 0:
            return
        v = v.reshape(v.shape[0], v.shape[1], -1) if v.ndim == 3 else v[:, :, None]
        per_head = values.ndim == 3
        part = np.stack(
            [np.full(v.shape[1:], v.shape[0], dtype=np.float64), v.sum(0), (v * v).sum(0), v.min(0), v.max(0)], axis=-1
        )  # [layer, head, 5]
        for layer in range(v.shape[1]):
            for h in range(v.shape[2]):
                self._merge_one((stat, method, layer, h if per_head else -1), part[layer, h])

    def add_scalar(self, stat: str, method: str, values: np.ndarray) -> None:
        """values [samples]: one key (stat, method, -1, -1), e.g. tokens per example."""
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if v.size:
            self._merge_one((stat, method, -1, -1), np.array([v.size, v.sum(), (v * v).sum(), v.min(), v.max()]))

    def _merge_one(self, key: Key, p: np.ndarray) -> None:
        q = self.data.get(key)
        if q is None:
            self.data[key] = p.copy()
            return
        q[0] += p[0]
        q[1] += p[1]
        q[2] += p[2]
        q[3] = min(q[3], p[3])
        q[4] = max(q[4], p[4])

    def merge(self, other: Sums) -> Sums:
        for k, p in other.data.items():
            self._merge_one(k, p)
        return self

    def to_json(self) -> str:
        keys = sorted(self.data)
        return json.dumps({"keys": [list(k) for k in keys], "values": [self.data[k].tolist() for k in keys]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Sums:
        d = jsonio.loads(text, "the shard's partial sums")
        return cls({tuple(k): np.asarray(v, dtype=np.float64) for k, v in zip(d["keys"], d["values"], strict=True)})

    def table(self) -> pa.Table:
        """The aggregate table: one row per key with count, mean, std (population), min, max."""
        keys = sorted(self.data)
        v = np.array([self.data[k] for k in keys]).reshape(-1, 5)
        count = v[:, 0]
        mean = v[:, 1] / np.maximum(count, 1)
        var = np.maximum(v[:, 2] / np.maximum(count, 1) - mean**2, 0)
        return pa.table(
            {
                "stat": [k[0] for k in keys],
                "method": [k[1] for k in keys],
                "layer": pa.array([k[2] for k in keys], pa.int32()),
                "head": pa.array([k[3] for k in keys], pa.int32()),
                "count": pa.array(count.astype(np.int64)),
                "mean": mean,
                "std": np.sqrt(var),
                "min": v[:, 3],
                "max": v[:, 4],
            }
        )


def shard_bytes(table: pa.Table, sums: Sums, info: dict) -> bytes:
    """Serialise a shard: the per-example table with its partial sums and info in the Parquet metadata."""
    meta = dict(table.schema.metadata or {})
    meta[SUMS_KEY] = sums.to_json().encode()
    meta[INFO_KEY] = json.dumps(info, sort_keys=True).encode()
    buf = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(meta), buf, compression="zstd")
    return buf.getvalue()


def read_shard_meta(out: OutDir, rel: str) -> tuple[Sums, dict]:
    """(partial sums, info) from the metadata of the shard file `rel` of `out`, without reading its rows."""
    with out.open(rel) as f:
        meta = pq.read_schema(f).metadata or {}
    if SUMS_KEY not in meta or INFO_KEY not in meta:
        raise MixlensError(f"{out.show(rel)} is not a mixlens corpus shard")
    try:
        return Sums.from_json(meta[SUMS_KEY]), jsonio.loads(meta[INFO_KEY], f"{out.show(rel)}: the shard info")
    except (KeyError, TypeError, ValueError) as e:  # MixlensError is a ValueError
        raise MixlensError(f"{out.show(rel)} is not a readable mixlens corpus shard ({e})") from None


def finished_shards(out: OutDir, job_id: str) -> dict[int, dict]:
    """{shard id: info} of complete shard files of this job in DIR (a shard is complete once renamed)."""
    done: dict[int, dict] = {}
    for name in out.names(SHARD_DIR):
        if not (name.startswith("shard-") and name.endswith(".parquet")):
            continue
        try:
            _, info = read_shard_meta(out, f"{SHARD_DIR}/{name}")
        except (MixlensError, OSError, pa.ArrowException):
            continue  # unreadable: recompute it
        if info.get("job_id") == job_id:
            done[int(info["shard"])] = info
    return done


def remove_stale_temps(out: OutDir) -> None:
    """Temp files of writes interrupted by a kill (named .NAME.*.tmp beside NAME)."""
    for d in ("", SHARD_DIR):
        for name in out.names(d):
            if name.startswith(".") and name.endswith(".tmp"):
                out.delete(f"{d}/{name}" if d else name)


def read_manifest(out: OutDir) -> dict | None:
    if not out.is_file(MANIFEST):
        return None
    try:
        m = jsonio.loads(out.read(MANIFEST), out.show(MANIFEST))
    except MixlensError as e:  # unreadable, not UTF-8, not JSON, nested too deeply, not an object
        raise MixlensError(f"{e}: not a readable mixlens manifest; use --overwrite to start again") from None
    if m.get("format") != FORMAT:
        raise MixlensError(f"{out.show(MANIFEST)} is not a mixlens corpus manifest; use another --out or --overwrite")
    return m


def write_manifest(out: OutDir, manifest: dict) -> None:
    out.write(MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def merge_shards(out: OutDir, shard_ids: list[int]) -> Sums:
    """Merge the partial sums of the given shards (in shard order, for reproducible bytes)."""
    total = Sums()
    for s in sorted(shard_ids):
        total.merge(read_shard_meta(out, shard_file(s))[0])
    return total


def write_aggregate(out: OutDir, sums: Sums) -> None:
    buf = io.BytesIO()
    pq.write_table(sums.table(), buf)
    out.write(AGGREGATE, buf.getvalue())


def clear_run(out: OutDir) -> None:
    """Remove the files of a previous run (--overwrite); nothing else in DIR is touched."""
    for name in out.names(SHARD_DIR):
        if name.startswith("shard-") and name.endswith(".parquet"):
            out.delete(f"{SHARD_DIR}/{name}")
    remove_stale_temps(out)
    for name in out.names(SKIPPED_DIR):
        if name.startswith("part-") and name.endswith(".json"):
            out.delete(f"{SKIPPED_DIR}/{name}")
    for name in (MANIFEST, AGGREGATE):
        out.delete(name)
