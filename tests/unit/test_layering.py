"""The package's layering and public names, read from the source (ast).

- The layers are drawn in h5serve/__init__.py's docstring (a line per layer, packages side by side
  separated by ``|``); each package's ``__init__`` says which packages it may import (``May
  import:``), and may name only packages drawn below it: so the two agree and no two packages
  import each other.
- Every import (at the top, in a function, under ``if TYPE_CHECKING:``) is of the importer's own
  package or one its ``May import:`` names; the root modules (errors, the package itself, _moved)
  are the bottom layer; ``__main__`` modules are entry points, imported by nothing.
- No import circle between modules, of any length (nor between bench/'s modules).
- A name one module imports from another is in that module's ``__all__`` unless the module is
  private (``_name.py``) or the name is.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "h5serve"
ROOT = "h5serve.errors"  # the part the root modules belong to: errors, h5serve itself (__version__), _moved


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    module: str  # dotted module imported from
    names: tuple[str, ...]  # names taken from it ("from m import a, b"); () for "import m"
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "h5serve":
                found.append(Import(name, target, tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.Import):
            found += [Import(name, a.name, (), node.lineno) for a in node.names if a.name.split(".")[0] == "h5serve"]
    return found


ALL_IMPORTS = [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def part_of(module: str) -> str:
    """The package a module belongs to (``h5serve.client``), or ROOT for the root modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else ROOT


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def drawn_layers() -> list[set[str]]:
    """The drawing in h5serve/__init__.py, top layer first: each line's packages."""
    block = docstring(PACKAGE / "__init__.py").split("::\n", 1)[1].strip("\n").split("\n\n")[0]
    return [{f"h5serve.{name.strip()}" for name in re.split(r"\s{2,}", line.strip())[0].split("|")}
            for line in block.splitlines()]


LAYERS = drawn_layers()
PACKAGES = sorted(f"h5serve.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py"))


def layer_of(part: str) -> int:
    found = [index for index, layer in enumerate(LAYERS) if part in layer]
    assert found, f"{part} is not drawn in h5serve/__init__.py's layering: add it"
    return found[0]


def may_import(part: str) -> set[str]:
    """What a package's ``__init__`` says it may import (``May import: h5serve.a, h5serve.b``)."""
    if part == ROOT:
        return set()
    found = re.search(r"^May import:(.*?)(?:\n\n|\Z)", docstring(PACKAGE / part.split(".")[1] / "__init__.py"),
                      re.MULTILINE | re.DOTALL)
    assert found, f"{part}/__init__.py does not say what it may import: add a 'May import: h5serve.x, ...' line"
    return set(re.findall(r"h5serve\.\w+", found.group(1)))


def test_the_walk_sees_the_package() -> None:
    assert len(ALL_IMPORTS) > 100
    assert Import("h5serve.client.dataset", "h5serve.errors", (), 0).module in {i.module for i in ALL_IMPORTS}
    assert len(LAYERS) >= 6 and {"h5serve.daemon", "h5serve.client"} in LAYERS


def test_the_drawing_shows_every_package_once() -> None:
    drawn = [part for layer in LAYERS for part in layer]
    assert sorted(drawn) == sorted({*PACKAGES, ROOT}), "h5serve/__init__.py's drawing and the packages differ"


def test_each_package_may_import_only_packages_drawn_below_it() -> None:
    wrong = [f"{part} may import {other}, which is not drawn below it" for part in PACKAGES
             for other in sorted(may_import(part)) if layer_of(other) <= layer_of(part)]
    assert not wrong, "\n".join(wrong)


def layering_violation(imp: Import) -> str:
    """Why ``imp`` breaks the layering; "" when it does not."""
    if imp.importer.endswith(".__main__"):
        return ""  # an entry point: run, never imported (test_nothing_imports_an_entry_point)
    mine, theirs = part_of(imp.importer), part_of(imp.module)
    if theirs == mine or theirs in may_import(mine):
        return ""
    return (f"{imp.importer} (line {imp.line}) imports {imp.module}: {mine} may import only "
            f"{', '.join(sorted(may_import(mine))) or 'the root modules'} (the 'May import:' of its __init__)")


def test_imports_follow_the_layers() -> None:
    wrong = [v for v in map(layering_violation, ALL_IMPORTS) if v]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_import_is_seen() -> None:
    assert layering_violation(Import("h5serve.client.dataset", "h5serve.daemon.store.store", ("Store",), 1))
    assert layering_violation(Import("h5serve.daemon.store.store", "h5serve.client.lazy", ("x",), 1))
    assert layering_violation(Import("h5serve.segments.format", "h5serve.hdf5.vlen", ("read_vlen",), 1))
    assert layering_violation(Import("h5serve.order.stream_plan", "h5serve.segments", ("HEADER_SIZE",), 1))
    assert layering_violation(Import("h5serve.errors", "h5serve.util.units", ("parse_size",), 1))
    assert not layering_violation(Import("h5serve.daemon.store.store", "h5serve.segments", ("SegmentMeta",), 1))
    assert not layering_violation(Import("h5serve.cli.main", "h5serve", ("__version__",), 1))
    assert not layering_violation(Import("h5serve.daemon.__main__", "h5serve.cli", ("main",), 1))


def test_nothing_imports_an_entry_point() -> None:
    wrong = [f"{i.importer} (line {i.line}) imports {i.module}" for i in ALL_IMPORTS
             if i.module.endswith("__main__") or "__main__" in i.names]
    assert not wrong, "\n".join(wrong)


def is_module(name: str) -> bool:
    base = PACKAGE.parent / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """importer -> the modules it imports: ``from p import m`` is of the module ``p.m`` when
    there is one, else of ``p`` (a package: its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        targets = {f"{imp.module}.{n}" if is_module(f"{imp.module}.{n}") else imp.module for n in imp.names}
        graph.setdefault(imp.importer, set()).update((targets or {imp.module}) - {imp.importer})
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a circle,
    or several sharing modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    found = circles(module_graph(ALL_IMPORTS))
    assert not found, "modules that import each other (move what both need down into one of them):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def bench_graph() -> dict[str, set[str]]:
    """bench/'s modules -> the bench modules each imports (``from .x import``, anywhere in it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                graph.setdefault(path.stem, set()).add(node.module.split(".")[0])
    return graph


def test_no_import_circles_in_bench() -> None:
    graph = bench_graph()
    assert graph, "the walk found no bench module"
    found = circles(graph)
    assert not found, "bench modules that import each other (move what both need into bench/common.py):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_a_circle_is_seen() -> None:
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}}) == []
    typing_only = [Import("h5serve.x.a", "h5serve.x.b", ("B",), 1), Import("h5serve.x.b", "h5serve.x.a", ("A",), 9)]
    assert circles(module_graph(typing_only)) == [["h5serve.x.a", "h5serve.x.b"]]


def public_names(module: str) -> set[str] | None:
    """``__all__`` of ``module`` (a literal list, or one built from other modules' ``__all__``),
    or None when it has none."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign)\
            else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:  # built from other modules' __all__: trust the module as loaded
                import importlib

                return set(importlib.import_module(module).__all__)
    return None


def is_private(module: str) -> bool:
    return any(part.startswith("_") and part not in ("__init__", "__main__") for part in module.split("."))


def is_submodule(module: str, name: str) -> bool:
    base = PACKAGE.parent / module.replace(".", "/")
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


CROSS = [(imp, name) for imp in ALL_IMPORTS for name in imp.names
         if not is_private(imp.module) and not name.startswith("_") and name != "*"
         and not is_submodule(imp.module, name)]


def test_every_name_imported_across_modules_is_public() -> None:
    wrong = []
    for imp, name in CROSS:
        public = public_names(imp.module)
        if public is None or name not in public:
            wrong.append(f"{imp.importer} (line {imp.line}) imports {name} from {imp.module}, not in its __all__")
    assert not wrong, "\n".join(wrong)


def test_every_module_says_what_is_public() -> None:
    missing = [module_name(p) for p in sorted(PACKAGE.rglob("*.py"))
               if not is_private(module_name(p)) and p.name != "__main__.py" and public_names(module_name(p)) is None]
    assert not missing, f"modules without __all__: {missing}"
