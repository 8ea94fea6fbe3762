"""The package's shape, checked from its source with `ast`: layers point one way, nothing imports in a
circle, function-local imports only where they keep start-up fast, functions stay short.

Every `.py` file under `finetune/` is read, subfolders included, and every import is seen: module-level,
inside a function, or under `if TYPE_CHECKING:` (a cycle that only type checking sees is still a cycle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "finetune"
# Bottom to top. A module may import its own part (e.g. within `adapters/`) or any part of a lower layer;
# nothing below imports anything above, and two parts of one layer do not import each other.
LAYERS: list[set[str]] = [
    {"errors", "version", "paths", "console", "signals", "strict_json"},
    {
        "atomic",
        "launched",
        "tensorfile",
        "quantization",
        "device",
        "cpu_features",
        "prompting",
        "fingerprint",
        "peft_import",
        "chunked_loss",
    },
    {"catalog"},  # copies a recipe through `atomic`
    {"recipe", "embedded"},
    {"manifest", "data"},
    {"adapters"},
    {"model", "scoring", "generation"},
    {"plan", "export", "report"},
    {"api"},
    {"serve"},
    # Training sits above the whole inference half (api, serve, scoring, ...) and nothing there imports
    # it: `generate`, `eval`, `serve` and the adapter arithmetic start without the training stack.
    {"training"},
    {"commands"},
    {"cli"},
    {"__main__"},
]
# Where importing a finetune module inside a function is allowed: the CLI's command modules (so that
# `finetune --help` imports no torch), the package's lazy `finetune.load_model`/`finetune.train`, and the
# embedded base's cache, which every model load consults but which needs the build (transformers' model code,
# the pretraining loop) only when a base is not there yet.
LAZY_IMPORTS_ALLOWED = ("commands/", "__init__.py", "embedded/cache.py")
MAX_FUNCTION_LINES = 60


def _source_files() -> list[Path]:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) > 40, f"found only {len(files)} files under {PACKAGE_DIR}"
    return files


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in _source_files()}


def _part(module: str) -> str:
    """The top-level part a module belongs to: `finetune.adapters.lora` -> `adapters`."""
    return module.split(".")[1] if "." in module else module


def _layer(module: str) -> int:
    part = _part(module)
    found = [index for index, parts in enumerate(LAYERS) if part in parts]
    assert found, f"{part} (of {module}) is in no layer: add it to LAYERS"
    return found[0]


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The module a dotted import name refers to (`finetune.adapters.lora.read_adapter` -> the module)."""
    known = set(modules)
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in known else None


def _imports(tree: ast.AST, modules: Iterable[str]) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function) for every finetune module `tree` imports. `from p import x`
    imports the submodule p.x when there is one, else the module p (the name x is defined there)."""
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local_lines = {n.lineno for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [_resolve(f"{node.module}.{alias.name}", modules) or node.module for alias in node.names]
        else:
            continue
        for name in names:
            module = _resolve(name, modules) if name.startswith("finetune") else None
            if module is not None:
                found.append((node.lineno, module, node.lineno in local_lines))
    return sorted(set(found))


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        imported = {target for _, target, _ in _imports(ast.parse(path.read_text(encoding="utf-8")), MODULES)}
        edges[module] = imported - {module}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer_problems(module: str, imported: Iterable[str]) -> list[str]:
    problems = []
    for target in sorted(imported):
        if module == "finetune" or _part(target) == _part(module):
            continue  # the package facade re-exports; a part imports itself freely (cycles are checked apart)
        if _layer(target) > _layer(module):
            problems.append(f"{module} imports {target}, a layer above it")
        elif _layer(target) == _layer(module):
            problems.append(f"{module} imports {target}, a part beside it in the same layer")
    return problems


def test_layers_point_down_only():
    problems = [problem for module, imported in _graph().items() for problem in _layer_problems(module, imported)]
    assert not problems, "\n".join(problems)
    every_part = {_part(module) for module in MODULES if module != "finetune"}
    assert every_part == set().union(*LAYERS), f"parts without a layer, or layers naming no part: {every_part}"


def test_no_import_cycles_hidden_or_not():
    cycles = _cycles(_graph())
    assert not cycles, f"modules importing each other in a circle: {cycles}"


def test_finetune_modules_are_imported_inside_functions_only_where_start_up_needs_it():
    problems = []
    for path in MODULES.values():
        if _relative(path).startswith(LAZY_IMPORTS_ALLOWED):
            continue
        for line, target, local in _imports(ast.parse(path.read_text(encoding="utf-8")), MODULES):
            if local:
                problems.append(f"{_relative(path)}:{line} imports {target} inside a function")
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_they_claim_to():
    """The checker itself: a function-local import, an upward one and a cycle are each found."""
    tree = ast.parse("def f():\n    from finetune.api import load_model\nfrom finetune.adapters import lora\n")
    assert _imports(tree, MODULES) == [(2, "finetune.api", True), (3, "finetune.adapters.lora", False)]
    assert _layer_problems("finetune.adapters.fit", ["finetune.api", "finetune.errors"]) == [
        "finetune.adapters.fit imports finetune.api, a layer above it"
    ]
    assert _layer_problems("finetune.plan.memory", ["finetune.report"]) == [
        "finetune.plan.memory imports finetune.report, a part beside it in the same layer"
    ]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_is_over_60_lines():
    long = {}
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{_relative(path)}::{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"
