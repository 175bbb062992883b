"""The registry is the truth: every method × every family × every model head either runs (and passes its own
exactness check) or refuses in one line — and which of the two is what the method declares (`Method.supports`,
`Method.head`). Nothing else in mixlens keeps a list of what a method can do."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from mixlens.errors import MixlensError
from mixlens.explain import explain
from mixlens.explain.attributions import default_methods
from mixlens.methods import REGISTRY
from mixlens.methods import get as get_method
from mixlens.targets import model_kind
from tests.conftest import DECODERS, FAMILIES, has_head, random_lens

TEXTS = ["The cat sat.", "A dog ran away!"]
CHEAP = {  # options that keep the slow methods small on a tiny model (their exactness is tested in their own files)
    "integrated_gradients": {"steps": 4},
    "gradient_shap": {"samples": 2},
    "lime": {"samples": 4},
    "hta": {"mode": "estimate", "probes": 2},
    "head_attribution": {"mode": "estimate", "probes": 2},
}
HEADS = {"base": "AutoModel", "classifier": "AutoModelForSequenceClassification", "causal": "AutoModelForCausalLM"}
CASES = [  # encoders have no causal LM (BERT's LM head class is not a decoder)
    (f, h) for f in FAMILIES for h in HEADS if has_head(f, HEADS[h]) and (h != "causal" or f in DECODERS)
]
HEADS["masked"] = "AutoModelForMaskedLM"
CASES += [(f, "masked") for f in ("modernbert", "deberta-v2")]  # the encoders' masked-LM heads with their own layers
MASKED_TEXTS = ["The [MASK] sat.", "A dog ran [MASK]!"]  # a masked LM's target is its [MASK]


def expected_refusal(name: str, lens) -> str | None:
    """What the registry declares: the family's refusal, or the head the method reads."""
    spec = get_method(name)
    why = spec.refusal(lens.adapter.family)
    if why is not None:
        return why
    kind = model_kind(lens.model)
    if spec.head == "classifier" and kind != "classifier":
        return "sequence-classification"
    if spec.head == "causal" and kind != "causal":
        return "causal language model"
    return None


@pytest.mark.parametrize(("family", "head"), CASES)
def test_every_method_runs_or_refuses_as_declared(family, head, tokenizer):
    lens = random_lens(family, tokenizer, head=HEADS[head], **({"num_labels": 2} if head == "classifier" else {}))
    texts = MASKED_TEXTS if head == "masked" else TEXTS
    for name, spec in REGISTRY.items():
        want = expected_refusal(name, lens)
        options = {name: CHEAP[name]} if name in CHEAP else None
        if want is not None:
            with pytest.raises(MixlensError) as e:
                lens.analyze(texts, [name], options=options)
            assert want in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
            continue
        res = lens.analyze(texts, [name], options=options)  # the methods' exactness checks raise on a miss
        values = res[name].values
        assert values.shape[1:][: len(spec.dims)] == values.shape[1:] and np.isfinite(values).all(), name
        if res.reconstruction_error is not None:
            assert float(res.reconstruction_error.max()) < 1e-4, name


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_explain_defaults_run_on_every_causal_lm(family, tokenizer):
    """`explain` with its own default methods (from the registry) runs on every decoder family — Gemma's sandwich
    norms included, where the vector decompositions are left out of the defaults, not failed."""
    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    methods = default_methods("causal", lens.adapter.family)
    assert all(get_method(m).refusal(lens.adapter.family) is None for m in methods)
    assert ("decompx_logit" in methods) == (get_method("decompx_logit").refusal(lens.adapter.family) is None)
    res = explain(lens, TEXTS[:1], methods)
    assert set(res.inputs[0].scores) == set(methods)
    assert all(np.isfinite(v).all() for v in res.inputs[0].scores.values())


def test_explain_refuses_a_method_its_family_does_not_support(tokenizer):
    lens = random_lens("gemma3_text", tokenizer, head="AutoModelForCausalLM")
    with pytest.raises(MixlensError, match="'decompx_logit' does not support the gemma family: its vector"):
        explain(lens, TEXTS[:1], ["decompx_logit"])


SRC = Path(__file__).resolve().parents[2] / "src" / "mixlens"
NAMING_FREE = (  # modules (relative to src/mixlens) and scripts that hold no method's name
    "pipeline.py",
    "lens.py",
    "catalog.py",
    "methods/memo.py",
    "methods/registry.py",
    "explain/",
    "viz/",
    "commands/",
    "result/",
    "scripts/method_reference.py",  # the method reference page: every card comes from its registration
)
NOT_A_METHOD = {  # (module, string): the same word naming something else
    ("commands/gradients.py", "saliency"): "the `mixlens saliency` command's name",
    ("viz/heads.py", "norm"): "a head-statistics view (`stats.heads.VIEWS`), not the method",
    ("methods/registry.py", "saliency"): "the `mixlens saliency` command's view (`registry.VIEWS`)",
}


def _strings(tree: ast.AST) -> list[tuple[ast.Constant, str]]:
    """Every string constant of a module except docstrings, with the name it is assigned to ('?' if none)."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def _fields(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Attribute reads that are not method calls (`memo.alti`) and class fields (`alti: Tensor | None`)."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    out: list[tuple[ast.AST, str]] = [
        (node, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in called
    ]
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        out += [(a, a.target.id) for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)]
    return out


def _sources() -> list[tuple[str, Path]]:
    """(name relative to src/mixlens, or scripts/…, path) of every package module and every script."""
    scripts = SRC.parents[1] / "scripts"
    return [(p.relative_to(SRC).as_posix(), p) for p in sorted(SRC.rglob("*.py"))] + [
        (p.relative_to(SRC.parents[1]).as_posix(), p) for p in sorted(scripts.rglob("*.py"))
    ]


def test_no_method_name_lists_outside_the_registry():
    """No module keeps its own collection of method names (the lists and side tables the registry replaced): a
    literal tuple, list or set of two or more registered names, or a dict keyed by two or more of them (a per-method
    side table, like the reference cards that now live in each registration), anywhere in src/mixlens or scripts/
    is a second source of truth."""
    names = set(REGISTRY)
    allowed = {("methods/saliency.py", "KINDS")}  # a function's own kinds
    found = []
    for rel, path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elts = node.elts
            elif isinstance(node, ast.Dict):
                elts = [k for k in node.keys if k is not None]
            else:
                continue
            strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if sum(s in names for s in strings) >= 2:
                found.append(f"{rel}:{node.lineno}")
    owners = {  # the line of each allowed assignment's value
        f"{rel}:{node.value.lineno}"
        for rel, path in _sources()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and ((rel, target.id) in allowed or target.id == "__all__")
    }
    found = [f for f in found if f not in owners]
    assert not found, f"method name lists outside the registry: {found}"


def test_the_engine_explain_views_and_commands_name_no_method():
    """A method declares everything about itself in its registration (its layer sink, cache keys, explain form,
    display defaults and group): the pipeline, the memo, explain, the results, the views and the commands iterate
    over the registry (or its catalog) and hold no registered method's name — not in a list, a dict key, a set, a
    comparison, a default argument or a cache field (`memo.alti`). Catches every one of the hand-kept names the
    declarations replaced."""
    names = set(REGISTRY)
    found = []
    for rel, path in _sources():
        if not rel.startswith(NAMING_FREE):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, text in [*_strings(tree), *_fields(tree)]:
            if text in names and (rel, text) not in NOT_A_METHOD:
                found.append(f"{rel}:{getattr(node, 'lineno', '?')}: {text!r}")
    assert not found, f"method names outside their declarations: {found}"


def test_shipped_catalog_is_the_registry():
    """`mixlens methods` reads data/methods.json (no torch); it must equal what the registry declares now
    (regenerate with `python -m mixlens.catalog`)."""
    from mixlens import catalog

    assert catalog.load() == catalog.build(), "stale src/mixlens/data/methods.json: run python -m mixlens.catalog"


@pytest.mark.slow  # starts fresh processes
def test_methods_command_is_fast_narrow_and_complete():
    """`mixlens methods` imports no torch, fits 100 columns and lists every method `explain` accepts."""
    import subprocess
    import sys

    code = (
        "import sys; from mixlens.cli import main\n"
        "try:\n    main(['methods'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    listed = {line.split()[0] for line in lines if line and not line.startswith(" ")}
    assert listed == set(REGISTRY)
    for kind in ("classifier", "causal", "encoder"):
        from mixlens.explain.attributions import applicable

        assert set(applicable(kind)) <= listed
    assert {"occlusion", "lime", "deeplift", "gradient_shap"} <= listed


def test_a_checkpoint_without_its_head_loads_the_base_model(tmp_path, tokenizer, capsys):
    """A sentence-transformers folder whose config names a masked-LM class but holds no LM-head weights (as
    all-mpnet-base-v2): `load` without a head gives the base model (norm methods never read a head) with a warning;
    asking for the head still refuses its random weights."""
    import json

    import mixlens
    from tests.conftest import random_model

    random_model("bert", tokenizer).save_pretrained(tmp_path)  # base weights only
    tokenizer.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"]}))
    lens = mixlens.load(tmp_path)
    assert type(lens.model).__name__ == "BertModel"
    assert "no weights for its masked-lm head; loaded the base model" in capsys.readouterr().err
    assert lens.analyze(TEXTS, ["norm_resln"]).reconstruction_error.max() < 1e-4
    with pytest.raises(MixlensError, match="would be random"):
        mixlens.load(tmp_path, head="masked-lm")


def test_a_gguf_decoder_loads_as_a_causal_lm(tmp_path, monkeypatch):
    """A GGUF file's config names no head class: a decoder family's file loads with its causal LM head."""
    import transformers as T

    from mixlens import lens as lens_module
    from mixlens import loading

    picked = []
    monkeypatch.setattr(loading, "resolve_source", lambda model, gguf_file=None: (str(tmp_path), True))
    monkeypatch.setattr(T.AutoConfig, "from_pretrained", lambda *a, **k: T.LlamaConfig(architectures=None))
    monkeypatch.setattr(loading, "check_gguf", lambda path, dtype: 0)  # the file's own checks: test_gguf_loading.py
    monkeypatch.setattr(T.AutoTokenizer, "from_pretrained", lambda *a, **k: None)

    def fake(cls, src, head, allow, **kw):
        picked.append((cls.__name__, head, kw.get("gguf_file")))
        raise MixlensError("stop here")

    monkeypatch.setattr(loading, "pretrained_without_random_weights", fake)
    with pytest.raises(MixlensError, match="stop here"):
        lens_module.load(tmp_path, gguf_file="m.gguf")
    assert picked == [("AutoModelForCausalLM", "causal-lm", "m.gguf")]
