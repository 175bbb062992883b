"""Unknown model types, tried safely (`mixlens.layouts`): a model type outside the family table is read under the
first known layout whose probe rebuilds every piece of every layer exactly, and says so; otherwise one line names the
closest layout and the first layer and piece that failed. A forced family (`--family`) is probed the same way."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import mixlens
from mixlens.adapters import known_family
from mixlens.errors import MixlensError
from tests.conftest import SENTENCES, random_lens, run_cli

_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_key_value_heads=2)
UNKNOWN = {  # model type → (config, the layout it is read as)
    "helium": (lambda: T.HeliumConfig(head_dim=16, **_SMALL), "llama"),
    "smollm3": (lambda: T.SmolLM3Config(**_SMALL), "llama"),  # NoPE layers: α only
    "ministral": (lambda: T.MinistralConfig(head_dim=16, **_SMALL), "llama"),
    "exaone4": (lambda: T.Exaone4Config(**_SMALL), "olmo2"),  # norms after each branch, as OLMo 2
    "glm": (lambda: T.GlmConfig(head_dim=16, **_SMALL), "moe"),  # a fused gate | up FFN read as one block
}
FAILING = {  # model type → (config, the start of the one-line reason)
    "stablelm": (lambda: T.StableLmConfig(**_SMALL), "closest: llama (layer 0, norm after the sum: differs by"),
    "cohere": (lambda: T.CohereConfig(**_SMALL), "module tree: no module 'post_attention_layernorm'"),
}


def _model(config, tokenizer, head: str = "AutoModel"):
    torch.manual_seed(0)
    cfg = config()
    cfg.vocab_size, cfg.pad_token_id = tokenizer.vocab_size, tokenizer.pad_token_id
    model = getattr(T, head).from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # norms away from 1 so that a misread norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


@pytest.mark.parametrize("model_type", sorted(UNKNOWN))
def test_unknown_model_type_is_read_as_the_first_layout_that_passes(model_type, tokenizer, capsys):
    config, layout = UNKNOWN[model_type]
    assert known_family(model_type) is None  # really outside the table
    lens = mixlens.Lens(_model(config, tokenizer, "AutoModelForCausalLM"), tokenizer)
    assert lens.adapter.family.name == layout
    err = capsys.readouterr().err
    assert f"model type '{model_type}' is not in the family table; read as the {layout} layout" in err
    assert lens.family_note is not None and layout in lens.family_note
    res = lens.analyze(SENTENCES, ["norm_res", "alti_logit", "value_zeroing"])  # each runs its own check
    assert float(res.reconstruction_error.max()) < 1e-4


@pytest.mark.parametrize("model_type", sorted(FAILING))
def test_no_layout_fits_one_line_names_the_closest_and_where(model_type, tokenizer):
    config, words = FAILING[model_type]
    with pytest.raises(MixlensError) as e:
        mixlens.Lens(_model(config, tokenizer), tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and f"model type '{model_type}' is not in the family table" in msg and words in msg


def test_a_hybrid_layout_is_refused_naming_the_layers_without_attention(tokenizer):
    """LFM2: short convolutions in some layers, attention in the others: one line naming the convolution layers."""
    cfg = lambda: T.Lfm2Config(  # noqa: E731
        layer_types=["conv", "full_attention", "conv", "full_attention"], **{**_SMALL, "num_hidden_layers": 4}
    )
    with pytest.raises(MixlensError) as e:
        mixlens.Lens(_model(cfg, tokenizer), tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model type 'lfm2' is a hybrid layout mixlens cannot decompose")
    assert "layers 0, 2 mix tokens without attention (through 'conv' instead)" in msg


def test_a_forced_family_is_probed(tokenizer, capsys):
    llama = random_lens("llama", tokenizer).model
    same = mixlens.Lens(llama, tokenizer, family="qwen3")  # the same layout under another name
    assert same.adapter.family.name == "qwen3" and "read as the qwen3 layout (--family)" in capsys.readouterr().err
    with pytest.raises(MixlensError, match=r"^family 'gpt2' does not fit this 'llama' model: layer 0, module tree"):
        mixlens.Lens(llama, tokenizer, family="gpt2")
    granite = random_lens("granite", tokenizer).model  # llama's module tree, but residual multipliers
    with pytest.raises(MixlensError, match=r"'llama' does not fit this 'granite' model: layer 0, attention residual"):
        mixlens.Lens(granite, tokenizer, family="llama")
    with pytest.raises(MixlensError, match=r"^unknown family 'llama3'; families: bert, .*llama"):
        mixlens.Lens(llama, tokenizer, family="llama3")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_forced_family_fits_its_own_bfloat16_model(family, tokenizer, tmp_path):
    """A model loaded in bfloat16 and forced to its own layout (a LayerNorm before the values: GPT-2): the probe runs
    each norm in the model's dtype (it failed with 'mixed dtype' on GPT-2)."""
    random_lens(family, tokenizer, head="AutoModelForCausalLM").model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lens = mixlens.load(str(tmp_path), dtype="bfloat16", family=family)
    assert lens.adapter.family.name == family and lens.family_note is None


def test_the_probe_sees_each_piece(tokenizer):
    """The probe is not vacuous: a wrong W_V, W_O or FFN reading fails at that piece of that layer."""
    from mixlens.layouts import probe

    lens = random_lens("llama", tokenizer)
    assert probe(lens.adapter, lens.model, tokenizer) is None
    lay = lens.adapter.layers[1]
    for field, piece in (("raw_w_v", "value projection"), ("raw_w_o", "attention output")):
        own = getattr(lay, field)
        setattr(lay, field, own * 1.01)
        try:
            miss = probe(lens.adapter, lens.model, tokenizer)
        finally:
            setattr(lay, field, own)
        assert miss is not None and (miss.layer, miss.piece) == (1, piece), miss


def test_cli_family_option(tmp_path, tokenizer, capsys):
    """--family on the command line: a fitting one runs, one that does not fit or does not exist is one line, exit 2;
    a model type outside the table runs under the layout the probe found and says which."""
    for name, model in (("llama", random_lens("llama", tokenizer).model), ("helium", None)):
        model = model if model is not None else _model(UNKNOWN["helium"][0], tokenizer)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    code, out, err = run_cli(["analyze", "Hello there.", "--model", str(tmp_path / "helium"), "-f", "json"], capsys)
    assert code == 0 and "read as the llama layout" in err
    stablelm = _model(FAILING["stablelm"][0], tokenizer)
    stablelm.save_pretrained(tmp_path / "stablelm")
    tokenizer.save_pretrained(tmp_path / "stablelm")
    code, _, err = run_cli(["analyze", "Hi.", "--model", str(tmp_path / "stablelm")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "closest: llama (layer 0, norm after the sum" in err
    code, _, err = run_cli(["analyze", "Hi.", "--model", str(tmp_path / "llama"), "--family", "gpt2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "family 'gpt2' does not fit" in err
    code, _, err = run_cli(["analyze", "Hi.", "--model", str(tmp_path / "llama"), "--family", "nope"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "unknown family 'nope'" in err
    code, _, err = run_cli(
        ["analyze", "Hi.", "--model", str(tmp_path / "llama"), "--family", "qwen3", "-f", "json"], capsys
    )
    assert code == 0 and "read as the qwen3 layout (--family)" in err
