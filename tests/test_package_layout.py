"""The folders are the architecture: no import circle in lld_monitor, each layer imports only layers before it
(README, "How the code is laid out"), no two modules share a file name, and the trainer's config loads none of
the heavy libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lld_monitor"
LAYERS = ["roles", "signals", "files", "sinks", "lld", "store", "aggregates", "detect", "logger", "payload", "backend",
          "integrations", "counterfactual", "ui", "commands", "cli"]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the lld_monitor modules it imports (anywhere in it: lazy imports count too)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def test_no_import_circle():
    mods = _modules()
    graph = _imports(mods)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in mods:
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_each_layer_imports_only_the_layers_before_it():
    graph = _imports(_modules())
    layer = {name: i for i, name in enumerate(LAYERS)}
    bad = sorted((m, t) for m, targets in graph.items() for t in targets
                 if m.count(".") and t.count(".") and (lm := m.split(".")[1]) in layer and (lt := t.split(".")[1]) in layer
                 and layer[lt] > layer[lm])
    assert not bad, bad
    top = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" and p.name != "__init__.py"}
    top |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert top == set(LAYERS)  # every module and package has its place in the order


def test_no_two_modules_share_a_file_name():
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "config.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_trainer_config_imports_no_heavy_library():
    code = ("import sys, lld_monitor.backend.config; "
            "print([m for m in ('duckdb', 'pyarrow', 'pandas', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
