"""One shard of a corpus run: length-sorted batches → the public compute step → Parquet bytes with partial sums."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from mixlens.batching import Batch, Tokenized
from mixlens.corpus import shards as sh
from mixlens.corpus.job import Job
from mixlens.corpus.readers import Example
from mixlens.methods import get as get_method
from mixlens.pipeline import plan_batches, run_methods
from mixlens.stats.tokens import row_entropy, token_kinds, token_type_masses


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


def _batches(lens, job: Job, examples: list[Example], tokenized: Tokenized | None) -> Iterator[Batch]:
    """The shard's batches, longest first: `Lens.batches(order="length")` of the texts, or, for inputs tokenized
    already (`tokenized`, the Ray Data tokenizing stage), the same packing and trace of those token ids."""
    if tokenized is None:
        yield from lens.batches(
            [e.text for e in examples],
            job.batch_size,
            job.max_length,
            order="length",
            max_tokens=job.max_tokens,
            trace=job.methods,
        )
        return
    for rows in plan_batches(tokenized.lengths, job.batch_size, job.max_tokens):
        enc = tokenized.batch(lens.tokenizer, lens.device, rows)
        yield Batch(list(rows), enc, lens.trace_for(enc, job.methods))


def compute_shard(
    lens,
    job: Job,
    shard_id: int,
    examples: list[Example],
    on_batch: Callable[[int], None] | None = None,
    tokenized: Tokenized | None = None,
) -> tuple[bytes, dict]:
    """Run the job's methods over one shard; returns (Parquet bytes with partial sums in metadata, info).

    Per example (row): index, text(s), fields (JSON), n_tokens, truncated_from, per-layer mean mixing ratio
    per variant [L], reconstruction error [L] (both when a method used the norm engine), and per method with
    [layer, (head,) target, source] maps the per-layer entropy and token-type masses of the row-normalised |map|
    ([L], or [L][H] under `<method>.heads.*`); store=full adds the tokens and each method's matrix flattened with
    its shape. `tokenized`: the examples' tokens, when a tokenizing stage made them (else they are tokenized here).
    """
    specs = [get_method(m) for m in job.methods]
    firsts = [e.text[0] if isinstance(e.text, tuple) else e.text for e in examples]
    pairs = [e.text[1] for e in examples] if isinstance(examples[0].text, tuple) else None
    n_ex = len(examples)
    summary: dict[str, np.ndarray] = {}  # column → [examples, layer(, head)]
    samples: dict[tuple[str, str, int], list[np.ndarray]] = {}  # (stat, method, ndim) → [samples, layer(, head)]
    n_tokens, trunc_from = np.zeros(n_ex, np.int64), np.zeros(n_ex, np.int64)
    tokens: list[list[str]] = [[] for _ in range(n_ex)]
    full: dict[str, list[np.ndarray]] = {s.name: [np.empty(0)] * n_ex for s in specs} if job.store == "full" else {}
    shapes: dict[str, list[list[int]]] = {s.name: [[]] * n_ex for s in specs}
    per_head = [s.name for s in specs if job.heads and s.head_dims]

    def put(column: str, stat: str, method: str, pos: list[int], values: np.ndarray) -> None:
        if column not in summary:
            summary[column] = np.zeros((n_ex, *values.shape[1:]), np.float32)
        summary[column][pos] = values
        samples.setdefault((stat, method, values.ndim), []).append(values)

    for bt in _batches(lens, job, examples, tokenized):
        trace = bt.trace
        assert trace is not None  # asked for: trace=job.methods
        batch, enc, mask = bt.index, bt.enc, trace.mask
        n_tok = mask.sum(1)
        n_tokens[batch] = n_tok.cpu().numpy()
        trunc_from[batch] = enc.truncated
        step = run_methods(trace, job.methods, heads=job.heads, options=job.options)
        outs = step.values
        summed = (
            run_methods(trace, per_head, options={k: v for k, v in job.options.items() if k in per_head}).values
            if per_head
            else {}
        )
        kinds = token_kinds(lens, enc.inputs["input_ids"], mask)
        tok_mask = mask.cpu()
        if step.norms is not None:
            put("recon_error", "reconstruction_error", "", batch, step.norms.error.cpu().numpy())
            for v, ratio in step.norms.ratio.items():
                r = ratio.cpu()  # [B, L, n], padded tokens 0
                summary.setdefault(f"ratio.{v}", np.zeros((n_ex, r.shape[1]), np.float32))[batch] = (
                    r.sum(-1) / n_tok.cpu()[:, None]
                ).numpy()
                samples.setdefault(("mixing_ratio", v, 2), []).append(r.permute(0, 2, 1)[tok_mask].numpy())  # [T, L]
        for s in specs:
            maps = (
                {"": summed[s.name], "heads.": outs[s.name]}
                if s.name in summed
                else {("heads." if job.heads and s.head_dims else ""): outs[s.name]}
            )
            for prefix, m in maps.items():
                if not _has_maps(s.dims_for(bool(prefix))):
                    continue
                a = _rows_normalised(m)
                stats = {
                    "entropy": row_entropy(a, mask),
                    **{f"mass.{t}": x for t, x in token_type_masses(a, kinds, mask).items()},
                }
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
        for name, rows in full.items():
            cols[name] = pa.array(rows, pa.list_(pa.float32()))
            cols[f"{name}.shape"] = pa.array(shapes[name], pa.list_(pa.int32()))
    info = {
        "job_id": job.job_id,
        "shard": shard_id,
        "examples": n_ex,
        "first_index": examples[0].index,
        "last_index": examples[-1].index,
        "tokens": int(n_tokens.sum()),
        "truncated": int((trunc_from > 0).sum()),
    }
    return sh.shard_bytes(pa.table(cols), sums, info), info
