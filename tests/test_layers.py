"""The package is built in floors, each a folder that imports only the floors below it:

    native  C kernels for a CPU's decode step       imports nothing of h2o_chat
    cache   which tokens stay (tensors only)        native
    models  loading, the lean decode step           native, cache
    chat    one conversation and the batch of them  native, cache, models
    ui      the page and the panel's drawings       native, cache, models, chat
    serve   the command line, /v1, the API's pool   native, cache, models, chat, ui
    bench   measurements and the peers' workers     everything

This test reads every module's imports (function-level ones too) and fails on one that runs upward."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "h2o_chat"
FLOORS = ("native", "cache", "models", "chat", "ui", "serve", "bench")


def imported_modules(path):
    """The h2o_chat modules `path` imports, as dotted names ("h2o_chat.chat.session")."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not (base == "h2o_chat" and all(a.name in FLOORS for a in node.names)):  # `from .. import native`: a floor
                found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from . import store` imports a module
    return {name for name in found if name == "h2o_chat" or name.startswith("h2o_chat.")}


def floor(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if floor(".".join(p.relative_to(PACKAGE.parent).parts)))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_upward(path):
    own = floor(".".join(path.relative_to(PACKAGE.parent).parts))
    allowed = FLOORS[: FLOORS.index(own) + 1]
    upward = sorted(name for name in imported_modules(path)
                    if name == "h2o_chat" or floor(name) not in allowed and floor(name) is not None)
    # `h2o_chat` itself (the public names) sits above every floor: only bench may import it
    if own == "bench":
        upward = [name for name in upward if name != "h2o_chat"]
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports {upward}"


# the commands of before the floors, kept as thin aliases of where they live now
ALIASES = {"evaluate.py": {"h2o_chat.bench.evaluate", "h2o_chat.bench.evaluate.main"}}


def test_every_module_sits_on_a_floor():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" and p.name not in ALIASES]
    assert not loose, f"modules outside the floors: {loose}"


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_an_alias_only_imports_what_it_stands_for(name):
    assert imported_modules(PACKAGE / name) == ALIASES[name]


def test_the_walk_sees_imports_of_every_kind(tmp_path):
    """The checker itself: relative, absolute and function-level imports are all read."""
    path = PACKAGE / "ui" / "page.py"
    names = imported_modules(path)
    assert "h2o_chat.ui.chat" in names and "h2o_chat.chat.conversation" in names
    cli = imported_modules(PACKAGE / "serve" / "cli.py")
    assert "h2o_chat.ui.page" in cli  # imported inside main()
