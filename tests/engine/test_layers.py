"""engine/ is layered: each subpackage imports only from those below it (docs/architecture.md,
"Inside engine/"), no module imports the package's public entry, the import graph has no cycle,
and the settings leaf loads no torch, so the server's flag checks do not either."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"

# Each layer, and the layers it may import from (its own modules aside). The one place these
# arrows are written in code; docs/architecture.md draws the same.
GROUPS = {
    "leaf": ("engine.settings", "engine.errors", "engine.placement", "engine.threads", "engine.cpu"),
    "ops": ("engine.ops",),
    "files": ("engine.files",),
    "model": ("engine.model",),
    "sched": ("engine.sched",),
    "spec": ("engine.spec",),
    "pipeline": ("engine.pipeline",),
    "top": ("engine.engine", "engine.loader", "engine.forward", "engine.admission", "engine.preflight", "engine.footprint",
            "engine.stats"),
    "cli": ("engine.cli",),
}
ALLOWED = {
    "leaf": set(),
    "ops": {"leaf"},
    "files": {"leaf", "ops"},
    "model": {"leaf", "ops", "files"},
    "sched": {"leaf", "ops", "files", "model"},
    "spec": {"leaf", "ops", "files", "model", "sched"},
    "pipeline": {"leaf", "ops", "files", "model", "sched", "spec"},
    "top": {"leaf", "ops", "files", "model", "sched", "spec", "pipeline"},
    "cli": {"leaf", "ops", "files", "model", "sched", "spec", "pipeline", "top"},
}
TORCH_FREE = ("engine.settings", "engine.errors", "engine.placement", "engine.threads", "engine.cpu")


def modules() -> dict[str, Path]:
    out = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def imports(name: str) -> tuple[set[str], set[str]]:
    """(the engine modules `name` imports, anywhere in the file; the other top-level packages it imports)."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from engine.model import mtp` names a module; `from engine.model.qsa import X` its module.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        else:
            continue
        for target in targets:
            (ours if target.split(".")[0] == "engine" else theirs).add(target if target in MODULES else target.split(".")[0])
    return ours, theirs


def group_of(name: str) -> str | None:
    for group, prefixes in GROUPS.items():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return group
    return None  # the package's entry, engine/__init__.py


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for name, targets in graph.items():
        group = group_of(name)
        for target in targets:
            other = group_of(target)
            if group is not None and other != group and other not in ALLOWED[group]:
                broken.append(f"{name} ({group}) imports {target} ({other})")
    return broken


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, path, found = {}, [], []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


GRAPH = {m: imports(m)[0] - {m} for m in MODULES}


def test_every_engine_module_belongs_to_one_layer():
    assert [m for m in MODULES if m != "engine" and group_of(m) is None] == []


def test_each_layer_imports_only_from_the_layers_below_it():
    assert layer_violations(GRAPH) == []


def test_no_engine_module_imports_the_public_entry():
    """engine/__init__.py is for server/, train/ and bench/; inside, a module names its source."""
    assert [m for m in MODULES if m != "engine" and "engine" in GRAPH[m]] == []


def test_the_engine_import_graph_has_no_cycle():
    assert cycles(GRAPH) == []


def test_the_settings_leaf_imports_no_torch_in_its_source_or_when_loaded():
    for name in TORCH_FREE:
        seen, todo = set(), [name]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(GRAPH[m])
        assert "torch" not in set().union(*(imports(m)[1] for m in seen)), name
    code = ("import sys, engine.settings, engine.placement; "
            "assert 'torch' not in sys.modules, 'torch was loaded'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_an_added_back_edge_is_caught_as_a_broken_layer_and_a_cycle():
    """The checks above are not vacuous: the real graph plus one import from the model layer up
    to the scheduler breaks the layering and closes a cycle (the scheduler imports the cache)."""
    graph = {m: set(targets) for m, targets in GRAPH.items()}
    graph["engine.model.kv_cache"].add("engine.sched.scheduler")
    assert layer_violations(graph) == ["engine.model.kv_cache (model) imports engine.sched.scheduler (sched)"]
    assert any("engine.model.kv_cache" in c and "engine.sched.scheduler" in c for c in cycles(graph))
