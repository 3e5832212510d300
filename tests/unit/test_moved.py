"""The old paths of the modules that were at the package root (h5serve/_moved.py): each still
imports, as the very module at its new path, with a DeprecationWarning naming the new path; and
the root holds no shim files."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import h5serve
from h5serve._moved import MOVED

PACKAGE = Path(h5serve.__file__).parent


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """Make ``old`` import afresh in this process (a module is imported, and warns, once)."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(h5serve, old.rpartition(".")[2], raising=False)


def test_import_of_an_old_path_warns_and_gives_the_new_module(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "h5serve.sharding")
    with pytest.warns(DeprecationWarning, match=r"h5serve\.sharding has moved to h5serve\.order\.sharding") as seen:
        import h5serve.sharding as old
    import h5serve.order.sharding as new

    assert old is new
    assert seen[0].filename == __file__  # the warning names the line that imported
    assert new.__spec__ is not None and new.__spec__.name == "h5serve.order.sharding"  # its own spec, kept
    assert old.Selection is new.Selection


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_still_imports(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=f"{old} has moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_from_h5serve_import_an_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "h5serve.protocol")
    with pytest.warns(DeprecationWarning, match="h5serve.protocol has moved to h5serve.wire.protocol"):
        from h5serve import protocol
    from h5serve.wire import protocol as new

    assert protocol is new


def test_a_name_never_at_the_root_is_still_missing() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("h5serve.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("h5serve._plan_cli")  # private: documented as gone, no old path


def test_the_root_holds_only_what_every_part_shares() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "_moved.py", "errors.py"]
    assert not {old.rpartition(".")[2] for old in MOVED} & {p.stem for p in PACKAGE.iterdir()}
