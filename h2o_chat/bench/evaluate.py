"""Quality evaluations: `python -m h2o_chat.bench.evaluate SUBCOMMAND` (installed: `h2o-chat-eval`).

    ppl   streaming perplexity of a long text, the same tokens through each cache policy at
          several budgets (fractions of the span): full, window, sink (StreamingLLM), h2o with
          each score mode; lists of --n-sink, --n-recent and --positions sweep those knobs. Then
          a long part: --long-tokens (past the model's context) at one budget, ppl per segment
          of --segment tokens; the full cache is scored only within the trained positions.
    summarize  the paper's XSUM-style task from a jsonl of requests (article = the whole prompt,
          summary_gt, max_tokens, temperature, stop: the H2O authors' summarization files):
          ROUGE-1/2/L of full vs h2o, window and sink at budgets that are fractions of each prompt
    compress  one context cut to a fraction of its length by each method, then the perplexity
          of the tokens that follow over the compressed cache: ours (h2o with each score mode,
          sink, window) against kvpress's presses, run in their own venv (--kvpress-python)

Each subcommand is the module of that name; this file is the command line only (its shared
options and helpers are cli.py's).
"""

import argparse
import sys

from . import compress, head_budgets, memory, ppl, summarize, template_ppl
from .cli import add_quick, apply_quick, base_parser, cache_flag, name_list, quantization_flag
from .common import SHAKESPEARE
from .peers import kvpress, openvino


def numbers(text):
    """'0.1,0.2,0.5' -> [0.1, 0.2, 0.5] (fractions), '410,820' -> [410, 820] (counts), 'auto' -> [None]."""
    return [None if x == "auto" else float(x) if "." in x else int(x) for x in text.split(",")]


def head_budget_list(text):
    """'library,ada-kv' -> ['library', 'ada-kv'], each one of head_budgets.SHARED_BY."""
    values = name_list(text)
    unknown = [v for v in values if v not in head_budgets.SHARED_BY]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown head budget {unknown[0]!r}; use {', '.join(head_budgets.SHARED_BY)}")
    return values


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, shared = base_parser("python -m h2o_chat.bench.evaluate", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ppl", parents=[shared], help="streaming perplexity per policy and budget, then past the model's context")
    p.add_argument("--text", default=str(SHAKESPEARE), help="any UTF-8 text file")
    p.add_argument("--tokens", type=int, default=4096, help="the span streamed at each budget")
    # budgets as the paper gives them, fractions of the text (a sweep), where the library's is one chat's slot count
    cache_flag(p, "budget", "--budgets", "--budget", sweep=numbers, default=[0.1, 0.2, 0.5],
               note="fractions of --tokens (0.1,0.2,0.5) or counts (410,820); a list sweeps it")
    p.add_argument("--memory", type=memory.memory_points, default=None,
                   help="instead of --budgets: fractions of the full cache's KV bytes (0.1,0.2), a full cache at the "
                        "model's width holding the tokens streamed; each --kv-quant width gets the most slots whose "
                        "bytes fit, a slot's bytes measured (int8 codes plus float16 scales and zero points: 1.88x "
                        "the slots of bf16 at head_dim 64)")
    cache_flag(p, "n_sink", sweep=numbers, note="a list sweeps it (0,4,8)")
    cache_flag(p, "n_recent", sweep=numbers, note="fractions of the budget (0.25,0.5,0.75), counts, or auto "
               "(None); the heavy hitters get the rest; a list sweeps it")
    cache_flag(p, "positions", sweep=name_list, note="rolling, absolute or both")
    cache_flag(p, "budget_shape", sweep=name_list, note="uniform, pyramid or both (at the same total)")
    cache_flag(p, "kv_quant", sweep=name_list, note="none, int8 or both (none,int8): each a run")
    p.add_argument("--head-budget", type=head_budget_list, default=["library"],
                   help="library (H2OCache), per-head (the bench's head-budget cache with every head its budget: "
                        "must give library's ppl) or ada-kv (the same cache, each layer's kv_heads x budget slots "
                        "shared by its heads' highest scores); a list sweeps it; bench/head_budgets.py")
    # 16, not the library's 256: the caches here stream the text and should evict almost token by
    # token, as in the paper; 256 is the chunk that makes one long prompt's prefill fast
    cache_flag(p, "prefill_chunk", "--chunk", default=16, note="the caches evict every this many tokens")
    p.add_argument("--feed", type=int, default=512, help="tokens per model call (the figures do not depend on it)")
    p.add_argument("--methods", type=name_list, default=ppl.PPL_METHODS)
    p.add_argument("--long-tokens", type=int, default=20480, help="the long part's length (0: skip it)")
    cache_flag(p, "budget", "--long-budget", note="the long part's")
    p.add_argument("--long-methods", type=name_list, default=ppl.LONG_METHODS)
    p.add_argument("--segment", type=int, default=2048, help="the long part's ppl is reported per this many tokens")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CPUs with native bf16, else fp32), float32, bfloat16")
    quantization_flag(p, many=True)
    add_quick(p, tokens=384, long_tokens=768, long_budget=64, segment=192)  # about 2 minutes on the embedded model
    p.set_defaults(run=ppl.run)

    p = sub.add_parser("summarize", parents=[shared], help="XSUM-style summaries (the H2O authors' jsonl format), ROUGE per budget")
    p.add_argument("--file", required=True, help="jsonl: article (the whole prompt), summary_gt, max_tokens, "
                                                 "temperature, stop (and top_p)")
    p.add_argument("--fractions", type=numbers, default=[0.1, 0.2, 0.5], help="budgets as fractions of each prompt")
    p.add_argument("--memory", type=memory.memory_points, default=None,
                   help="instead of --fractions: fractions of the full cache's KV bytes for each prompt (0.1,0.2,0.5); "
                        "each arm keeps the most slots whose bytes fit, a slot's bytes measured (the model's width, "
                        "or int8 codes plus float16 scales and zero points for a method named with ':int8'); "
                        "decoding becomes greedy")
    p.add_argument("--methods", type=name_list, default=summarize.SUMMARIZE_METHODS,
                   help="full, h2o, window, sink; ':int8' after one stores its slots as int8 (h2o:int8)")
    p.add_argument("--openvino", nargs="?", const="", default=None, metavar="PYTHON",
                   help="also OpenVINO GenAI on the embedded GGUF file, with nothing evicted and with its cache "
                        f"eviction (its venv's python; alone: ${openvino.ENV_VAR} or {openvino.DEFAULT_PYTHON}); its "
                        f"KV cache stored {openvino.KV_PRECISION} (its CPU default), a token's bytes measured, its "
                        f"budget whole blocks of {openvino.BLOCK} tokens; requests too short for 3 blocks at the "
                        "smallest point are skipped for every arm")
    p.add_argument("--openvino-modes", type=name_list, default=["SUM", "NORM_SUM"],
                   help="OpenVINO's AggregationMode per arm (SUM, NORM_SUM; ADAPTIVE_RKV fails on the GGUF: see "
                        "docs/peers-at-equal-memory.md)")
    p.add_argument("--threads", type=int, default=None, help="OpenVINO's inference threads (default: torch's)")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N requests (held out from earlier runs)")
    cache_flag(p, "n_sink")
    cache_flag(p, "prefill_chunk", "--chunk", note="the prompt is prefilled (and evicted) this many tokens at a time")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests (after --skip and the "
                                                                  "ones too short for OpenVINO)")
    p.add_argument("--max-tokens", type=int, default=None, help="at most this many new tokens (each request's max_tokens)")
    p.add_argument("--temperature", type=float, default=None, help="instead of each request's (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i, the same for every method")
    add_quick(p, limit=3, max_tokens=24)
    p.set_defaults(run=summarize.run)

    p = sub.add_parser("compress", parents=[shared], help="one context compressed by each method, ppl of what follows")
    p.add_argument("--text", default=str(SHAKESPEARE))
    p.add_argument("--context", type=int, default=3584, help="tokens compressed")
    p.add_argument("--continuation", type=int, default=512, help="tokens scored after it")
    p.add_argument("--keep", type=lambda s: [float(x) for x in s.split(",")], default=[0.2],
                   help="fractions of the context kept, e.g. 0.1,0.2,0.5 (every arm the same slots)")
    p.add_argument("--memory", type=memory.memory_points, default=None,
                   help="instead of --keep: fractions of the full cache's KV bytes for the context, e.g. 0.1,0.2,0.5; "
                        "each arm keeps the most slots whose bytes fit, a slot's bytes measured on the model (a "
                        "cache of that width fed a few tokens, its kv_bytes() divided by them): the model's width "
                        "for our methods and kvpress's presses (DynamicCache), int8 codes plus float16 scales and "
                        "zero points for a method named with ':int8' (h2o-sum:int8)")
    cache_flag(p, "n_sink")
    cache_flag(p, "prefill_chunk", "--chunk", note="our caches prefill (and evict) this many tokens at a time")
    p.add_argument("--methods", type=name_list, default=compress.COMPRESS_METHODS)
    p.add_argument("--presses", type=name_list, default=list(compress.KVPRESS_PRESSES),
                   help="kvpress arms: these names, or the class name of any kvpress ScorerPress")
    p.add_argument("--kvpress-python", default=None, help=f"python of the kvpress venv (or ${kvpress.ENV_VAR})")
    add_quick(p, context=384, continuation=64)  # seconds on the tiny test model, about a minute on the embedded one
    p.set_defaults(run=compress.run)

    p = sub.add_parser("template-ppl", parents=[shared], help="streaming ppl of a story run's chats, h2o with the "
                                                              "chat template's tokens kept (keep_template) and without")
    p.add_argument("--stories", required=True, help="story_turns.json of a `bench story` run")
    p.add_argument("--arm", default="full", help="whose replies make the chats (full: written with nothing evicted)")
    p.add_argument("--chats", type=int, default=None, help="only the first N stories")
    p.add_argument("--budgets", type=numbers, default=[0.1, 0.2], help="fractions of each chat's tokens")
    p.add_argument("--n-recent", type=lambda s: numbers(s)[0], default=None,
                   help="the recent window as a fraction of the budget (default auto: half of what the sinks leave)")
    cache_flag(p, "prefill_chunk", "--chunk", default=16, note="the caches evict every this many tokens")
    p.add_argument("--feed", type=int, default=512, help="tokens per model call (the figures do not depend on it)")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(run=template_ppl.run)

    args = parser.parse_args(argv)
    apply_quick(args, argv)
    args.command_line = "python -m h2o_chat.bench.evaluate " + " ".join(argv)
    args.run(args)


if __name__ == "__main__":
    main()
