"""Speed and memory benchmarks: `python -m h2o_chat.bench SUBCOMMAND` (installed: `h2o-chat-bench`).

    dialogue one long chat over the user turns of a jsonl file: per turn time to first token,
             decode tokens/s, KV bytes and RSS for ChatSession with H2O (and with the full
             cache), against a naive app that re-prefills the whole history every turn, and
             against kvpress (its H2O-like ObservedAttentionPress, re-prefilling the history
             each turn at the same budget; run in its own venv, --kvpress-python)
    decode   time per generated token and KV bytes after N tokens seen, for DynamicCache and
             H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict)
    ops      aten ops and host syncs per decode token (the profiler)
    batch    the paper's batch throughput setting (CUDA)
    prefill  peak memory (RSS) of prefilling a long prompt, each method in a fresh process
    prefill-speed  prefill tokens/s (interleaved repeats, medians), aten ops per token and bytes
             allocated, h2o against DynamicCache, per dtype and prompt length
    panel    what the live panel costs: render time of a long conversation's panel, and decode
             tokens/s with the panel refreshed as the app does while streaming vs not at all
    soak     one session over many turns: memory, speed, reply quality
    concurrent  1, 2, 4, 8 chats at once through the API (decoded in one batch) against the
             same chats one at a time: aggregate and per-chat tokens/s, TTFT
    story    a 36-turn role-play story through /v1 as SillyTavern sends it (default samplers),
             the app's cache against the full one (and sink): prompt reuse per turn, TTFT,
             degenerate replies and stories with their 95% intervals
    reopen   stories of 2,000 / 10,000 / 35,000 tokens reopened from their saved cache (fresh
             processes) against replayed; disk and write time per reply; Open WebUI's older branch
             resent through /v1, with saved caches and without
    decode-peers  decode tokens/s after a ~1,000-token held-out history: the app's path against
             llama.cpp's server and OpenVINO GenAI (its H2O-style eviction on, and off) on the
             same GGUF and token ids, each arm a fresh process per round
    gpu      the compiled decode step (CUDA graphs) against eager and DynamicCache at batch 1 and 8,
             the embedded model and a 1B-class Q4_0 GGUF; a check that compiled == eager
    user-gguf  a Llama-3.2-1B-shaped random GGUF (Q4_0, Q4_K_M, ...) loaded at its own width against
             dequantized (peak RSS, decode tokens/s, each in a fresh process) and beside llama.cpp

Each subcommand is the module of that name (prefill-speed: prefill_speed.py). Every figure comes
from running the model here; results go to --out as JSON and Markdown.

This file is the command line only; evaluate.py's (quality) takes the same shared options.
"""

import argparse
import sys
from dataclasses import fields

from ..cache.config import CacheConfig
from ..serve.cli import add_setting_flag
from . import (
    batch,
    concurrent,
    decode,
    decode_peers,
    dialogue,
    gpu,
    ops,
    panel,
    prefill,
    prefill_speed,
    reopen,
    soak,
    story,
    user_gguf,
)
from .common import MT_BENCH, SHAKESPEARE
from .peers import kvpress, llamacpp, openvino

CACHE_SETTINGS = {f.name: f for f in fields(CacheConfig)}


def int_list(text):
    return [int(x) for x in text.split(",")]


def name_list(text):
    return text.split(",")


def seed_list(text):
    """"0,1,2" or a range "0-19" (both ends in)."""
    first, dash, last = text.partition("-")
    return list(range(int(first), int(last) + 1)) if dash and first else int_list(text)


def choice_list(what, choices):
    """The parser of a comma-separated list of `choices` (an unknown one named in the error)."""

    def parse(text):
        names = name_list(text)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown[0]!r}; the {what}s are {', '.join(choices)}")
        return names

    return parse


arm_list = choice_list("arm", story.ARMS)
model_list = choice_list("model", gpu.MODELS)


def cache_flag(parser, name, *flags, sweep=None, **kwargs):
    """The flag of CacheConfig's setting `name` (serve.cli.add_setting_flag). sweep: the parser of a
    comma-separated list, each value a run (the default is then [the library's])."""
    setting = CACHE_SETTINGS[name]
    if sweep:
        kwargs = {"type": sweep, "choices": None, "default": [setting.default], **kwargs}
    add_setting_flag(parser, setting, *flags, **kwargs)


def quantization_flag(parser, many=False):
    """--quantization: load_model's values (serve.cli's help); many: a comma-separated list, one arm each."""
    from ..models.load import QUANTIZATIONS
    from ..serve.cli import QUANTIZATION_HELP, add_quantization_flag

    if not many:
        return add_quantization_flag(parser)

    def quantizations(text):
        values = text.split(",")
        unknown = [v for v in values if v not in QUANTIZATIONS]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown quantization {unknown[0]!r}; use {', '.join(QUANTIZATIONS)}")
        return values

    parser.add_argument("--quantization", type=quantizations, default=["auto"],
                        help="the weights, a comma-separated list (one arm each, e.g. none,int8,auto): " + QUANTIZATION_HELP)


def add_quick(parser, **small):
    """--quick: these smaller settings, wherever the command line did not set them."""
    parser.add_argument("--quick", action="store_true", help="a short run: " + ", ".join(f"{k}={v}" for k, v in small.items()))
    parser.set_defaults(quick_settings=small)


def apply_quick(args, argv):
    if getattr(args, "quick", False):
        for name, value in args.quick_settings.items():
            flag = "--" + name.replace("_", "-")
            if not any(a == flag or a.startswith(flag + "=") for a in argv):
                setattr(args, name, value)


def base_parser(prog, doc, shared=()):
    """The top-level parser, and the parent every subcommand takes, for the options all commands share.

    A shared option is accepted before the subcommand (`--out DIR dialogue`) and after it (`dialogue
    --out DIR`, where users type it). The parent's copies default to SUPPRESS, so a subcommand that was
    not given the option leaves the top-level value (or its default) in place.
    shared: more (flags, argparse keywords) pairs, beside --model and --out.
    """
    options = [(("--model",), dict(default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")),
               (("--out",), dict(default="bench-out", help="folder for JSON and Markdown results")), *shared]
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parent = argparse.ArgumentParser(add_help=False)
    for flags, kwargs in options:
        parser.add_argument(*flags, **kwargs)
        parent.add_argument(*flags, **{**kwargs, "default": argparse.SUPPRESS})
    return parser, parent


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = (("--text",), dict(default=str(SHAKESPEARE), help="text the prompts are cut from"))
    parser, shared = base_parser("python -m h2o_chat.bench", __doc__, [text])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dialogue", parents=[shared], help="a long multi-turn chat, per-turn latency")
    p.add_argument("--turns-file", default=str(MT_BENCH))
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--new-tokens", type=int, default=64)
    cache_flag(p, "budget")
    p.add_argument("--methods", type=name_list, default=["h2o", "naive", "kvpress", "full"],
                   help="h2o, full (ChatSession), naive and kvpress; naive and kvpress are timed on the first "
                        "method's transcript")
    p.add_argument("--naive-every", type=int, default=10,
                   help="time the naive app and kvpress at turn 1 and every N turns (they re-read the whole history)")
    p.add_argument("--kvpress-python", default=None,
                   help=f"python of the kvpress venv (or ${kvpress.ENV_VAR}); without one the kvpress arm is skipped")
    p.add_argument("--llamacpp", nargs="?", const="", default=None, metavar="PYTHON",
                   help="h2o against llama.cpp's server (xllamacpp, in its own venv: PYTHON, $"
                        f"{llamacpp.ENV_VAR} or {llamacpp.DEFAULT_PYTHON}), interleaved turn by turn")
    p.add_argument("--repeats", type=int, default=1, help="with --llamacpp: chats run, medians reported")
    p.add_argument("--llamacpp-ctx", type=int, default=None,
                   help="with --llamacpp: the server's context (default: the model's trained positions, 8,192 for "
                        "the embedded model); a small one reaches the limit in a few turns")
    p.add_argument("--dtype", default="auto", help="h2o's model dtype: auto (bf16 on CPUs with native bf16), float32")
    quantization_flag(p)
    add_quick(p, turns=6, new_tokens=16, naive_every=2)
    p.set_defaults(run=dialogue.run)

    p = sub.add_parser("decode", parents=[shared], help="decode time per token vs tokens seen")
    p.add_argument("--seen", type=int_list, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per method (median reported)")
    cache_flag(p, "budget")
    p.add_argument("--methods", type=name_list, default=["full", "h2o"],
                   help="full, h2o, dynamic (transformers' DynamicCache), h2o-noevict (budget never reached); :int8 for int8 KV (h2o:int8); "
                        "a +lean suffix (h2o+lean) decodes through models/decode.py's lean step, as the app does")
    p.add_argument("--dtype", default="auto")
    quantization_flag(p, many=True)
    p.add_argument("--native", type=name_list, default=["on"],
                   help="on, off or on,off: the C kernels (native/) or torch's ops (H2O_CHAT_NATIVE=0) for each "
                        "arm; both arms alternate in one process")
    add_quick(p, seen=[512, 2048], steps=8, repeats=1)
    p.set_defaults(run=decode.run)

    p = sub.add_parser("decode-peers", parents=[shared], help="decode tokens/s after a held-out history: h2o vs "
                       "llama.cpp vs OpenVINO GenAI (eviction on and off)")
    p.add_argument("--history", type=int, default=1000, help="tokens of --text in the history (plus the template's)")
    p.add_argument("--new-tokens", type=int, default=128)
    cache_flag(p, "budget")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every arm, the order rotating (medians reported)")
    p.add_argument("--threads", type=int, default=None, help="threads of every arm (default: torch's)")
    p.add_argument("--dtype", default="auto", help="h2o's model dtype")
    quantization_flag(p)
    p.add_argument("--llamacpp", nargs="?", const="", default=None, metavar="PYTHON",
                   help=f"also llama.cpp's server (xllamacpp venv: PYTHON, ${llamacpp.ENV_VAR} or {llamacpp.DEFAULT_PYTHON})")
    p.add_argument("--openvino", nargs="?", const="", default=None, metavar="PYTHON",
                   help=f"also OpenVINO GenAI, eviction on and off (openvino-genai venv: PYTHON, ${openvino.ENV_VAR} or "
                        f"{openvino.DEFAULT_PYTHON})")
    p.add_argument("--openvino-start", type=int, default=32, help="OpenVINO's start area, never evicted (tokens)")
    p.add_argument("--openvino-recent", type=int, default=224,
                   help="OpenVINO's recent area, never evicted (tokens); the evictable area is the budget's rest")
    add_quick(p, history=300, new_tokens=16, repeats=1)
    p.set_defaults(run=decode_peers.run)

    p = sub.add_parser("ops", parents=[shared], help="aten ops and host syncs per decode token (profiler)")
    p.add_argument("--seen", type=int, default=600)
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps")
    cache_flag(p, "budget")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", type=name_list, default=["dynamic", "h2o", "full", "h2o+lean", "full+lean"],
                   help="as decode's --methods; the +lean ones are what the app runs")
    quantization_flag(p, many=True)
    p.set_defaults(run=ops.run)

    p = sub.add_parser("batch", parents=[shared], help="the paper's batch throughput setting (CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama2-7b", choices=["llama2-7b", "tiny"])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.2, help="h2o budget as a share of prompt + generated")
    p.add_argument("--batch", type=int, default=8, help="the batch size both methods are timed at")
    p.add_argument("--max-batch", type=int, default=1024)
    add_quick(p, prompt=512, new_tokens=128, max_batch=32)
    p.set_defaults(run=batch.run)

    p = sub.add_parser("prefill", parents=[shared], help="peak memory of prefilling a long prompt")
    p.add_argument("--tokens", type=int, default=4096)
    cache_flag(p, "budget")
    add_quick(p, tokens=1024)
    p.set_defaults(run=prefill.run)

    p = sub.add_parser("prefill-speed", parents=[shared], help="prefill tokens/s, ops and bytes allocated: h2o vs DynamicCache")
    p.add_argument("--tokens", type=int_list, default=[512, 2048])
    p.add_argument("--dtypes", type=name_list, default=["float32", "bfloat16"])
    cache_flag(p, "budget")
    cache_flag(p, "prefill_chunk", "--chunk")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per method (median reported)")
    p.add_argument("--no-counts", dest="counts", action="store_false", help="skip the profiled run")
    quantization_flag(p, many=True)
    add_quick(p, tokens=[512], repeats=1)
    p.set_defaults(run=prefill_speed.run)

    p = sub.add_parser("panel", parents=[shared], help="the live panel's cost")
    p.add_argument("--tokens", type=int, default=20_000, help="length of the conversation whose panel is rendered")
    p.add_argument("--new-tokens", type=int, default=96)
    cache_flag(p, "budget")
    p.add_argument("--turns", type=int, default=5, help="replies streamed into the page (chromium; 0: none)")
    p.add_argument("--app-dir", default=None, help="run the page's app from this checkout (e.g. a git worktree of "
                   "an older commit: run both, alternating, to compare)")
    add_quick(p, tokens=2000, new_tokens=32, turns=2)
    p.set_defaults(run=panel.run)

    p = sub.add_parser("soak", parents=[shared], help="one session over many turns: memory, speed, reply quality")
    p.add_argument("--turns-file", default=str(MT_BENCH))
    p.add_argument("--turns", type=int, default=160)
    p.add_argument("--new-tokens", type=int, default=64)
    cache_flag(p, "budget")
    cache_flag(p, "positions")
    p.add_argument("--seed", type=int, default=0)
    add_quick(p, turns=8, new_tokens=16)
    p.set_defaults(run=soak.run)

    p = sub.add_parser("concurrent", parents=[shared], help="N chats at once through the API (one batch) vs one at a time")
    p.add_argument("--sizes", type=int_list, default=[1, 2, 4, 8])
    p.add_argument("--turns-file", default=str(MT_BENCH))
    p.add_argument("--turns", type=int, default=2, help="turns of each chat")
    p.add_argument("--max-tokens", type=int, default=64)
    cache_flag(p, "budget")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of each server")
    p.add_argument("--h2o-args", default="", help="more app.py flags for both servers, e.g. '--dtype float32'")
    p.add_argument("--repeats", type=int, default=3, help="runs of both arms per size (medians reported)")
    add_quick(p, sizes=[1, 2], turns=1, max_tokens=8, repeats=1)
    p.set_defaults(run=concurrent.run)

    p = sub.add_parser("story", parents=[shared], help="a SillyTavern-shaped story through /v1: reuse, TTFT, "
                                                         "degenerate replies")
    p.add_argument("--turns", type=int, default=36)
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="one story per seed and arm: 0,1,2 or 0-19")
    p.add_argument("--policies", type=arm_list, default=["h2o", "full"],
                   help="the arms: h2o, the app's cache (its flags); full, the same requests with h2o.policy full; "
                        "sink, with h2o.policy sink (StreamingLLM) at the same budget")
    p.add_argument("--max-tokens", type=int, default=300, help="SillyTavern's default reply length")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the server")
    p.add_argument("--h2o-args", default="", help="more app.py flags, e.g. '--budget 512 --dtype float32'")
    p.add_argument("--app-dir", default=None, help="run the app from this checkout (e.g. a worktree of an "
                   "older commit: the same client before and after a change)")
    p.add_argument("--samplers", default="{}", help="JSON of request fields over SillyTavern's defaults, "
                   "e.g. '{\"top_p\": 0.9}'")
    p.add_argument("--parallel", action="store_true", help="run every story at once (decoded in one batch; "
                   "TTFT then includes waiting for the others)")
    add_quick(p, turns=6, seeds=[0], max_tokens=48)
    p.set_defaults(run=story.run)
    p = sub.add_parser("reopen", parents=[shared], help="a long story reopened from its saved cache vs replayed; "
                                                          "write cost per reply; an older branch through /v1")
    p.add_argument("--lengths", type=int_list, default=[2000, 10000, 35000], help="story lengths in tokens")
    cache_flag(p, "budget")
    p.add_argument("--dtype", default="auto")
    quantization_flag(p)
    p.add_argument("--replies", type=int, default=6, help="replies of the chat whose saving is timed")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per reply of that chat")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply of the /v1 requests")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the /v1 server")
    p.add_argument("--skip-v1", action="store_true", help="leave out the /v1 older-branch part")
    p.add_argument("--no-page", dest="page", action="store_false", help="leave out the page's restore and reload "
                   "(Debian's chromium; left out by itself without it)")
    add_quick(p, lengths=[300, 1000], replies=2, new_tokens=8, max_tokens=8)
    p.set_defaults(run=reopen.run)

    p = sub.add_parser("user-gguf", parents=[shared], help="a 1B-class GGUF at its own width vs dequantized vs llama.cpp")
    p.add_argument("--file", default=None, help="a GGUF file (default: write a random one into --out)")
    p.add_argument("--shape", default="llama-1b", choices=sorted(user_gguf.SHAPES), help="the random file's shape")
    p.add_argument("--block-type", default="Q4_0", help="the random file's linear weights (Q4_0, Q4_1, Q8_0, Q5_0, "
                   "Q5_1, Q4_K, Q5_K, Q6_K, F16) or llama.cpp's mix Q4_K_M / Q5_K_M")
    quantization_flag(p, many=True)
    p.set_defaults(quantization=["auto", "none"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs of every arm, interleaved (medians reported)")
    p.add_argument("--threads", type=int, default=None, help="threads of every arm (default: torch's)")
    p.add_argument("--llamacpp", nargs="?", const="", default=None, metavar="PYTHON",
                   help=f"also llama.cpp's server on the file (xllamacpp venv: PYTHON, ${llamacpp.ENV_VAR} or "
                        f"{llamacpp.DEFAULT_PYTHON})")
    add_quick(p, new_tokens=16, repeats=1)
    p.set_defaults(run=user_gguf.run)

    p = sub.add_parser("gpu", parents=[shared], help="the compiled step (CUDA graphs) against eager and DynamicCache, "
                                                      "batch 1 and 8; compiled == eager")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs it here without CUDA graphs")
    p.add_argument("--models", type=model_list, default=["embedded", "llama-1b"],
                   help=f"of {', '.join(gpu.MODELS)}: the embedded model, user-gguf's random 1B-class Q4_0 file, a "
                        "tiny random Q4_0 file (written into --out)")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="conversations decoded at once")
    cache_flag(p, "budget")
    p.add_argument("--seen", type=int, default=600, help="tokens each conversation has seen before the timed steps")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per arm, interleaved (median reported)")
    p.add_argument("--dtype", default="auto", help="the timed arms' dtype (the check runs in float32)")
    p.add_argument("--check-tokens", type=int, default=300, help="tokens of the compiled == eager check")
    p.add_argument("--atol", type=float, default=1e-5, help="the check's tolerance on the logits (float32)")
    p.add_argument("--compile-timeout", type=float, default=240, help="seconds a shape may take to compile")
    add_quick(p, models=["tiny"], batches=[1, 2], budget=32, seen=40, steps=8, repeats=1, check_tokens=60)
    p.set_defaults(run=gpu.run)

    args = parser.parse_args(argv)
    apply_quick(args, argv)
    args.command_line = "python -m h2o_chat.bench " + " ".join(argv)  # what the results say made them
    args.run(args)
