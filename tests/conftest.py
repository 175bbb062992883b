"""Shared fixtures: the real bundled model and small random models of every supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

import mixlens
from mixlens.lens import default_model_path

pytest_plugins = ["tests.cwd_guard"]  # tests run in their own folder and leave the working directory alone

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SENTENCES = ["The keys to the cabinet are on the table.", "A dog barked, and then it ran away quickly!", "Short one."]

_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
CONFIGS = {
    "bert": lambda: T.BertConfig(**_SMALL),
    "roberta": lambda: T.RobertaConfig(**_SMALL),
    "xlm-roberta": lambda: T.XLMRobertaConfig(**_SMALL),
    "electra": lambda: T.ElectraConfig(embedding_size=32, **_SMALL),
    "distilbert": lambda: T.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    "albert": lambda: T.AlbertConfig(embedding_size=32, num_hidden_groups=1, **{**_SMALL, "num_hidden_layers": 3}),
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4),
    "llama": lambda: T.LlamaConfig(num_key_value_heads=2, **_SMALL),
    "mpnet": lambda: T.MPNetConfig(**_SMALL),
    "gemma3_text": lambda: T.Gemma3TextConfig(
        num_key_value_heads=1,
        head_dim=24,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        **_SMALL,
    ),
    "gemma2": lambda: T.Gemma2Config(
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        **_SMALL,
    ),
}
_ZERO_NORMS = ("gemma3_text", "gemma2")  # (1 + w) norms initialised at w = 0: randomised so that w matters
FAMILIES = list(CONFIGS)


def data_file(*parts: str) -> Path:
    """A file of ../shared/data, or skip the test when it is absent."""
    p = DATA.joinpath(*parts)
    if not p.is_file():
        pytest.skip(f"shared data file {p} not present")
    return p


@pytest.fixture(scope="session")
def tokenizer():
    return T.AutoTokenizer.from_pretrained(default_model_path())


def random_model(family: str, tokenizer, head: str = "AutoModel", seed: int = 0, **overrides):
    """A small randomly initialised model of `family`, sized to the bundled tokenizer's vocabulary."""
    torch.manual_seed(seed)
    cfg = CONFIGS[family]()
    cfg.vocab_size = tokenizer.vocab_size
    cfg.pad_token_id = tokenizer.pad_token_id
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = getattr(T, head).from_config(cfg, attn_implementation="eager")
    if family in _ZERO_NORMS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    return model


def random_lens(family: str, tokenizer, head: str = "AutoModel", seed: int = 0, **overrides) -> mixlens.Lens:
    return mixlens.Lens(random_model(family, tokenizer, head, seed, **overrides), tokenizer, name=f"random-{family}")


@pytest.fixture(scope="session")
def bundled() -> mixlens.Lens:
    return mixlens.load()


@pytest.fixture(scope="session", params=FAMILIES)
def family_lens(request, tokenizer) -> mixlens.Lens:
    return random_lens(request.param, tokenizer)


def assert_trace_is_the_models_own(lens: mixlens.Lens) -> None:
    """α and every layer input of a trace of SENTENCES (padded batch) are the model's own outputs, bit for bit."""
    enc = lens.encode(SENTENCES)
    with torch.no_grad():
        want = lens.model(**enc.inputs, output_attentions=True, output_hidden_states=True)
        tr = lens.trace(enc)
    for lt, a, h in zip(tr.layers, want.attentions, want.hidden_states[:-1], strict=True):  # h: the layer's input
        assert torch.equal(lt.alpha, a) and torch.equal(lt.x, h)
    assert all("forward" not in vars(lay.attn) for lay in lens.adapter.layers)  # restored after the trace


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `mixlens ARGS` in-process through the real entry point → (exit code, stdout, stderr)."""
    from mixlens.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip on a machine without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
