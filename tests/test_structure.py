"""The code's shape, as docs/architecture.md states it: no import cycles, the config package at the
floor, the parallelism packages never reaching up into training, every source file under 500
lines, no object patched from outside, and no numbered work rounds cited anywhere."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
LOWER = ("tensor_parallel", "context_parallel", "precision", "models", "pipeline_parallel", "distributed", "optim")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "tessera").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tessera modules ``name`` imports anywhere in its file (function-level imports too:
    a lazy import still ties the two modules together)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("tessera"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("tessera"):
                continue
            for alias in node.names:  # `from pkg import submodule` depends on the submodule only
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_config_is_at_the_floor():
    graph = _graph()
    for name, deps in graph.items():
        if name == "tessera.config" or name.startswith("tessera.config."):
            outside = {d for d in deps if not (d == "tessera.config" or d.startswith("tessera.config."))}
            assert not outside, f"{name} imports {sorted(outside)}: the config imports nothing else of tessera"


@pytest.mark.parametrize("package", LOWER)
def test_the_parallelism_packages_never_import_training(package):
    for name, deps in _graph().items():
        if name.startswith(f"tessera.{package}"):
            up = sorted(d for d in deps if d.startswith("tessera.training"))
            assert not up, f"{name} imports {up}"


def test_every_source_file_is_under_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in (SRC / "tessera").rglob("*.py")
            if (n := len(p.read_text().splitlines())) >= 500}
    assert not long, long


def test_no_object_is_patched_from_outside():
    """No module replaces another object's forward or edits its __dict__: collaborators are
    given at construction (WeightGradStore's sink) or through the object's own method
    (TransformerLayer.use_graph)."""
    patching = re.compile(r"\.__dict__\s*(\[|\.(pop|update|setdefault|clear)\b)|\.forward\s*=[^=]")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in (SRC / "tessera").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if patching.search(line)]
    assert not found, found


def test_no_numbered_work_rounds_are_cited():
    """History lives in BENCHMARKS.md by date and topic, never as "session N" anywhere."""
    word = "sess" + "ion"  # (spelt apart, so this file does not cite one itself)
    cited = re.compile(rf"\b{word}s? ?\d+|\b{word}s \d|\bround \d+", re.IGNORECASE)
    paths = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")]
    for folder in ("src", "tests", "benchmarks", "scripts", "configs"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".sh", ".toml")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths if "egg-info" not in str(p)
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if cited.search(line)]
    assert not found, found
