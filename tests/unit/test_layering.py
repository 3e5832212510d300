"""The package's layering and public names, read from the source (ast): imports only point
down the layers drawn in h5serve/__init__.py, and a name one module imports from another is in
that module's ``__all__`` unless the module is private (``_name.py``) or the name is."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "h5serve"

# Each layer may import the layers after it, never those before it.
LAYERS: list[tuple[str, ...]] = [
    ("h5serve.cli", "h5serve.demo", "h5serve.__main__",
     "h5serve.daemon.__main__"),
    ("h5serve.daemon", "h5serve.client"),  # siblings that never import each other (below)
    ("h5serve.hdf5",),
    ("h5serve.segments", "h5serve.topology"),
    ("h5serve.wire",),
    ("h5serve.order",),
    ("h5serve.util",),
    ("h5serve.errors", "h5serve"),
]


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


def layer_of(module: str) -> int:
    best = (-1, -1)  # (length of the longest matching prefix, layer)
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    assert best[1] >= 0, f"{module} is in no layer: add it to LAYERS and to the drawing in h5serve/__init__.py"
    return best[1]


def test_the_walk_sees_the_package() -> None:
    assert len(ALL_IMPORTS) > 100
    assert Import("h5serve.client.dataset", "h5serve.errors", (), 0).module in {i.module for i in ALL_IMPORTS}


def layering_violation(imp: Import) -> str:
    if imp.module == "h5serve" and imp.names and set(imp.names) <= {"errors", "__version__"}:
        return ""  # "from h5serve import errors" is the errors layer
    if layer_of(imp.module) < layer_of(imp.importer):
        return f"{imp.importer} (line {imp.line}) imports {imp.module}, a layer above it"
    if {(imp.importer.split(".") + [""])[1], (imp.module.split(".") + [""])[1]} == {"client", "daemon"}:
        return f"{imp.importer} (line {imp.line}) crosses between client and daemon"
    return ""


def test_imports_point_down() -> None:
    wrong = [v for v in map(layering_violation, ALL_IMPORTS) if v]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_import_is_seen() -> None:
    assert layering_violation(Import("h5serve.client.dataset", "h5serve.daemon.store", ("Store",), 1))
    assert layering_violation(Import("h5serve.segments.format", "h5serve.hdf5.vlen", ("read_vlen",), 1))
    assert not layering_violation(Import("h5serve.daemon.store", "h5serve.segments", ("SegmentMeta",), 1))


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
