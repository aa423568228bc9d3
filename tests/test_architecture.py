"""The package's import structure, read with ``ast`` (module-level and in-function imports alike).

Dependencies run one way, lowest first:

    errors <- models <- loading, parallel, data <- sampling <- drafters <- analysis
           <- decoding <- planning <- engine <- training <- bench <- cli, serve <- entry-point shims

A module may import its own layer and the layers below it, never above; there are no import
cycles; no module imports a private (``_name``) from another; the package face
(``ssd_jax/__init__.py``) is imported only by its clients (bench, cli, serve); no file is over 600 lines
and no function over 80 (nested functions counted on their own too).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ssd_jax"

LAYERS = {
    "errors": 0,
    "compile": 0,
    "xla_env": 0,
    "models": 1,
    "loading": 2,
    "parallel": 2,
    "data": 2,
    "sampling": 3,
    "drafters": 4,
    "analysis": 5,
    "decoding": 6,
    "planning": 7,
    "engine": 8,
    "training": 9,
    "bench": 10,
    "cli": 11,
    "serve": 11,
}
#: ``python -m ssd_jax.<name>`` entry points kept at their old paths: each only imports its CLI
SHIMS = {
    "ssd_jax.decode",
    "ssd_jax.demo",
    "ssd_jax.roundcost",
    "ssd_jax.launch",
    "ssd_jax.train",
    "ssd_jax.sdsl",
    "ssd_jax.perf",
    "ssd_jax.perfmodel",
    "ssd_jax.__main__",
    "ssd_jax.bench.__main__",
    "ssd_jax.data.__main__",
}
MAX_LINES = 600
#: the longest a function may be, ``def`` line to last line (its decorators aside): a longer one is split
#: into pieces with names of their own
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


MODS = _modules()


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    is_pkg = MODS[mod].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(mod: str) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import in ``mod`` inside the package."""
    out = []
    for node in ast.walk(ast.parse(MODS[mod].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "ssd_jax"]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            if base.split(".")[0] != "ssd_jax":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full, []) if full in MODS else (base, [a.name]))
    return out


def _target(name: str) -> str:
    while name and name not in MODS:
        name = name.rpartition(".")[0]
    return name


def _layer(mod: str) -> int | None:
    if mod in SHIMS:
        return 99
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in MODS if m != "ssd_jax" and _layer(m) is None] == []


def test_imports_point_down_and_never_at_privates_or_the_face():
    wrong = []
    for mod in MODS:
        if mod == "ssd_jax":
            continue
        for imported, names in _edges(mod):
            tgt = _target(imported)
            if tgt == mod:
                continue
            if (
                tgt == "ssd_jax" and _layer(mod) < LAYERS["bench"]
            ):  # bench and cli are clients of the public API
                wrong.append(f"{mod} imports the package face ssd_jax")
                continue
            if tgt != "ssd_jax" and _layer(tgt) is not None and _layer(tgt) > _layer(mod):
                wrong.append(f"{mod} (layer {_layer(mod)}) imports {tgt} (layer {_layer(tgt)})")
            wrong += [
                f"{mod} imports private {tgt}.{n}" for n in names if n.startswith("_") and n != "__version__"
            ]
    assert wrong == []


def test_no_import_cycles():
    graph = {m: {_target(i) for i, _ in _edges(m)} - {m, "ssd_jax", ""} for m in MODS}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(MODS):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_file_over_the_limit():
    big = {
        str(p.relative_to(PKG.parent)): n
        for p in MODS.values()
        if (n := sum(1 for _ in p.open())) > MAX_LINES
    }
    assert big == {}


def test_no_function_over_the_limit():
    long = [
        f"{p.relative_to(PKG.parent)}:{node.name}:{n}"
        for p in MODS.values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert long == []
