"""The app's command line lives in h2o_chat.serve.cli; app.py is the checkout's shim onto it. Its
defaults, and the UI's, are the ones the library declares (CacheConfig, Sampling, create_router)."""

import inspect
import logging
import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest

import app as app_main
from h2o_chat import Sampling
from h2o_chat.cache.config import APP_FIELDS, CacheConfig
from h2o_chat.chat.conversation import cache_config
from h2o_chat.serve import cli as server
from h2o_chat.serve.api import create_router
from h2o_chat.serve.requests import read_cache
from h2o_chat.ui import settings as ui_settings


def test_app_py_is_the_server_module():
    assert app_main.main is server.main and app_main.parse_args is server.parse_args


def test_cache_flag_defaults_are_the_dataclass_defaults():
    args, config = server.parse_args([]), CacheConfig()
    for name in ("policy", "budget", "n_sink", "n_recent", "score", "positions"):
        assert getattr(args, name) == getattr(config, name), name


@pytest.mark.parametrize("n_recent, kept", [(0, 0), (None, 30)], ids=["0-is-none", "none-is-half"])
def test_a_recent_window_means_the_same_on_the_page_the_command_line_and_the_api(n_recent, kept):
    """CacheConfig's n_recent: 0 keeps no recent window, None (the default) half of what the sinks leave."""
    base = dict(policy="h2o", budget=64, n_sink=4, score="sum", positions="rolling")
    flags = ["--budget", "64", "--n-sink", "4"] + ([] if n_recent is None else ["--n-recent", str(n_recent)])
    args = server.parse_args(flags)
    by = {"library": CacheConfig(**base, n_recent=n_recent),
          "command line": cache_config({name: getattr(args, name) for name in APP_FIELDS}),
          "api": cache_config(read_cache({"h2o": {"n_recent": n_recent}}, base, 0, 1)[0]),
          "page": cache_config(ui_settings.cache_settings({**base, "n_recent": "" if n_recent is None else n_recent}))}
    assert {where: (c.n_recent, c.resolve(64).n_recent) for where, c in by.items()} == \
        dict.fromkeys(by, (n_recent, kept))


def test_the_api_memory_flag_defaults_to_the_api_s_own_default():
    default = inspect.signature(create_router).parameters["max_kv_mib"].default
    assert server.parse_args([]).api_kv_mib == default


def test_the_generation_fields_start_at_the_sampling_defaults():
    # until the page's load fills them from the tab's session; no second set of defaults in the UI
    with gr.Blocks():
        fields = ui_settings.build()
    defaults = Sampling()
    shown = fields.sampling
    assert (shown["temperature"].value, shown["top_p"].value, shown["max_new_tokens"].value) == (
        defaults.temperature, defaults.top_p, defaults.max_new_tokens)


def test_without_the_app_extra_the_command_says_what_to_install():
    """`pip install .` (the library alone) installs the command too: without gradio and fastapi
    it answers, even --help, with one line naming the extra, and exits non-zero."""
    blocked = ("import sys; sys.modules['fastapi'] = sys.modules['gradio'] = None; "  # as if never installed
               "sys.argv = ['h2o-chat', '--help']; from h2o_chat.serve.cli import main; main()")
    run = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode != 0 and run.stdout == ""
    assert run.stderr == 'h2o-chat: the app needs fastapi, which is not installed: pip install "h2o-chat[app]" ' \
                         "(the [app] extra)\n"


def test_each_request_is_logged_unless_quiet():
    requests_log = logging.getLogger("h2o_chat.requests")
    before = requests_log.level, list(requests_log.handlers), requests_log.propagate
    try:
        assert server.parse_args([]).quiet is False and server.parse_args(["--quiet"]).quiet is True
        server.show_requests(quiet=False)
        assert requests_log.isEnabledFor(logging.INFO) and requests_log.handlers
        server.show_requests(quiet=True)
        assert not requests_log.isEnabledFor(logging.INFO)
    finally:
        requests_log.setLevel(before[0])
        requests_log.handlers[:], requests_log.propagate = before[1], before[2]
