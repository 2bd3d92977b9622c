"""h2o-chat: a local chat whose KV cache is managed by H2O. `python app.py --help` for the flags.

A checkout's entry point; the app itself is `h2o_chat.serve.cli` (installed as the `h2o-chat` command)."""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported, as the server sets it

from h2o_chat.serve.cli import main, parse_args  # noqa: E402  (tests call app.parse_args / app.main)

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    main()
