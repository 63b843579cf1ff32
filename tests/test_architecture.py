"""The house plan, checked by walking the packages' imports with `ast`.

* Data flows one way: ``pallas_kernels`` <- ``models`` <- ``mmjax`` core (``sparse`` / ``parallel`` <-
  ``inference`` <- ``speculative``) <- ``mmjax.drivers``; a module imports only modules of its own
  layer or lower ones.
* No private name (``_x``) is imported from, or reached into, another module.
* No project import inside a function (the way to dodge an import cycle).
* Every ``__init__.py`` is one import block and writes ``__all__`` once.
* The README's architecture tree names every module, and only modules that exist.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "models", "mmjax")

# Layers, lowest first: a module may import modules of its own layer or of lower layers.
LAYERS = (
    ("pallas_kernels",),
    ("models",),
    ("mmjax.timing", "mmjax.progress", "mmjax.files", "mmjax.io"),
    ("mmjax.sparse", "mmjax.parallel", "mmjax.video_upload"),
    ("mmjax.inference", "mmjax.load"),
    ("mmjax.speculative",),
    ("mmjax", "mmjax.patterns"),
    ("mmjax.drivers",),
)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    """Index of the most specific LAYERS prefix of ``module``."""
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} belongs to no layer"
    return best


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not MODULES[module].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(node, imported module, imported names, inside a function) for every project import."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    funcs = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
             for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_project(a.name):
                    yield node, a.name, (), id(node) in funcs
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if _is_project(target):
                yield node, target, tuple(a.name for a in node.names), id(node) in funcs


def _target_module(target: str, name: str) -> str:
    """``from target import name``: the module ``target.name`` when it is one, else ``target``."""
    sub = f"{target}.{name}"
    return sub if sub in MODULES else target


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module):
    own = _layer(module)
    for node, target, names, _ in _imports(module):
        for t in ([_target_module(target, n) for n in names] or [target]):
            assert _layer(t) <= own, (f"{module} (layer {LAYERS[own]}) imports {t} from a higher layer "
                                      f"{LAYERS[_layer(t)]} (line {node.lineno})")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node, target, names, _ in _imports(module):
        for n in names:
            assert not (n.startswith("_") and not n.startswith("__")), (
                f"{module} imports the private name {n} from {target} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if _target_module(target, a.name) != target:  # a module imported by name
                    aliases[a.asname or a.name] = _target_module(target, a.name)
        else:
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            pytest.fail(f"{module} reaches into {aliases[node.value.id]}.{node.attr} (line {node.lineno})")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_imports_inside_functions(module):
    for node, target, _, inside in _imports(module):
        assert not inside, f"{module} imports {target} inside a function (line {node.lineno})"
    assert "noqa: E402" not in MODULES[module].read_text(), f"{module}: an import after code (noqa: E402)"


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_init_is_one_import_block(module):
    tree = ast.parse(MODULES[module].read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    seen_other = False
    all_writes = 0
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            assert not seen_other, f"{module}: an import after other statements (line {node.lineno})"
        else:
            seen_other = True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node, ast.Assign), f"{module}: __all__ changed after it was written (line {node.lineno})"
            all_writes += 1
    assert all_writes <= 1, f"{module}: __all__ written {all_writes} times"


def _readme_tree() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## Architecture\n.*?```\n(.*?)```", text, re.S)
    assert m, "README.md: expected an '## Architecture' section with a code block tree"
    return m.group(1)


def test_readme_architecture_names_every_module():
    tree = _readme_tree()
    named = set()
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines():
        m = re.match(r"^( *)(\S+?)(/?)(?:\s|$)", line)
        if not m:
            continue
        indent, entry, is_dir = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [entry])
        if is_dir:
            stack.append((indent, entry))
        named.add(path + ("/" if is_dir else ""))
    files = {str(p.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py"}
    dirs = {str(p.parent.relative_to(ROOT)) + "/" for p in MODULES.values() if p.name == "__init__.py"}
    listed_py = {n for n in named if n.endswith(".py") and not n.endswith("__init__.py")}
    assert files - listed_py == set(), f"README architecture tree misses modules: {sorted(files - listed_py)}"
    assert listed_py - files == set(), f"README architecture tree names missing modules: {sorted(listed_py - files)}"
    listed_pkgs = {n for n in named if n.endswith("/") and n.split("/")[0] in PACKAGES}
    assert dirs - listed_pkgs == set(), f"README architecture tree misses packages: {sorted(dirs - listed_pkgs)}"
