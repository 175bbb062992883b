"""Stream examples from TSV/CSV/JSONL/Parquet/plain-text files or a `datasets` name/split.

Nothing here loads a file whole: text formats are read line by line, Parquet by record batches.
Every reader yields `Example(index, text, fields)`; `index` is the 0-based record number in the source
(records that were skipped still use up their number, so an index always names the same row).

Bad records never stop a run unless `strict=True`: undecodable lines (not UTF-8), malformed rows
(wrong field count, broken JSON, missing/null text) and empty texts are skipped and counted in `stats`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mixlens import jsonio
from mixlens.errors import MixlensError
from mixlens.texts import has_visible

Text = str | tuple[str, str]
FORMATS = ("tsv", "csv", "jsonl", "parquet", "text")
_SUFFIX = {
    ".tsv": "tsv",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
}
# Default columns, tried in order when --text-column is not given; the pairs win when both columns exist.
TEXT_DEFAULTS = ("sentence", "text", "content", "document", "question", "premise")
PAIR_DEFAULTS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"))
HF_PREFIX = "hf:"
_PARQUET_BATCH = 1024


@dataclass(frozen=True)
class Example:
    """One input record: `text` is what the model reads (a str, or a (str, str) pair); `fields` is the whole row."""

    index: int
    text: Text
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadStats:
    """Counters filled while reading (a plain dict with the same keys works too)."""

    read: int = 0  # examples yielded
    undecodable: int = 0  # lines that are not valid UTF-8, skipped
    malformed: int = 0  # rows with a wrong field count, broken JSON or a missing text, skipped
    empty: int = 0  # rows whose text is empty or whitespace only, skipped

    def as_dict(self) -> dict[str, int]:
        return {"read": self.read, "undecodable": self.undecodable, "malformed": self.malformed, "empty": self.empty}


Stats = ReadStats | MutableMapping[str, int] | None


@dataclass(frozen=True)
class FsFile:
    """A file on a pyarrow filesystem (local, `s3://`, `gs://`, …), read by the same readers as a local `Path`."""

    fs: Any  # pyarrow.fs.FileSystem
    path: str  # the path inside `fs`
    uri: str  # as the user wrote it (messages)
    size: int

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    def open(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(self.fs.open_input_stream(self.path))

    def __str__(self) -> str:
        return self.uri


Source = Path | FsFile


def _size(path: Source) -> int:
    return path.size if isinstance(path, FsFile) else path.stat().st_size


def _bump(stats: Stats, key: str) -> None:
    if stats is None:
        return
    if isinstance(stats, MutableMapping):
        stats[key] = stats.get(key, 0) + 1
    else:
        setattr(stats, key, getattr(stats, key) + 1)


def detect_format(path: Source) -> str:
    """The format from the file suffix; unknown suffixes are read as plain text (one example per line)."""
    return _SUFFIX.get(path.suffix.lower(), "text")


# ---------------------------------------------------------------- records: (index, row dict | None) per format
# Readers never raise on bad records themselves: a `_Bad` carries the reason up to `iter_examples`,
# which counts it or, with `strict`, raises.


class _Bad(Exception):
    def __init__(self, kind: str, where: str) -> None:
        super().__init__(where)
        self.kind, self.where = kind, where


def _lines(path: Source) -> Iterator[tuple[int, str | _Bad]]:
    """(1-based line number, decoded line or _Bad) for each line, in binary chunks; never the file whole."""
    with path.open("rb") as fh:
        for no, raw in enumerate(fh, start=1):
            if no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield no, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield no, _Bad("undecodable", f"line {no} is not valid UTF-8")


def _delimited(path: Source, fmt: str) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """Header + rows of a TSV (no quoting, like GLUE files) or CSV (standard quoting)."""
    kw: dict[str, Any] = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if fmt == "tsv" else {}
    lines = _lines(path)
    header: list[str] | None = None
    for _, line in lines:
        if isinstance(line, _Bad):
            raise MixlensError(f"{path}: the header ({line.where}) cannot be read")
        if line.strip():
            header = next(csv.reader([line], **kw))
            break
    if header is None:
        raise MixlensError(f"{path} is empty (no header and no rows)")
    header = [h.strip() for h in header]

    def rows() -> Iterator[dict[str, Any] | _Bad]:
        bad: list[_Bad] = []
        at = [0]  # the file's line number of the last line the reader took (a row ends there)

        def good_lines() -> Iterator[str]:
            for no, line in lines:
                if isinstance(line, _Bad):
                    bad.append(line)
                    continue
                at[0] = no
                yield line

        reader = csv.reader(good_lines(), **kw)
        while True:
            try:
                values = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                yield _Bad("malformed", f"line {at[0]}: {e}")
                continue
            while bad:  # undecodable lines met while reading this row keep their place in the numbering
                yield bad.pop(0)
            if not values or values == [""]:
                continue  # blank line
            if len(values) != len(header):
                yield _Bad("malformed", f"line {at[0]} has {len(values)} fields, the header {len(header)}")
                continue
            yield dict(zip(header, values, strict=True))
        yield from bad

    return header, rows()


def _jsonl(path: Source) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """One JSON object per line; the columns are the keys of the first object."""
    lines = _lines(path)

    def parse(no: int, line: str | _Bad) -> dict[str, Any] | _Bad | None:
        if isinstance(line, _Bad):
            return line
        if not line.strip():
            return None
        try:
            obj = jsonio.loads(line, f"line {no}")
        except MixlensError as e:  # not JSON, nested too deeply, not an object
            return _Bad("malformed", str(e))
        if "\\u" in line:  # a \uD800-style escape can decode to a lone surrogate, which no UTF-8 writer takes
            try:
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                return _Bad("malformed", f"line {no} holds a lone surrogate escape (not valid Unicode)")
        return obj

    first: list[dict[str, Any] | _Bad] = []
    for no, line in lines:
        rec = parse(no, line)
        if rec is None:
            continue
        first.append(rec)
        if isinstance(rec, dict):
            break
    if not any(isinstance(r, dict) for r in first):
        if first:
            bad = first[0]
            assert isinstance(bad, _Bad)  # no record is a dict
            raise MixlensError(f"{path} has no readable JSON object ({bad.where})")
        raise MixlensError(f"{path} is empty (no rows)")

    def rows() -> Iterator[dict[str, Any] | _Bad]:
        yield from first
        for no, line in lines:
            rec = parse(no, line)
            if rec is not None:
                yield rec

    head = first[-1]
    assert isinstance(head, dict)  # the loop above stops at the first object
    return list(head), rows()


def _parquet(path: Source, row_groups: list[int] | None = None) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """Parquet by record batches (bounded memory); values stay native Python objects. `row_groups`: only those."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path.fs.open_input_file(path.path) if isinstance(path, FsFile) else path)
    except Exception as e:  # pyarrow raises several types for non-Parquet bytes
        raise MixlensError(f"{path} is not a readable Parquet file ({e})") from None
    if pf.metadata.num_rows == 0:
        raise MixlensError(f"{path} is empty (no rows)")

    def rows() -> Iterator[dict[str, Any] | _Bad]:
        batches = pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=row_groups)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # corrupt data pages behind a valid footer: pyarrow raises OSError/ArrowException
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise MixlensError(f"{path}: the Parquet data cannot be read ({first})") from None
            yield from batch.to_pylist()

    return list(pf.schema_arrow.names), rows()


def _text(path: Source) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """One example per non-blank line, in the column 'text'."""
    if _size(path) == 0:
        raise MixlensError(f"{path} is empty (no lines)")

    def rows() -> Iterator[dict[str, Any] | _Bad]:
        for _, line in _lines(path):
            if isinstance(line, _Bad):
                yield line
            elif line.strip():
                yield {"text": line.rstrip("\r\n")}

    return ["text"], rows()


def _hf(src: str) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """`hf:NAME[:CONFIG][:SPLIT]` (split defaults to 'train'), streamed with `datasets`."""
    parts = src[len(HF_PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3:
        raise MixlensError(
            f"bad dataset '{src}'; expected hf:NAME[:CONFIG]:SPLIT, e.g. hf:nyu-mll/glue:sst2:validation"
        )
    name, config = parts[0], (parts[1] if len(parts) == 3 else None)
    split = parts[-1] if len(parts) > 1 else "train"
    try:
        import datasets
    except ImportError:
        raise MixlensError(
            "reading a Hugging Face dataset needs the 'datasets' package (pip install datasets)"
        ) from None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        it = iter(ds)
        first = next(it)
    except StopIteration:
        raise MixlensError(f"dataset {name} split '{split}' is empty") from None
    except Exception as e:  # network, unknown name/config/split: all user-facing
        raise MixlensError(
            f"cannot load dataset {name} (config {config}, split {split}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None

    def rows() -> Iterator[dict[str, Any] | _Bad]:
        yield first
        yield from it

    return list(first), rows()


def open_records(
    src: str | Path | FsFile, fmt: str | None = None, row_groups: list[int] | None = None
) -> tuple[list[str], Iterator[dict[str, Any] | _Bad]]:
    """(column names, record iterator) for SRC; raises MixlensError for a missing/empty/unreadable source.
    `row_groups`: of a Parquet file, only those."""
    if isinstance(src, str) and src.startswith(HF_PREFIX):
        return _hf(src)
    path: Source
    if isinstance(src, FsFile):
        path = src
    else:
        path = Path(src).expanduser()
        if not path.exists():
            raise MixlensError(f"data file '{src}' does not exist")
        if not path.is_file():
            raise MixlensError(f"data source '{src}' is not a file")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise MixlensError(f"unknown data format '{fmt}'; valid: {', '.join(FORMATS)}")
    if _size(path) == 0:
        raise MixlensError(f"{src} is empty")
    if fmt == "parquet":
        return _parquet(path, row_groups)
    readers: dict[str, Callable[..., tuple[list[str], Iterator[dict[str, Any] | _Bad]]]] = {
        "tsv": _delimited,
        "csv": _delimited,
        "jsonl": _jsonl,
        "parquet": _parquet,
        "text": _text,
    }
    return readers[fmt](path, *((fmt,) if fmt in ("tsv", "csv") else ()))


def resolve_columns(
    columns: list[str], text_column: str | None, pair_column: str | None, where: str
) -> tuple[str, str | None]:
    """(text column, pair column or None) from the user's choice or the defaults; clear errors otherwise."""
    avail = ", ".join(columns) or "none"
    for name, flag in ((text_column, "--text-column"), (pair_column, "--pair-column")):
        if name is not None and name not in columns:
            raise MixlensError(f"{where} has no column '{name}' ({flag}); available columns: {avail}")
    if text_column is not None:
        return text_column, pair_column
    if pair_column is None:
        for a, b in PAIR_DEFAULTS:
            if a in columns and b in columns:
                return a, b
    for name in TEXT_DEFAULTS:
        if name in columns and name != pair_column:
            return name, pair_column
    if len(columns) == 1 and columns[0] != pair_column:
        return columns[0], pair_column
    raise MixlensError(
        f"{where}: cannot tell which column holds the text; pass --text-column (available columns: {avail})"
    )


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    return (value if isinstance(value, str) else str(value)).strip()


def iter_examples(
    src: str | Path,
    text_column: str | None = None,
    pair_column: str | None = None,
    strict: bool = False,
    stats: Stats = None,
    *,
    fmt: str | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> Iterator[Example]:
    """Stream the examples of SRC (a file path, or `hf:NAME[:CONFIG]:SPLIT` for a `datasets` dataset).

    Errors about the source itself (missing file, unknown column, empty file) are raised right away, before
    the first example is asked for. Bad records are skipped and counted in `stats` (`undecodable`,
    `malformed`), or raise MixlensError with `strict=True`; `on_skip(kind, where)` hears of each one skipped
    ("malformed", "line 7 holds a lone surrogate escape"). `fmt` overrides the suffix-based format.
    """
    columns, records = open_records(src, fmt)
    where = str(src)
    tcol, pcol = resolve_columns(columns, text_column, pair_column, where)
    return examples_from(records, tcol, pcol, strict, stats, where, on_skip)


def examples_from(
    records: Iterator[dict[str, Any] | _Bad],
    tcol: str,
    pcol: str | None,
    strict: bool,
    stats: Stats,
    where: str,
    on_skip: Callable[[str, str], None] | None = None,
    start: int = 0,
    require_row: bool = True,
) -> Iterator[Example]:
    """Examples of `records`, numbered from `start` (the source index of the first record); without one readable
    record it raises, unless `require_row` is False (a part of a larger source)."""
    any_row, index = False, start - 1
    for index, rec in enumerate(records, start):
        if isinstance(rec, dict):
            a = _as_text(rec.get(tcol))
            b = _as_text(rec.get(pcol)) if pcol is not None else ""
            if a is None or b is None:
                rec = _Bad("malformed", f"record {index} has no value in column '{tcol if a is None else pcol}'")
            elif not has_visible(a) or (pcol is not None and not has_visible(b)):
                rec = _Bad("empty", f"record {index} has an empty text")
        if isinstance(rec, _Bad):
            if strict:
                raise MixlensError(f"{where}: {rec.where} (run without --strict to skip such records)")
            _bump(stats, rec.kind)
            if on_skip:
                on_skip(rec.kind, rec.where)
            continue
        any_row = True
        _bump(stats, "read")
        assert a is not None and b is not None  # a record that stays a dict has both texts
        yield Example(index, (a, b) if pcol is not None else a, rec)
    if not any_row and require_row:
        raise MixlensError(
            f"{where} has no rows" if index < start else f"{where} has no readable rows ({index + 1 - start} skipped)"
        )


def count_records(src: str | Path, fmt: str | None = None) -> int | None:
    """A cheap upper bound on the number of records (for progress bars): data lines, or Parquet row count."""
    if isinstance(src, str) and src.startswith(HF_PREFIX):
        return None
    path = Path(src).expanduser()
    if not path.is_file():
        return None
    fmt = fmt or detect_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    n, last = 0, b"\n"
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    n += last != b"\n"
    return max(n - (fmt in ("tsv", "csv")), 0)
