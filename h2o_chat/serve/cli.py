"""The app's command line: `h2o-chat` (installed) or `python app.py` (a checkout) parse flags here and
serve the chat UI with the OpenAI-compatible /v1 API beside it. `h2o-chat --help` for the flags."""

import argparse
import errno
import hmac
import importlib
import ipaddress
import logging
import os
import socket
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a private app phones nowhere

# Replies decoded at once in one batch (batch.py). Measured on a 2-core CPU (bench concurrent,
# medians of 3): one chat alone is as fast through the batcher (0.99x), four at once decode 3.4x
# the tokens/s of one (each at 0.94x its alone speed), eight 4.4x (0.65x each). Memory: 4 x budget.
DEFAULT_CONCURRENCY = 4


def add_setting_flag(parser, setting, *flags, note=None, **overrides):
    """The flag of one settings field (`dataclasses.fields(CacheConfig)`'s): `--n-recent` for n_recent
    (or `flags`), with the default, choices and help of its one declaration (see cache.config).
    note: more help after the declared one; `overrides`: argparse keywords where a command differs
    on purpose (the caller says why)."""
    meta = setting.metadata
    if isinstance(setting.default, bool):  # --keep-template / --no-keep-template
        kwargs = {"action": argparse.BooleanOptionalAction}
    elif meta["choices"]:
        kwargs = {"choices": meta["choices"]}
    else:
        kwargs = {"type": type(setting.default) if setting.default is not None else int}
    kwargs = {"default": setting.default, **kwargs, **overrides}
    kwargs["help"] = meta["help"] + (f"; {note}" if note else "") + " (default: %(default)s)"
    parser.add_argument(*(flags or [f"--{setting.name.replace('_', '-')}"]), **kwargs)


QUANTIZATION_HELP = ("auto (default): a .gguf file's 4- and 8-bit blocks run as they are stored (int4), a float "
                     "model as it is; none: every weight in --dtype; int4, int8: quantize the linear layers at load "
                     "(torch's kernels, CPU or CUDA); 4bit, 8bit: bitsandbytes (CUDA)")


def add_quantization_flag(parser):
    """--quantization, with load_model's values (the app's, bench's and evaluate's)."""
    from ..models.load import QUANTIZATIONS

    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help=QUANTIZATION_HELP)


def quantization_of(args):
    """--quantization, or the value an old --load-in-4bit/--load-in-8bit flag stands for."""
    old = [q for q, given in (("4bit", args.load_in_4bit), ("8bit", args.load_in_8bit)) if given]
    if len(old) > 1:
        raise ValueError("choose one of --load-in-4bit and --load-in-8bit")
    if old and args.quantization not in ("auto", old[0]):
        raise ValueError(f"--load-in-{old[0]} is --quantization {old[0]}; give one of them")
    return old[0] if old else args.quantization


APP_MODULES = ("fastapi", "gradio")  # what the [app] extra brings (gradio brings fastapi)
APP_EXTRA = 'pip install "h2o-chat[app]"'


def check_app_installed():
    """The app's own packages are there: else one line that says what to install (the library
    installs without them, and the command came with it)."""
    for name in APP_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            sys.exit(f"h2o-chat: the app needs {name}, which is not installed: {APP_EXTRA} (the [app] extra)")


def show_requests(quiet):
    """One line per API request on stderr (serve/requestlog.py), unless --quiet."""
    logger = logging.getLogger("h2o_chat.requests")
    if quiet:
        logger.setLevel(logging.WARNING)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the line once, whatever else configures the root logger


def parse_args(argv=None):
    check_app_installed()
    from ..cache.config import APP_FIELDS, CacheConfig
    from ..chat.saved_kv import DiskBudget
    from ..models.compile import Compilation
    from .api import MAX_PROMPT_TOKENS
    from .pool import MAX_IDLE_KV_MIB

    p = argparse.ArgumentParser(description="A local chat whose KV cache is managed by H2O (Heavy-Hitter Oracle).")
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also make a public Gradio share link (off by default)")
    p.add_argument("--auth", default=None, metavar="USER:PASS",
                   help="require this login for the page (default: with --api-key, the key as the password)")
    for setting in fields(CacheConfig):
        if setting.name in APP_FIELDS:
            add_setting_flag(p, setting)
    DISK_SETTINGS = {f.name: f for f in fields(DiskBudget)}
    add_setting_flag(p, fields(Compilation)[0], "--compile")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    add_quantization_flag(p)
    # the flags of before --quantization, kept working: each is one of its values
    p.add_argument("--load-in-4bit", action="store_true", help="the same as --quantization 4bit")
    p.add_argument("--load-in-8bit", action="store_true", help="the same as --quantization 8bit")
    p.add_argument("--device-map", default=None, help="'auto' spreads a large model over several GPUs")
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model (off by default)")
    p.add_argument("--data-dir", default=str(Path.home() / ".local" / "share" / "h2o-chat"),
                   help="where sessions are autosaved")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help="replies generated at once across all tabs and API clients, decoded together in one batch "
                        f"(default {DEFAULT_CONCURRENCY}; 1 generates one reply at a time)")
    p.add_argument("--api-key", default=os.environ.get("H2O_CHAT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on the API (/v1, llama.cpp's and Ollama's routes), and the key as "
                        "the page's password unless --auth is given (default: $H2O_CHAT_API_KEY; with --auth and no "
                        "key the API refuses every request)")
    p.add_argument("--api-kv-mib", type=float, default=MAX_IDLE_KV_MIB,
                   help=f"KV memory of the API's idle conversations (default {MAX_IDLE_KV_MIB})")
    add_setting_flag(p, DISK_SETTINGS["total_mib"], "--kv-disk-mib", type=float)  # float: 0.5 is a size too
    p.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
                   help="an API request whose prompt is longer is refused before any of it is computed "
                        f"(default {MAX_PROMPT_TOKENS:,}: about a minute of prefill on a 2-core CPU)")
    p.add_argument("--quiet", action="store_true",
                   help="no log line per API request (by default each shows its route, status, client, tokens and "
                        "speed)")
    return p.parse_args(argv)


def is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(args):
    """A server others can reach (a non-loopback --host, --share) must ask for a credential."""
    if (args.share or not is_loopback(args.host)) and args.auth is None and not args.api_key:
        reach = "--share makes a public link" if args.share else f"--host {args.host} listens beyond this machine"
        raise ValueError(f"{reach}, and nothing would ask for a credential: add --api-key KEY (or "
                         "H2O_CHAT_API_KEY) and/or --auth user:pass")


def page_login(auth, api_key):
    """What guards the page and /gradio_api: --auth's login, else the API key as the password (any
    user name), else nothing (a server on this machine only)."""
    if auth is not None or not api_key:
        return auth
    return lambda user, password: hmac.compare_digest(password.encode(), api_key.encode())


def check_data_dir(path):
    """The data folder exists (or can be made) and can be written: else one line, before anything loads."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--data-dir {path} cannot be written ({e.strerror or type(e).__name__}); give a folder "
                         "h2o-chat may write, e.g. --data-dir ~/h2o-chat") from None


def check_port(host, port):
    """The address can be listened on: else one line naming --port, before the model loads (Gradio's
    own refusal is a traceback that points at GRADIO_SERVER_PORT, which this app does not read)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
            probe.bind((host, port))
    except OSError as e:
        raise ValueError(port_taken(host, port, e)) from None


def port_taken(host, port, error):
    in_use = error.errno in (errno.EADDRINUSE, None)  # None: Gradio's own "Cannot find empty port"
    reason = "is in use (another h2o-chat?)" if in_use else f"cannot be used ({error.strerror})"
    return f"port {port} on {host} {reason}: start with another, e.g. --port {port + 1}"


def main(argv=None):
    args = parse_args(argv)
    from ..cache.config import APP_FIELDS, CacheConfig
    from ..chat import saved_kv
    from ..chat.saved_kv import DiskBudget
    from ..models.load import ModelLoadError, load_model
    from ..models.threads import on_own_thread, single_threaded_here
    from ..ui.page import CSS, HEAD, build

    cache = {name: getattr(args, name) for name in APP_FIELDS}
    auth = None
    try:
        CacheConfig(**cache)  # refuse impossible budgets before loading anything
        quantization = quantization_of(args)
        if args.auth is not None:
            user, sep, password = args.auth.partition(":")
            if not (sep and user and password):
                raise ValueError("--auth must look like user:password")
            auth = (user, password)
        if args.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if args.max_prompt_tokens < 1:
            raise ValueError("--max-prompt-tokens must be at least 1")
        if not args.kv_disk_mib >= 0:
            raise ValueError("--kv-disk-mib must be at least 0 (0 saves no cache: every reopen replays)")
        disk_budget = DiskBudget(total_mib=args.kv_disk_mib)
        check_exposure(args)
        check_data_dir(args.data_dir)
        check_port(args.host, args.port)
        # the main thread runs no parallel op: the model loads on a thread that exits, and only the
        # batcher's thread keeps a team of intra-op threads (models/threads.py says why)
        threads = single_threaded_here()
        model, tokenizer = on_own_thread(lambda: load_model(
            args.model, dtype=args.dtype, quantization=quantization, device_map=args.device_map,
            trust_remote_code=args.trust_remote_code), threads)
    except (ValueError, ModelLoadError) as e:
        sys.exit(f"h2o-chat: {e}")
    show_requests(args.quiet)
    saved_kv.BUDGET = disk_budget  # every conversation's saved caches share it
    from ..chat.batch import Batcher
    # the UI and the API share it; the decode step starts eager and is compiled in the background (--compile).
    # One, even for --concurrency 1: its thread is then the only one that runs the model, where each gradio
    # worker that decoded kept a team of intra-op threads (models/threads.py; /v1 fell from ~50 to ~35 tokens/s)
    batcher = Batcher(model, args.concurrency, compile=args.compile, data_dir=args.data_dir, threads=threads)
    from .api import create_router
    api = create_router(model, tokenizer, cache, args.data_dir, api_key=args.api_key, concurrency=args.concurrency,
                        closed=auth is not None and not args.api_key, max_kv_mib=args.api_kv_mib, batcher=batcher,
                        max_prompt_tokens=args.max_prompt_tokens, compile=args.compile)
    # the page lists the API's live conversations and can watch one (ui/ never imports serve/: it is handed this)
    demo = build(model, tokenizer, cache, args.data_dir, concurrency=args.concurrency, batcher=batcher,
                 watchable=api.pool.watchable, compile=args.compile)
    demo.queue(default_concurrency_limit=args.concurrency)
    login = page_login(auth, args.api_key)
    message = "Any user name, and the server's API key as the password." if callable(login) else None
    # every network setting explicit, so no GRADIO_* environment variable can widen them; server-side
    # rendering would start a Node server that listens where GRADIO_SERVER_NAME says, not --host
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, auth=login, auth_message=message,
                    css=CSS, head=HEAD, show_error=True, ssr_mode=False, app_kwargs={"routes": api.routes})  # /v1 beside
    except OSError as e:  # taken while the model loaded
        sys.exit(f"h2o-chat: {port_taken(args.host, args.port, e)}")


if __name__ == "__main__":
    main()
