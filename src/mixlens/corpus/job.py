"""What a corpus run computes (`Job`, its identity for resuming) and where its input is cut into shards."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mixlens.corpus.readers import Example

if TYPE_CHECKING:
    from mixlens.lens import Lens

STORES = ("summary", "full")
BACKENDS = ("local", "ray", "ray-data")
# Keys of the job that change results: a rerun with other values is refused unless --overwrite.
IDENTITY = (
    "model",
    "gguf_file",
    "head",
    "data",
    "data_file",
    "fmt",
    "text_column",
    "pair_column",
    "methods",
    "heads",
    "options",
    "store",
    "shard_size",
    "max_length",
    "dtype",
)
# Identity keys a manifest may lack, and their value then: written before the key existed (dtype), or left out of
# the identity at its default so that existing job ids stay the same (layout).
OLD_DEFAULTS = {"dtype": "float32", "layout": "windows"}
# How rows are cut into shards: "windows" (shard k = the k-th window of `shard_size` readable examples: local, worker
# processes, Ray actors) or "index" (Ray Data: a shard holds up to `shard_size` examples as they stream in, is named
# by its first source index, and a rerun computes the source indexes no shard holds).
LAYOUTS = ("windows", "index")


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
    allow_random_head: bool = False  # `mixlens.load(allow_random_head=...)`; not part of the identity
    device: str = "cpu"
    data_file: dict[str, object] | None = None  # `file_stamp(data)` of a local file: same path, other bytes → new run
    gguf_file: str | None = None  # a GGUF file inside the `model` directory (`mixlens.load(gguf_file=...)`)
    dtype: str = "float32"  # the forward pass's dtype (`mixlens.load(dtype=...)`)
    layout: str = "windows"  # see LAYOUTS; part of the identity (only named there when not the default)

    def load(self) -> Lens:
        """The job's model, as every backend loads it."""
        from mixlens.lens import load

        return load(
            self.model,
            gguf_file=self.gguf_file,
            head=self.head,
            device=self.device,
            allow_random_head=self.allow_random_head,
            dtype=self.dtype,
        )

    def identity(self) -> dict[str, object]:
        d = asdict(self)
        d["model"] = self.model_name
        d["methods"] = list(self.methods)
        ident = {k: d[k] for k in IDENTITY}
        if self.layout != OLD_DEFAULTS["layout"]:
            ident["layout"] = self.layout
        return ident

    @property
    def job_id(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


def file_stamp(path: Path) -> dict[str, object]:
    """{size, mtime_ns, sha256} of a data file; its bytes are hashed in 1 MiB blocks (never the file whole)."""
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def chunks(examples: Iterator[Example], size: int) -> Iterator[list[Example]]:
    """The input stream cut into shards of `size` examples, in input order (the last one may be shorter)."""
    chunk: list[Example] = []
    for e in examples:
        chunk.append(e)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
