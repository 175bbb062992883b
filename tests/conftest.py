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
    # decoders of issue 42 (one block: other branches add theirs beside it)
    "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=16, **_SMALL),
    "starcoder2": lambda: T.Starcoder2Config(num_key_value_heads=2, **_SMALL),
    "phi3": lambda: T.Phi3Config(num_key_value_heads=2, **_SMALL),
    "granite": lambda: T.GraniteConfig(
        num_key_value_heads=2,
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        residual_multiplier=0.4,
        logits_scaling=2.5,
        **_SMALL,
    ),
    "mixtral": lambda: T.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_SMALL),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],  # a dense FFN beside the sparse one
        **_SMALL,
    ),
    "olmo2": lambda: T.Olmo2Config(num_key_value_heads=2, **_SMALL),
    "llama3-rope": lambda: T.LlamaConfig(
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        **_SMALL,
    ),
    # Encoders of today: every bias on, three layers (ModernBERT: global, local window of ±2, global; its first layer
    # has no attention norm), DeBERTa-v3's disentangled attention with few log buckets so that short inputs reach them.
    "modernbert": lambda: T.ModernBertConfig(
        local_attention=4,
        global_attn_every_n_layers=2,
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
        classifier_bias=True,
        **{**_SMALL, "num_hidden_layers": 3, "intermediate_size": 96},
    ),
    "deberta-v2": lambda: T.DebertaV2Config(
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
        position_buckets=4,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        **_SMALL,
    ),
    # parallel blocks, ALiBi, learned positions (docs/DESIGN.md §3.6)
    "opt": lambda: T.OPTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64
    ),
    "bloom": lambda: T.BloomConfig(hidden_size=64, n_layer=2, n_head=4),
    "gpt_neox": lambda: T.GPTNeoXConfig(rotary_pct=0.5, **_SMALL),  # parallel residual, partial rotary
    "falcon": lambda: T.FalconConfig(  # parallel attention + MLP, multi-query
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bias=True
    ),
}
_ZERO_NORMS = ("gemma3_text", "gemma2")  # (1 + w) norms initialised at w = 0: randomised so that w matters
_RANDOM_NORMS = (
    "qwen3",
    "starcoder2",
    "phi3",
    "granite",
)  # norms (and LayerNorm biases) randomised so that a misread norm shows
_RANDOM_AFFINE = ("modernbert", "deberta-v2")  # biases (initialised at 0) and norm scales (at 1) randomised
# biases initialised at 0 and norms at γ = 1, β = 0: randomised so that every bias and every norm's affine part matters
_ZERO_BIASES = ("opt", "bloom", "gpt_neox", "falcon")
FAMILIES = list(CONFIGS)


def family_of(key: str):
    """The mixlens family a CONFIGS key's model type belongs to."""
    from mixlens.adapters import family_for

    return family_for(CONFIGS[key]().model_type)


DECODERS = [f for f in FAMILIES if family_of(f).causal]


def has_head(key: str, auto_class: str) -> bool:
    """Whether transformers has a model class of this kind (e.g. "AutoModelForSequenceClassification") for the
    CONFIGS key's config (Granite has no sequence classifier)."""
    return type(CONFIGS[key]()) in getattr(T, auto_class)._model_mapping


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
    if family in _ZERO_NORMS + _RANDOM_NORMS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    if family in _RANDOM_AFFINE:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
                elif "norm" in name.lower():
                    p.uniform_(0.3, 1.3)
    if family in _ZERO_BIASES:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.05)
                elif p.dim() == 1:  # a norm's γ
                    p.normal_(1, 0.3)
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
