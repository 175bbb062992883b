"""The typed method contract: declared options checked in one place (Python and CLI), secondary outputs, the
trace memo, and the documented "how to add a method" example."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.explain import explain
from mixlens.lens import Lens
from mixlens.methods import REGISTRY, MethodOutput, Option, get, register
from mixlens.methods.attention import ALPHA_MEAN
from mixlens.methods.engine import BLOCK_NORMS
from mixlens.methods.memo import Memo, memo_of
from mixlens.methods.registry import check_options, parse_option
from mixlens.methods.saliency import output_attribution
from mixlens.pipeline import run_methods, streams
from mixlens.viz.html import render_report
from mixlens.viz.terminal.analysis import print_results
from tests.cli.test_method_reference import generator
from tests.conftest import SENTENCES, random_lens, random_model, run_cli

ENGINE = Path(__file__).parents[2] / "docs" / "contributing.md"


def test_option_python_values():
    steps = Option("steps", int, 50, min=2)
    assert steps.check("m", 3) == 3 and steps.check("m", np.int64(7)) == 7
    for bad in (1, 2.5, True, "3", None):
        with pytest.raises(MixlensError, match=r"^option m\.steps must be an integer ≥ 2, got "):
            steps.check("m", bad)
    scale = Option("scale", float, 1.0, min=0.0, max=1.0)
    assert scale.check("m", 1) == 1.0 and isinstance(scale.check("m", 1), float)
    for bad in (1.5, -0.1, float("nan"), float("inf"), False):
        with pytest.raises(MixlensError, match=r"must be a number in \[0, 1\], got "):
            scale.check("m", bad)
    red = Option("reduction", str, "l2", choices=("l2", "l1", "sum"))
    with pytest.raises(MixlensError, match=r"m\.reduction must be one of l2, l1, sum, got 'max'"):
        red.check("m", "max")
    flag = Option("normalize", bool, False)
    with pytest.raises(MixlensError, match="must be true or false, got 1"):
        flag.check("m", 1)
    target = Option("target", int, "pred", min=0, words=("pred",), python_callable=True)
    assert target.check("m", "pred") == "pred" and target.check("m", len) is len
    with pytest.raises(MixlensError, match="an integer ≥ 0 or 'pred' or \\(Python\\) a callable"):
        target.check("m", "cls")
    pos = Option("position", int, None, min=0, optional=True)
    assert pos.check("m", None) is None


def test_option_cli_strings():
    assert parse_option("globenc_rollout", "normalize", "TRUE") is True
    assert parse_option("integrated_gradients", "steps", "64") == 64
    assert parse_option("integrated_gradients", "target", "pred") == "pred"
    assert parse_option("integrated_gradients", "target", "3") == 3
    assert parse_option("saliency", "position", "none") is None
    assert parse_option("saliency", "reduction", '"l1"') == "l1"
    for method, key, raw, msg in (
        ("globenc_rollout", "normalize", "maybe", "globenc_rollout.normalize must be true or false, got 'maybe'"),
        ("integrated_gradients", "steps", "1", "integrated_gradients.steps must be an integer in [2, 1024], got 1"),
        ("integrated_gradients", "steps", "2.5", "must be an integer in [2, 1024], got '2.5'"),
        ("saliency", "target", "len", "saliency.target must be an integer ≥ 0 or 'pred'"),
        ("hta", "output", "stderr", "method 'hta' has no option 'output'; options: input, mode, probes, seed"),
        ("nope", "x", "1", "unknown method 'nope'"),
    ):
        with pytest.raises(MixlensError) as e:
            parse_option(method, key, raw)
        assert msg in str(e.value) and "\n" not in str(e.value)


def test_declarations_match_signatures():
    for m in REGISTRY.values():
        assert {o.name for o in m.options} <= set(m.defaults())
    with pytest.raises(RuntimeError, match="do not match"):

        @register("bad_method_for_test", options=(Option("k", int, 1),))
        def bad(trace, *, k: int = 2) -> torch.Tensor:
            return trace.mask

    assert "bad_method_for_test" not in REGISTRY
    with pytest.raises(TypeError):
        Option("x", list, [])


def test_check_options_refuses_before_work(tokenizer, monkeypatch):
    lens = random_lens("bert", tokenizer)
    with pytest.raises(MixlensError, match="not among the methods"):
        check_options(["norm"], {"alti": {}})

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the options were checked")

    monkeypatch.setattr(lens, "trace", no_forward)
    with pytest.raises(MixlensError, match=r"hta\.probes must be an integer in \[2, 256\], got 1"):
        lens.analyze(SENTENCES[:1], ["hta"], options={"hta": {"mode": "estimate", "probes": 1}})
    with pytest.raises(MixlensError, match=r"globenc_rollout\.normalize must be true or false"):
        lens.analyze(SENTENCES[:1], ["globenc_rollout"], options={"globenc_rollout": {"normalize": "yes"}})


def test_cli_validates_options_before_loading(monkeypatch, capsys):
    import mixlens.lens

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(mixlens.lens, "load", no_model)
    for argv, msg in (
        (["--method", "hta", "--option", "hta.probes=1"], "option hta.probes must be an integer in [2, 256]"),
        (["--method", "decompx", "--option", "decompx.value_bias=x"], "one of values, absdot"),
        (["--method", "norm", "--option", "norm.heads=true"], "method 'norm' has no option 'heads'"),
    ):
        code, _, err = run_cli(["analyze", "A text.", *argv], capsys)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_methods_lists_typed_options(capsys):
    from mixlens.cli import main

    with pytest.raises(SystemExit) as e:
        main(["methods"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "--option integrated_gradients.steps: an integer in [2, 1024] (default 50)" in out
    assert "--option saliency.reduction: one of l2, l1, sum (default 'l2')" in out
    assert "--option globenc_rollout.normalize: true or false (default false)" in out
    assert "extra delta: [batch]" in out and "extra stderr: [batch, layer, target, source]" in out


def test_integrated_gradients_delta_is_an_extra(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification")
    texts = SENTENCES[:3]
    res = lens.analyze(
        texts,
        ["integrated_gradients", "saliency"],
        batch_size=2,
        options={"integrated_gradients": {"steps": 8, "target": 1}},
    )
    delta = res["integrated_gradients"].extras["delta"]
    assert delta.shape == (3,) and res["saliency"].extras == {}
    for b, text in enumerate(texts):  # per input, in input order, equal to a direct call
        direct = output_attribution(lens.trace([text]), "integrated_gradients", target=1, steps=8)
        np.testing.assert_allclose(delta[b], direct.delta[0].item(), rtol=1e-3, atol=1e-5)
    entry = res.to_json()["inputs"][2]["methods"]
    assert entry["integrated_gradients"]["extras"]["delta"] == {"dims": [], "values": float(delta[2])}
    assert entry["saliency"]["extras"] == {}
    assert res["integrated_gradients"].sel(source=0).extras.keys() == {"delta"}  # delta has no source axis


def test_memo_lives_with_the_methods(tokenizer):
    """The trace holds an opaque slot; the methods' keyed Memo is made on first use, and neither the trace nor the
    memo knows a method: each method module owns the keys of what it caches."""
    lens = random_lens("bert", tokenizer)
    tr = lens.trace(SENTENCES[:2])
    assert tr.memo is None and isinstance(memo_of(tr), Memo) and memo_of(tr).get(BLOCK_NORMS) is None
    out = get("norm").run(tr)
    assert isinstance(out, MethodOutput) and out.extras == {}
    assert tr.memo.get(BLOCK_NORMS) is not None and tr.memo.get(ALPHA_MEAN) is not None
    torch.testing.assert_close(get("attention")(tr), tr.memo.get(ALPHA_MEAN))
    import mixlens.methods.memo
    import mixlens.trace

    assert "Memo" not in vars(mixlens.trace) and "from mixlens.methods" not in Path(mixlens.trace.__file__).read_text()
    memo_source = Path(mixlens.methods.memo.__file__).read_text()
    assert not [m for m in REGISTRY if f'"{m}"' in memo_source or f"methods.{m} " in memo_source]


def test_engine_doc_example_adds_a_method(tokenizer, capsys, tmp_path):
    """The "How to add a method" example of docs/contributing.md, run as written: a streaming method registered from
    here alone (no other source file knows it) runs through analyze (full maps; target rows on an ordinary trace;
    a streamed trace in row mode, where the trace never holds α and the method reads what its own sink kept),
    explain, the HTML report, the terminal tables and the CLI, equal to max_h α^h computed from the model's own
    attention weights; and the method reference page's generator writes its card from that one registration."""
    block = re.search(r"```python\n(.*?)\s*```", ENGINE.read_text().split("How to add a method", 1)[1], re.S)
    assert block is not None
    model = random_model("gpt2", tokenizer, head="AutoModelForCausalLM")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lens = Lens(model, tokenizer, name="gpt2")
    texts = SENTENCES[:3]
    enc = lens.encode(texts)
    with torch.no_grad():
        alphas = lens.model(**enc.inputs, output_attentions=True).attentions  # the model's own α, per layer
    lengths = enc.inputs["attention_mask"].sum(1).tolist()
    want = [torch.stack([a[b].amax(0) for a in alphas])[:, :n, :n] for b, n in enumerate(lengths)]  # [L, n, n]
    try:
        exec(compile(textwrap.dedent(block.group(1)), str(ENGINE), "exec"), {})
        res = lens.analyze(texts, ["attention_peak"], batch_size=2, options={"attention_peak": {"power": 2.0}})
        for b in range(3):
            np.testing.assert_allclose(res["attention_peak"].input(b), want[b].pow(2).numpy(), atol=1e-6)
            row_sum = res["attention_peak"].extra_store["row_sum"].row(b)
            np.testing.assert_allclose(row_sum, want[b].pow(2).sum(-1).numpy(), rtol=1e-5)
        # target rows: streamed (the sink's rows; α gone), and on an ordinary trace (no sink)
        assert streams(["attention_peak"], "last")
        (batch,) = lens.batches(texts, 3, trace=["attention_peak"], rows="last")
        assert batch.trace is not None and batch.trace.layers[0].alpha.numel() == 0
        assert len(memo_of(batch.trace).layer_rows["attention_peak"]) == lens.adapter.n_layers
        streamed = lens.analyze(texts, ["attention_peak"], rows="last")
        plain = run_methods(lens.trace(enc), ["attention_peak"], rows="last").values["attention_peak"]
        for b, n in enumerate(lengths):
            assert streamed["attention_peak"].rows[b] == [n - 1]
            np.testing.assert_allclose(streamed["attention_peak"].input(b)[:, 0], want[b][:, n - 1], atol=1e-6)
            np.testing.assert_allclose(plain[b, :, 0, :n], want[b][:, n - 1], atol=1e-6)
        # explain: the last layer's row at the explained position (a causal LM's last token)
        exp = explain(lens, texts, ["attention_peak"])
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(exp.inputs[b].scores["attention_peak"], want[b][-1, n - 1], atol=1e-6)
        # views
        assert '"attention_peak"' in render_report(res)
        print_results(res, ["attention_peak"])
        assert "attention_peak: top 3 sources" in capsys.readouterr().out
        # the command line: the method, its options and --rows, with no command knowing it
        code, out, _ = run_cli(
            ["analyze", "the cat sat", "--model", str(tmp_path), "--method", "attention_peak", "--rows", "last"]
            + ["--option", "attention_peak.power=3", "-f", "json"],
            capsys,
        )
        assert code == 0, out
        methods = json.loads(out)["inputs"][0]["methods"]
        assert methods["attention_peak"]["rows"] == [len(tokenizer("the cat sat")["input_ids"]) - 1]
        with pytest.raises(MixlensError, match=r"attention_peak\.power must be a number ≥ 1, got 0"):
            parse_option("attention_peak", "power", "0")
        # the reference page: its card, from the registration alone, beside the shipped methods' cards
        gen = generator()
        page = gen.render([*gen.shipped(), REGISTRY["attention_peak"]])
        section = page.split("## `attention_peak`\n", 1)[1]
        assert "| [`attention_peak`](#attention_peak) | [batch, layer, target, source] | — |" in page
        for line in (
            "**Definition.** P_ij = (max_h α^h_ij)^p, the largest attention weight over heads; extra row_sum_i = Σ_j",
            "**Output.** [batch, layer, target, source]; extra `row_sum` [batch, layer, target].",
            "| `power` | a number ≥ 1 | `1.0` | exponent of the peak weight |",
            "computes the requested rows only (`--rows`)",
            "**Cost.** One traced forward pass (shared with the other methods of the run), no backward.",
            "**Official implementation.** none compared.",
            "Background: [../contributing.md](../contributing.md) (how to add a method).",
        ):
            assert line in section, line
        assert "attention_peak" not in gen.render()  # the shipped page lists the package's methods only
    finally:
        REGISTRY.pop("attention_peak", None)


def test_every_count_option_has_an_upper_bound():
    """#45 item 21: `integrated_gradients.steps=10000000` asked for 728 TiB, `hta.probes=1e8` for 1.5 TB; every
    integer option that sizes the work (steps, probes, samples) declares a maximum, checked before the model loads."""
    sizing = [(m.name, o) for m in REGISTRY.values() for o in m.options if o.name in ("steps", "probes", "samples")]
    assert len(sizing) >= 4
    for name, o in sizing:
        assert o.max is not None, f"{name}.{o.name} has no upper bound"
        assert o.default is None or o.default <= o.max


@pytest.mark.parametrize(
    "option, words",
    [
        ("integrated_gradients.steps=10000000", "integrated_gradients.steps must be an integer in [2, "),
        ("hta.probes=100000000", "hta.probes must be an integer in [2, "),
        ("gradient_shap.samples=100000000", "gradient_shap.samples must be an integer in [1, "),
        ("lime.samples=100000000", "lime.samples must be an integer in [2, "),
    ],
)
def test_a_huge_count_option_is_refused_before_loading(option, words, monkeypatch, capsys):
    import mixlens.lens

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(mixlens.lens, "load", no_model)
    method = option.split(".")[0]
    code, _, err = run_cli(["analyze", "A text.", "--method", method, "--option", option], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_repeated_option_is_refused(monkeypatch, capsys):
    """#45 item 24: `--option a.k=1 --option a.k=2` silently kept the last value."""
    import mixlens.lens

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(mixlens.lens, "load", no_model)
    argv = ["analyze", "A text.", "--method", "hta", "--option", "hta.probes=4", "--option", "hta.probes=8"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "hta.probes is given twice (4 and 8)" in err and len(err.splitlines()) == 1, err


def test_a_method_in_a_new_module_registers_with_no_import_line(tmp_path):
    """Adding a method touches one source file: the "How to add a method" example of docs/contributing.md saved as a
    new module of `mixlens.methods` (a folder added to the package's search path, in a fresh interpreter) is in the
    registry once the package is imported, named nowhere else."""
    import subprocess
    import sys

    block = re.search(r"```python\n(.*?)\s*```", ENGINE.read_text().split("How to add a method", 1)[1], re.S)
    assert block is not None
    (tmp_path / "attention_peak_demo.py").write_text(textwrap.dedent(block.group(1)), encoding="utf-8")
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('mixlens.methods')\n"
        f"spec.submodule_search_locations.append({str(tmp_path)!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "sys.modules['mixlens.methods'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'attention_peak' in m.names(), m.names()\n"
        "assert 'mixlens.methods.attention_peak_demo' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
