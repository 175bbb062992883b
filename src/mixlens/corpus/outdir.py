"""The output directory of a corpus run: a local folder or any pyarrow filesystem URI (`file://`, `s3://`, `gs://`,
`hdfs://`, ...), or a directory on a `pyarrow.fs.FileSystem` object given from Python.

Everything a corpus run writes and reads back (shards with their partial sums, the manifest, the aggregate, the Ray
Data read tasks' bad-record counts) goes through `OutDir`, on every backend, so that resuming is one
implementation whatever holds the files. Writes are whole-file: a local folder gets `atomic_write` (temp file,
fsync, rename); an object store gets one upload (an object appears whole or not at all); another filesystem a
temp file beside the target, then a move. Paths inside the directory are relative, with `/`.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from mixlens.atomic import atomic_write
from mixlens.errors import MixlensError

OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})  # filesystems where one upload is already atomic


def _why(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_uri(out: object) -> bool:
    return isinstance(out, str) and "://" in out


@dataclass(frozen=True)
class OutDir:
    """A directory `base` on the filesystem `fs`; `name` is how messages show it (what the user gave)."""

    fs: pafs.FileSystem
    base: str
    name: str

    @classmethod
    def of(cls, out: str | Path | OutDir) -> OutDir:
        """`out` as given to `run_corpus` / `--out`: a local path, a filesystem URI or an `OutDir`."""
        if isinstance(out, OutDir):
            return out
        if is_uri(out):
            try:
                fs, base = pafs.FileSystem.from_uri(str(out))
            except (pa.ArrowException, OSError, ValueError) as e:
                raise MixlensError(f"cannot use --out '{out}': {_why(e)}") from None
            return cls(fs, base.rstrip("/") or "/", str(out))
        return cls(pafs.LocalFileSystem(), str(Path(out).expanduser().absolute()), str(out))

    @property
    def local(self) -> Path | None:
        """The folder as a local path when the filesystem is this machine's (a plain path or a `file://` URI)."""
        return Path(self.base) if isinstance(self.fs, pafs.LocalFileSystem) else None

    def path(self, rel: str = "") -> str:
        """`rel` as a path of `fs`."""
        return f"{self.base.rstrip('/')}/{rel}" if rel else self.base

    def show(self, rel: str = "") -> str:
        """`rel` as messages name it."""
        if not rel:
            return self.name
        return str(Path(self.name) / rel) if not is_uri(self.name) else f"{self.name.rstrip('/')}/{rel}"

    def __str__(self) -> str:
        return self.name

    def _info(self, rel: str) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path(rel))
        except (pa.ArrowException, OSError) as e:
            raise MixlensError(f"cannot read '{self.show(rel)}': {_why(e)}") from None

    def exists(self, rel: str = "") -> bool:
        return self._info(rel).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        return self._info(rel).type == pafs.FileType.Directory

    def is_file(self, rel: str = "") -> bool:
        return self._info(rel).type == pafs.FileType.File

    def names(self, rel: str = "") -> list[str]:
        """The sorted names of the entries (files and folders) directly in `rel`; none when it does not exist."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        except (pa.ArrowException, OSError) as e:
            raise MixlensError(f"cannot read '{self.show(rel)}': {_why(e)}") from None
        return sorted(i.base_name for i in infos)

    def mkdir(self, rel: str = "") -> None:
        try:
            self.fs.create_dir(self.path(rel), recursive=True)
        except (pa.ArrowException, OSError) as e:
            raise MixlensError(f"cannot write to '{self.show(rel)}': {_why(e)}") from None

    def read(self, rel: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return bytes(f.readall())
        except (pa.ArrowException, OSError) as e:
            raise MixlensError(f"cannot read '{self.show(rel)}': {_why(e)}") from None

    def open(self, rel: str) -> Any:
        """A random-access file for pyarrow's readers (Parquet footers, columns); the caller closes it."""
        return self.fs.open_input_file(self.path(rel))

    def write(self, rel: str, data: bytes) -> None:
        """Write the whole file `rel` so that no reader sees part of it (see the module doc)."""
        local = self.local
        if local is not None:
            atomic_write(local / rel, data)
            return
        parent, _, leaf = self.path(rel).rpartition("/")
        target = self.path(rel)
        tmp = target if self.fs.type_name in OBJECT_STORES else f"{parent}/.{leaf}.{uuid.uuid4().hex}.tmp"
        try:
            self.fs.create_dir(parent, recursive=True)
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            if tmp != target:
                self.fs.move(tmp, target)
        except (pa.ArrowException, OSError) as e:
            if tmp != target:
                with contextlib.suppress(pa.ArrowException, OSError):
                    self.fs.delete_file(tmp)
            raise MixlensError(f"cannot write '{self.show(rel)}': {_why(e)}") from None

    def delete(self, rel: str) -> None:
        """Remove the file `rel` if it is there."""
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            return
        except (pa.ArrowException, OSError) as e:  # some filesystems say "not found" as a plain OSError
            if self.exists(rel):
                raise MixlensError(f"cannot remove '{self.show(rel)}': {_why(e)}") from None
