"""pyproject.toml and requirements.txt declare the same dependencies: requirements.txt is the
README's and CI's install path, pyproject.toml what `pip install .` reads; neither may drift."""

import re
import tomllib
from pathlib import Path

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


def test_the_app_assets_ship_inside_the_package():
    from h2o_chat import ui

    assert ui.ASSETS.parent == REPO / "h2o_chat" and (ui.ASSETS / "app.css").is_file()
