"""The app's command line lives in h2o_chat.serve.cli; app.py is the checkout's shim onto it. Its
defaults, and the UI's, are the ones the library declares (CacheConfig, Sampling, create_router)."""

import inspect

import gradio as gr

import app as app_main
from h2o_chat import Sampling
from h2o_chat.cache.config import CacheConfig
from h2o_chat.serve import cli as server
from h2o_chat.serve.api import create_router
from h2o_chat.ui import settings as ui_settings


def test_app_py_is_the_server_module():
    assert app_main.main is server.main and app_main.parse_args is server.parse_args


def test_cache_flag_defaults_are_the_dataclass_defaults():
    args, config = server.parse_args([]), CacheConfig()
    for name in ("policy", "budget", "n_sink", "n_recent", "score", "positions"):
        assert getattr(args, name) == getattr(config, name), name


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
