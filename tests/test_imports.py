"""Imports go one way (read from the source, no import run): no cycles between r1jax's modules;
`model/` and `kernels/` use only the config, each other and the leaf `r1jax.logical` (logical
names, no mesh axis); `convert/` and `checkpoint/` do not reach into training; and pyproject's
dependencies are exactly the third-party packages the code imports."""
from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "r1jax"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports anywhere in it (function-level imports included)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:                    # `from pkg import submodule` imports the submodule
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out


GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles() == []


def _under(prefix: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in GRAPH.items() if m == prefix or m.startswith(prefix + ".")}


def test_model_and_kernels_use_only_logical_names():
    allowed = ("r1jax.config", "r1jax.logical", "r1jax.kernels", "r1jax.model")
    for m, deps in {**_under("r1jax.model"), **_under("r1jax.kernels")}.items():
        bad = [d for d in deps if not d.startswith(allowed)]
        assert not bad, (m, bad)
    assert GRAPH["r1jax.logical"] == set()                 # the leaf: no r1jax module below it
    # and none of them spells a mesh axis (strings that are not docstrings)
    axes = {"data", "fsdp", "tensor", "expert", "pipeline"}
    for m in [*_under("r1jax.model"), *_under("r1jax.kernels"), "r1jax.logical"]:
        tree = ast.parse(MODULES[m].read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs
                 and isinstance(n.value, str)} & axes
        assert not named, (m, named)


def test_lower_layers_do_not_import_training():
    for prefix, banned in (("r1jax.convert", ("r1jax.train", "r1jax.weights")),
                           ("r1jax.checkpoint", ("r1jax.train", "r1jax.weights", "r1jax.convert")),
                           ("r1jax.parallel", ("r1jax.train", "r1jax.weights", "r1jax.convert", "r1jax.checkpoint")),
                           ("r1jax.data", ("r1jax.train", "r1jax.model", "r1jax.parallel"))):
        for m, deps in _under(prefix).items():
            bad = [d for d in deps if d.startswith(banned)]
            assert not bad, (m, bad)


def _third_party(paths) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("r1jax", "__future__")}


def _distributions(modules: set[str]) -> set[str]:
    dists = importlib.metadata.packages_distributions()
    return {dists[m][0].lower().replace("_", "-") for m in modules}


def _declared(specs: list[str]) -> set[str]:
    import re
    return {re.split(r"[<>=\[ ;]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_dependencies_match_the_imports():
    """The package's imports are its dependencies (the PyTorch reference workers' are the
    `compare` extra, the ONNX exporter's and its runner's the `onnx` extra, jax2onnx apart: it goes
    in without its dependencies); the tests' other imports are the `test` extra (pytest-xdist is
    a plugin)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    workers = [PKG / "bench" / "torch_ref.py", PKG / "bench" / "torch_generate.py"]
    onnx = [PKG / "export_onnx.py", PKG / "export_runner.py"]
    used = _distributions(_third_party(p for p in PKG.rglob("*.py") if p not in workers + onnx))
    assert used == _declared(project["dependencies"])
    assert _distributions(_third_party(workers)) - used == _declared(extras["compare"])
    assert _distributions(_third_party(onnx)) - used - {"jax2onnx"} == {"onnx", "onnxruntime"}
    assert {"onnx", "onnxruntime"} <= _declared(extras["onnx"])
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {p.stem for p in (ROOT / "bench").glob("*.py")}
    tests = _distributions(_third_party((ROOT / "tests").glob("*.py")) - local) - used - _declared(extras["onnx"])
    assert tests == _declared(extras["test"]) - {"pytest-xdist"}
