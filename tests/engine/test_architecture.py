"""The architecture's layer order (docs/DESIGN.md §5), checked on the sources: every module-level import of a mixlens
module — `if TYPE_CHECKING:` ones included — names a module of its own layer or a lower one, and the imports that
run (module level, outside `TYPE_CHECKING`) form no cycle. Imports inside functions are the documented exceptions
(optional dependencies, start-up speed, the deprecated `Lens.explain` alias; DESIGN.md §5)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mixlens"
LAYERS = (  # lowest first; a module belongs to the layer of its longest listed prefix
    ("errors", "version", "lazy", "jsonio", "memory", "catalog", "runlock", "atomic", "texts"),
    ("adapters",),
    ("inplace", "rowattn", "trace"),
    ("targets",),  # the scalar being explained (`Request`, `Readout`), which the registry's options carry
    ("methods.memo", "methods.registry"),  # what methods share: knows no method
    ("methods", "layouts"),  # layouts: probes a model under the known layouts (engine tolerances)
    ("pipeline",),
    ("result",),
    ("batching", "loading", "gguf_weights"),
    ("protocol",),  # `LensLike`: what the layers above use of a lens
    ("lens",),
    ("interventions", "explain", "stats", "bertology", "corpus"),
    ("viz",),
    ("commands", "cli", "__main__", ""),  # "": the package's lazy façade, `mixlens/__init__.py`
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> int:
    best = max(
        (
            (len(p), k)
            for k, group in enumerate(LAYERS)
            for p in group
            if p == "" or name == p or name.startswith(p + ".")
        ),
        default=None,
    )
    assert best is not None, f"mixlens.{name} is in no layer of the architecture: add it to LAYERS"
    return best[1]


def module_imports(path: Path, modules: set[str], inner: bool = False) -> list[tuple[str, bool, int]]:
    """(imported mixlens module, whether it runs — not under `if TYPE_CHECKING:`, line) of each module-level import;
    `inner`: of each import inside a function or class body instead."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: list[tuple[str, bool, int]] = []

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target if target and target != name else None

    def visit(nodes: list[ast.stmt], runs: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                typing_only = "TYPE_CHECKING" in ast.unparse(node.test)
                visit(node.body, runs and not typing_only)
                visit(node.orelse, runs)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block, runs)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("mixlens"):
                        found = resolve(alias.name.removeprefix("mixlens").lstrip("."))
                        if found is not None:
                            out.append((found, runs, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                elif base.startswith("mixlens"):
                    base = base.removeprefix("mixlens").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}".lstrip(".")
                    found = resolve(full if full in modules else base)
                    if found is not None:
                        out.append((found, runs, node.lineno))

    tree = ast.parse(path.read_text(encoding="utf-8"))
    if not inner:
        visit(tree.body, True)
        return out
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit([n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))], True)
    return sorted(set(out))


def graph() -> tuple[dict[str, set[str]], list[str]]:
    """(the imports that run: module → the modules it imports, the imports that go up a layer)."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths) | {""}
    runtime: dict[str, set[str]] = {}
    upward = []
    for name, path in paths.items():
        for target, runs, line in module_imports(path, modules):
            if layer_of(target) > layer_of(name):
                upward.append(f"mixlens.{name}:{line} imports mixlens.{target} (a higher layer)")
            if runs:
                runtime.setdefault(name, set()).add(target)
    return runtime, upward


UPWARD_INSIDE_FUNCTIONS = {  # the documented exceptions (DESIGN.md §5): (module, the higher module it imports)
    ("catalog", "methods"): "`python -m mixlens.catalog` builds the shipped catalog from the registry",
    ("catalog", "adapters"): "... and the families each method refuses",
    ("lens", "explain"): "the deprecated `Lens.explain` alias",
    ("corpus.runner", "commands.options"): "the corpus runner's terminal progress reuses the CLI's",
}


def test_every_import_goes_down_the_layers():
    _, upward = graph()
    assert not upward, "\n".join(upward)


def test_imports_inside_functions_go_down_the_layers_too():
    """Imports inside functions (optional dependencies, start-up speed) hide no dependency that goes up a layer —
    a result drawing itself, a lens explaining itself, a view running a model — but for the documented few."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths) | {""}
    found = [
        f"mixlens.{name}:{line} imports mixlens.{target} inside a function"
        for name, path in paths.items()
        for target, _, line in module_imports(path, modules, inner=True)
        if layer_of(target) > layer_of(name)
        and not any(name == a and (target == b or target.startswith(b + ".")) for a, b in UPWARD_INSIDE_FUNCTIONS)
    ]
    assert not found, "\n".join(found)


def test_no_import_cycles():
    runtime, _ = graph()
    try:
        TopologicalSorter(runtime).prepare()
    except CycleError as e:
        raise AssertionError(f"an import cycle among mixlens modules: {' → '.join(e.args[1])}") from None


def test_the_check_sees_a_violation():
    """The checker itself: the layers it was given and an upward import it must report."""
    assert layer_of("methods.memo") < layer_of("methods.alti") < layer_of("pipeline") < layer_of("viz.html")
    assert layer_of("result.views") < layer_of("viz.views") and layer_of("") == len(LAYERS) - 1
    bad = SRC / "methods" / "memo.py"
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    found = [t for t, _, _ in module_imports(bad, modules)]
    assert "trace" in found and all(layer_of(t) <= layer_of("methods.memo") for t in found)
