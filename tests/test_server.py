"""The app's command line lives in h2o_chat.server; app.py is the checkout's shim onto it."""

import app as app_main
from h2o_chat import server
from h2o_chat.policy import CacheConfig


def test_app_py_is_the_server_module():
    assert app_main.main is server.main and app_main.parse_args is server.parse_args


def test_cache_flag_defaults_are_the_dataclass_defaults():
    args, config = server.parse_args([]), CacheConfig()
    for name in ("policy", "budget", "n_sink", "n_recent", "score", "positions"):
        assert getattr(args, name) == getattr(config, name), name
