"""The app's command line: `h2o-chat` (installed) or `python app.py` (a checkout) parse flags here and
serve the chat UI with the OpenAI-compatible /v1 API beside it. `h2o-chat --help` for the flags."""

import argparse
import os
import sys
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
    kwargs = {"choices": meta["choices"]} if meta["choices"] else {"type": type(setting.default) if setting.default
                                                                    is not None else int}
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


def parse_args(argv=None):
    from ..cache.config import APP_FIELDS, CacheConfig
    from .pool import MAX_IDLE_KV_MIB

    p = argparse.ArgumentParser(description="A local chat whose KV cache is managed by H2O (Heavy-Hitter Oracle).")
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also make a public Gradio share link (off by default)")
    p.add_argument("--auth", default=None, metavar="USER:PASS", help="require this login for the UI and its API")
    for setting in fields(CacheConfig):
        if setting.name in APP_FIELDS:
            add_setting_flag(p, setting)
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
                        f"(default {DEFAULT_CONCURRENCY}; 1 generates one reply at a time, without a batch)")
    p.add_argument("--api-key", default=os.environ.get("H2O_CHAT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on the /v1 API (default: $H2O_CHAT_API_KEY; with "
                        "--auth and no key the API refuses every request)")
    p.add_argument("--api-kv-mib", type=float, default=MAX_IDLE_KV_MIB,
                   help=f"KV memory of the API's idle conversations (default {MAX_IDLE_KV_MIB})")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from ..cache.config import APP_FIELDS, CacheConfig
    from ..models.load import ModelLoadError, load_model
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
        model, tokenizer = load_model(args.model, dtype=args.dtype, quantization=quantization,
                                      device_map=args.device_map, trust_remote_code=args.trust_remote_code)
    except (ValueError, ModelLoadError) as e:
        sys.exit(f"h2o-chat: {e}")
    from ..chat.batch import Batcher
    batcher = Batcher(model, args.concurrency) if args.concurrency > 1 else None  # the UI and the API share it
    demo = build(model, tokenizer, cache, args.data_dir, concurrency=args.concurrency, batcher=batcher)
    demo.queue(default_concurrency_limit=args.concurrency)
    from .api import create_router
    api = create_router(model, tokenizer, cache, args.data_dir, api_key=args.api_key, concurrency=args.concurrency,
                        closed=auth is not None and not args.api_key, max_kv_mib=args.api_kv_mib, batcher=batcher)
    # every network setting explicit, so no GRADIO_* environment variable can widen them; server-side
    # rendering would start a Node server that listens where GRADIO_SERVER_NAME says, not --host
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth, css=CSS, head=HEAD,
                show_error=True, ssr_mode=False, app_kwargs={"routes": api.routes})  # /v1 beside the UI


if __name__ == "__main__":
    main()
