"""What a release carries: one version (h5serve.__version__, read by pyproject.toml and shown by
``h5serve --version``), ``py.typed``, the LICENSE that pyproject names; and shellcheck-clean
deploy scripts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import h5serve

from ..helpers import h5serve_cli

REPO = Path(__file__).resolve().parents[2]


def test_the_version_is_defined_once_and_shown_by_the_cli() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", h5serve.__version__)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M), "pyproject takes its version from h5serve"
    assert not re.search(r"^version = \"", pyproject, re.M), "a second version, a literal, in pyproject.toml"
    assert 'version = { attr = "h5serve.__version__" }' in pyproject
    done = h5serve_cli("--version")
    assert done.returncode == 0 and done.stdout == f"h5serve {h5serve.__version__}\n", done


def test_the_license_file_is_the_one_pyproject_names() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^license = \{ text = "MIT" \}', pyproject, re.M)
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")


@pytest.mark.slow
def test_the_wheel_carries_py_typed_the_license_and_the_version(tmp_path: Path) -> None:
    """Built from a copy of the sources (a build writes build/ and *.egg-info beside them),
    offline, with the setuptools already installed."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "h5serve", src / "h5serve", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("h5serve-*.whl")
    assert wheel.name.startswith(f"h5serve-{h5serve.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "h5serve/py.typed" in names
        licenses = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
        assert licenses and z.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"\nVersion: {h5serve.__version__}\n" in metadata and "\nLicense: MIT\n" in metadata


def _shell_scripts() -> list[Path]:
    """The deploy scripts (and CI's), by their #! line, not their name."""
    found = []
    for path in sorted([*(REPO / "deploy").rglob("*"), REPO / ".ci" / "run"]):
        if path.is_file():
            with open(path, "rb") as f:
                first = f.readline()
            if re.match(rb"#!.*\b(ba|da)?sh\b", first):
                found.append(path)
    return found


def test_deploy_scripts_pass_shellcheck() -> None:
    scripts = _shell_scripts()
    assert any(p.name == "prolog.sh" for p in scripts), scripts  # the finder finds them
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck): deploy scripts not checked")
    done = subprocess.run([shellcheck, "--format=gcc", *map(str, scripts)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
