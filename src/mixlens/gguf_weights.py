"""Reading a GGUF checkpoint tensor by tensor into the dtype the forward pass runs in, and saying before any weights
load when a checkpoint cannot be read or cannot fit this machine's memory.

transformers 5.25 de-quantises a GGUF file (for the architectures its packed-weight path does not cover) into a
state dict of every tensor and then copies it into a model it has allocated: about 2.7× the bfloat16 weights at the
peak on SmolLM2-135M. Here the model is built with its parameters on the meta device, each GGUF tensor is read from
the file with `pread` (no memory map: touched file pages would count as resident memory), de-quantised in float32
by the `gguf` package, given transformers' own name mapping and tensor fix-ups (`TENSOR_PROCESSORS`), cast to the
requested dtype and assigned to its parameter. The embedding and output matrices, the largest tensors, are
de-quantised a slab of rows at a time, so the float32 copy never exceeds a few tens of megabytes.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from mixlens.errors import MixlensError

ROW_SLAB_ELEMENTS = 1 << 23  # float32 elements de-quantised at once for the row-sliced tensors (32 MiB)
ROW_SLICED = ("token_embd.weight", "output.weight")  # tensors no transformers processor changes; the largest


class TensorInfo(NamedTuple):
    """Where one tensor lies in a GGUF file and how it is stored; `shape` as the reader gives it (numpy order; rows ×
    bytes of a row for quantised types), `np_dtype` its stored element type."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    np_dtype: Any
    n_elements: int
    n_bytes: int
    data_offset: int


_LAST: dict[tuple[str, int, int], tuple[str, list[TensorInfo]]] = {}  # the last file read: checked, then loaded


def tensor_infos(path: Path) -> tuple[str, list[TensorInfo]]:
    """(architecture, tensors) of a GGUF file. The reader's parse of the metadata (the tokenizer's vocabulary: about
    0.15 GiB and 8 s for 49k tokens) is dropped before any weights load; the last file's result is kept."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _LAST:
        return _LAST[key]
    reader = _reader(path)
    arch = _architecture(reader)
    infos = [
        TensorInfo(
            t.name,
            t.tensor_type,
            tuple(t.data.shape),
            t.data.dtype,
            int(t.n_elements),
            int(t.n_bytes),
            int(t.data_offset),
        )
        for t in reader.tensors
    ]
    del reader
    gc.collect()
    _LAST.clear()
    _LAST[key] = (arch, infos)
    return arch, infos


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # a truncated or corrupt file fails inside the reader (struct.error, ValueError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MixlensError(f"cannot read the GGUF file '{path}' (truncated or corrupt?): {first}") from None


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _readable_architecture(arch: str) -> bool:
    """Whether transformers' GGUF config reader knows `arch` (its own renamings included)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    return arch in GGUF_SUPPORTED_ARCHITECTURES or renamed.get(arch) in GGUF_SUPPORTED_ARCHITECTURES


def check_gguf(path: Path, dtype: torch.dtype) -> int:
    """Bytes the de-quantised weights take in `dtype`. A GGUF architecture transformers cannot read, a tensor type
    the `gguf` package cannot de-quantise, and weights larger than the memory this machine has available are each
    one line (`MixlensError`), before any weights load."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    arch, infos = tensor_infos(path)
    if not _readable_architecture(arch):
        raise MixlensError(
            f"the GGUF file '{path.name}' holds a '{arch or 'unnamed'}' model, an architecture transformers cannot"
            " read from GGUF (convert it to a Hugging Face folder, or use a supported architecture)"
        )
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    bad = sorted(
        {t.tensor_type.name for t in infos if t.tensor_type not in plain and t.tensor_type not in _type_traits}
    )
    if bad:
        first = next(t.name for t in infos if t.tensor_type.name == bad[0])
        raise MixlensError(
            f"the GGUF file '{path.name}' stores tensors as {', '.join(bad)} (first: {first}), which mixlens cannot"
            " de-quantise (the gguf package has no de-quantiser for it)"
        )
    need = sum(t.n_elements for t in infos) * torch.finfo(dtype).bits // 8
    check_fits(need, f"the GGUF file '{path.name}'", dtype)
    return need


def safetensors_bytes(folder: Path, dtype: torch.dtype | None) -> int:
    """Bytes a folder's safetensors weights take in `dtype` (None: as stored), from their headers only."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118  (safetensors' handle is not a mapping)
                sl = st.get_slice(k)
                n = int(np.prod(sl.get_shape()))
                stored = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
                size = stored.get(sl.get_dtype(), 4)
                total += n * (torch.finfo(dtype).bits // 8 if dtype is not None and size >= 2 else size)
    return total


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with Path("/proc/meminfo").open() as fh:
            line = next((x for x in fh if x.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line else None


def check_fits(need: int, what: str, dtype: torch.dtype | None) -> None:
    """One line when `need` bytes of weights exceed the memory this machine has available now."""
    have = available_bytes()
    if have is not None and need > have:
        in_dtype = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
        raise MixlensError(
            f"{what} needs {need / 2**30:.1f} GiB for its weights{in_dtype}, more than the {have / 2**30:.1f} GiB"
            " of memory available on this machine (try --dtype bfloat16, or a machine with more memory)"
        )


def _raw(fd: int, tensor: TensorInfo, first_row: int = 0, rows: int | None = None) -> np.ndarray:
    """Rows [first_row, first_row + rows) of a tensor's stored bytes, read without a memory map, shaped as the
    reader shapes them (rows × bytes of a row for quantised types)."""
    shape = tensor.shape
    row_bytes = tensor.n_bytes // shape[0] if len(shape) > 1 else tensor.n_bytes
    rows = (shape[0] if len(shape) > 1 else 1) - first_row if rows is None else rows
    buf = os.pread(fd, row_bytes * rows, int(tensor.data_offset) + first_row * row_bytes)
    arr = np.frombuffer(bytearray(buf), dtype=tensor.np_dtype)
    return arr.reshape((rows, *shape[1:])) if len(shape) > 1 else arr.reshape(shape)


def _dequantized(fd: int, tensor: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor in `dtype` (GGUF order: rows last-dimension-major, as `gguf.dequantize` returns it)."""
    from gguf import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(_raw(fd, tensor), tensor.tensor_type))).to(dtype)


def _dequantized_rows(fd: int, tensor: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """As `_dequantized`, a slab of rows at a time into a tensor allocated once in `dtype`."""
    from gguf import dequantize

    shape = tensor.shape
    if len(shape) != 2:
        return _dequantized(fd, tensor, dtype)
    n_rows = shape[0]
    cols = int(tensor.n_elements) // n_rows
    out = torch.empty(n_rows, cols, dtype=dtype)
    step = max(1, ROW_SLAB_ELEMENTS // cols)
    for r in range(0, n_rows, step):
        k = min(step, n_rows - r)
        out[r : r + k] = torch.from_numpy(np.ascontiguousarray(dequantize(_raw(fd, tensor, r, k), tensor.tensor_type)))
    return out


def load_gguf_model(cls: Any, folder: Path, gguf_file: str, config: Any, dtype: torch.dtype) -> tuple[Any, list[str]]:
    """(model of class `cls` with the GGUF file's weights in `dtype`, names of its parameters the file lacks).

    Shapes: each GGUF tensor is de-quantised to the shape transformers gives it (its processors reverse llama.cpp's
    query/key row permutation and Gemma's norm offset) before it is cast and assigned."""
    from accelerate import init_empty_weights
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    path = folder / gguf_file
    arch, infos = tensor_infos(path)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device; buffers (rotary) computed
        net = cls.from_config(config, dtype=dtype, attn_implementation="eager")
    cfg = config.to_dict()
    processor = (TENSOR_PROCESSORS.get(arch, TensorProcessor))(config=cfg)
    names = get_gguf_hf_weights_map(net, processor)
    parsed: dict[str, Any] = {"config": cfg, "tensors": {}}
    from rich.console import Console  # rich and its bar only where a GGUF file loads
    from rich.progress import Progress

    fd = os.open(path, os.O_RDONLY)
    bar = Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty())  # a terminal only
    try:
        bar.start()
        task = bar.add_task(f"loading {gguf_file} ({len(infos)} tensors)", total=len(infos))
        for tensor in infos:
            bar.advance(task)
            if tensor.name in ROW_SLICED and tensor.name in names:
                name, weights = names[tensor.name], _dequantized_rows(fd, tensor, dtype)
            else:
                result = processor.process(
                    weights=_dequantized(fd, tensor, torch.float32).numpy(),
                    name=tensor.name,
                    tensor_key_mapping=names,
                    parsed_parameters=parsed,
                )
                if result.name not in names:
                    continue
                name, weights = names[result.name], torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
            _assign(net, {name: weights}, dtype)  # one de-quantised tensor at a time
    finally:
        bar.stop()
        os.close(fd)
    _assign(net, parsed["tensors"], dtype)  # what a processor gathered itself (experts stacked across tensors)
    if getattr(net.config, "tie_word_embeddings", False):
        net.tie_weights()
    missing = [n for n, p in net.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    return net.eval(), missing


def _assign(net: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Move tensors into the model in `dtype` (shape-checked)."""
    params = dict(net.named_parameters(remove_duplicate=False))
    ready = {k: v.to(dtype) for k, v in tensors.items() if k in params}
    for k, v in ready.items():
        if tuple(params[k].shape) != tuple(v.shape):
            want = tuple(params[k].shape)
            raise MixlensError(f"GGUF tensor for '{k}' has shape {tuple(v.shape)}, the model expects {want}")
    if ready:
        net.load_state_dict(ready, strict=False, assign=True)
