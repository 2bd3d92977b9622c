"""Quality evaluations: `python -m h2o_chat.evaluate SUBCOMMAND`.

    ppl   streaming perplexity of a long text, the same tokens through each cache policy at the
          same budget: full, window, sink (StreamingLLM), h2o with each score mode

The text is fed in chunks of --chunk tokens (1 is strict token-by-token streaming; larger is
faster, and the cache then holds up to budget + chunk - 1 tokens while a chunk is attended).
"""

import math
import sys
import time

import torch
from tqdm import tqdm

from .bench import DATA_DIR, base_parser, make_cache, text_tokens, write_results
from .model import load_model

PPL_METHODS = ["full", "window", "sink", "h2o-sum", "h2o-mean", "h2o-decay"]


@torch.no_grad()
def streaming_nll(model, tokens, cache, chunk):
    """Mean negative log-likelihood of tokens[1:] given everything before, fed chunk by chunk."""
    total, count = 0.0, 0
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for s in tqdm(range(0, inputs.shape[1], chunk), leave=False, desc="tokens", unit_scale=chunk):
        logits = model(inputs[:, s : s + chunk], cache=cache).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], targets[0, s : s + chunk], reduction="sum")
        total, count = total + nll.item(), count + logits.shape[1]
    return total / count


def cmd_ppl(args):
    model, tokenizer = load_model(args.model)
    tokens = text_tokens(tokenizer, args.text, args.tokens)
    rows = []
    for method in args.methods:
        cache = make_cache(model, method, budget=args.budget, n_sink=args.n_sink, positions=args.positions,
                           prefill_chunk=args.chunk)
        start = time.perf_counter()
        nll = streaming_nll(model, tokens, cache, args.chunk)
        rows.append({"method": method, "budget": "all" if method == "full" else args.budget,
                     "ppl": round(math.exp(nll), 3), "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    full = next((r["ppl"] for r in rows if r["method"] == "full"), None)
    for r in rows:
        r["vs_full"] = f"{(r['ppl'] / full - 1) * 100:+.1f}%" if full else ""
    meta = {"command": "python -m h2o_chat.evaluate " + " ".join(args.argv), "tokens": args.tokens,
            "chunk": args.chunk, "n_sink": args.n_sink, "positions": args.positions}
    write_results(args.out, "ppl", rows, ["method", "budget", "ppl", "vs_full", "seconds"], meta)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = base_parser("python -m h2o_chat.evaluate", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ppl", help="streaming perplexity per policy at one budget")
    p.add_argument("--text", default=str(DATA_DIR / "tinyshakespeare.txt"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=820, help="slots per layer and head (820 = 20%% of 4096)")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--positions", default="rolling", choices=["absolute", "rolling"])
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--methods", type=lambda s: s.split(","), default=PPL_METHODS)
    p.set_defaults(run=cmd_ppl)
    args = parser.parse_args(argv)
    args.argv = argv
    args.run(args)


if __name__ == "__main__":
    main()
