"""Packaging. pyproject.toml and requirements.txt declare the same dependencies: requirements.txt
is the README's and CI's install path, pyproject.toml what `pip install .` reads; neither may drift.
The app's CSS and script live in the checkout's assets/ and an installed package carries them as
h2o_chat/assets/: the app finds them either way. (No test pip-installs anything: the installed
layout is the wheel setuptools builds, unpacked.)"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def requirement_lines(lines):
    """{name: the requirement as written, spaces removed}, from requirement strings."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0).lower()
            out[name] = line.replace(" ", "").replace("'", '"')
    return out


def test_pyproject_and_requirements_agree():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        declared += [r for r in reqs if not r.startswith("h2o-chat[")]
    declared = requirement_lines(declared)
    required = requirement_lines((REPO / "requirements.txt").read_text().splitlines())
    declared.pop("ruff")  # the linter: CI installs it itself (.ci/run), the README's install does not need it
    assert declared == required


def test_console_scripts_name_functions_that_exist():
    import importlib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"h2o-chat", "h2o-chat-bench", "h2o-chat-eval"}
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_the_app_reads_its_css_and_script_from_the_checkouts_assets_folder():
    from h2o_chat.ui import page as ui

    assert ui.CHECKOUT_ASSETS == REPO / "assets"
    assert ui.CSS == (REPO / "assets" / "app.css").read_text(encoding="utf-8")
    assert ui.HEAD == f"<script>{(REPO / 'assets' / 'app.js').read_text(encoding='utf-8')}</script>"
    assert not list((REPO / "h2o_chat").glob("assets/*"))  # one copy, where the project's layout puts it


def test_a_missing_asset_names_both_places_it_was_looked_for():
    from h2o_chat.ui import page as ui

    with pytest.raises(FileNotFoundError, match=r"'nope.css' is neither in the installed package .* nor in the "
                                                 r"checkout"):
        ui.read_asset("nope.css")


def test_the_package_ships_the_assets_folder_as_h2o_chat_assets_css_and_js_only_and_the_c_sources():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "h2o_chat.assets" in setuptools["packages"]
    assert setuptools["package-dir"] == {"h2o_chat.assets": "assets"}
    assert setuptools["package-data"] == {"h2o_chat.assets": ["*.css", "*.js"], "h2o_chat.native": ["*.c", "*.h"]}


def built_wheel(tmp_path):
    """The wheel `pip install .` would install, built by setuptools from a copy of the checkout's
    packaged files (so no build/ or egg-info is left in the checkout); its path."""
    source = tmp_path / "source"
    for name in ("h2o_chat", "assets"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"],
                   cwd=source, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("h2o_chat-*.whl")
    return wheel


@pytest.mark.slow
def test_an_installed_package_finds_its_css_and_script(tmp_path):
    wheel = built_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    assert {"h2o_chat/assets/app.css", "h2o_chat/assets/app.js", "h2o_chat/native/attend_one.c", "h2o_chat/native/rotate_one.c", "h2o_chat/native/bf16.h",
            "h2o_chat/native/int4_mm.c", "h2o_chat/native/dequant_int4.c", "h2o_chat/native/rms_tail.c"} <= set(names)
    assert not [n for n in names if n.endswith(".png") or n.startswith("assets/")]  # the README's, not the app's
    # the unpacked wheel, first on the path, is what an installed h2o-chat imports, run from elsewhere
    probe = ("import h2o_chat, h2o_chat.ui.page as ui; from h2o_chat import native; print(all(s.is_file() for s in native.SOURCES)); "
             "print(h2o_chat.__file__); print(len(ui.read_asset('app.css')), len(ui.read_asset('app.js')))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    has_source, location, sizes = run.stdout.splitlines()[-3:]
    assert has_source == "True"  # the C sources, beside native/__init__.py
    assert location == str(tmp_path / "site" / "h2o_chat" / "__init__.py")
    css, js = (REPO / "assets" / "app.css").read_text(encoding="utf-8"), (REPO / "assets" / "app.js").read_text(
        encoding="utf-8")
    assert sizes == f"{len(css)} {len(js)}"
