"""`python -m h2o_chat.bench decode`: time per generated token and KV bytes after N tokens seen,
for DynamicCache and H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict),
through transformers' forward or the app's lean step ('+lean').

Each method prefills once per length; then timed windows of decode steps alternate between the
methods, so machine noise hits them alike. The median window is reported.
"""

import statistics
import time

import torch
from tqdm import tqdm

from ..models.decode import Decoder
from ..models.load import load_model
from .common import LEAN, kv_bytes, make_cache, text_tokens, write_plot, write_results


def decode_step(model, method):
    """`step(token [batch, 1], cache) -> next greedy token [batch, 1]` for `method`: the model's own
    forward, or for a '+lean' method ('h2o+lean') models/decode.py's lean step, what the app runs."""
    if method.endswith(LEAN):
        decoder = Decoder(model)
        if decoder.why_not:
            raise SystemExit(f"bench: {method}: the lean step cannot run this model ({decoder.why_not})")
        return lambda token, cache: decoder.forward(token, cache).argmax(-1, keepdim=True)
    return lambda token, cache: model(token, cache=cache).logits[:, -1:].argmax(-1)


@torch.no_grad()
def greedy_steps(step, token, cache, steps):
    """`steps` greedy decode steps (`decode_step`'s) from `token` [batch, 1]; the last token and seconds."""
    start = time.perf_counter()
    for _ in range(steps):
        token = step(token, cache)
    return token, time.perf_counter() - start


def run(args):
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    text = text_tokens(tokenizer, args.text, max(args.seen))
    rows = []
    for seen in tqdm(args.seen, desc="tokens seen"):
        caches, tokens, times = {}, {}, {m: [] for m in args.methods}
        steps = {m: decode_step(model, m) for m in args.methods}
        for m in args.methods:
            budget = seen + (args.repeats + 1) * args.steps + 2 if m == "h2o-noevict" else args.budget
            caches[m] = make_cache(model, "h2o" if m == "h2o-noevict" else m, budget=budget)
            with torch.no_grad():
                tokens[m] = model(text[:, :seen], cache=caches[m]).logits[:, -1:].argmax(-1)
            tokens[m], _ = greedy_steps(steps[m], tokens[m], caches[m], 1)  # warm-up step, untimed
        for _ in range(args.repeats):
            for m in args.methods:
                tokens[m], seconds = greedy_steps(steps[m], tokens[m], caches[m], args.steps)
                times[m].append(seconds / args.steps)
        base = statistics.median(times[args.methods[0]])
        for m in args.methods:
            t = statistics.median(times[m])
            rows.append({"seen": seen, "method": m, "ms_per_token": round(1000 * t, 2),
                         "tokens_per_s": round(1 / t, 2), f"vs_{args.methods[0]}": f"{base / t:.2f}x",
                         "kv_MiB": round(kv_bytes(caches[m]) / 2**20, 2)})
            print(rows[-1], flush=True)
        del caches
    meta = {"command": args.command_line, "budget": args.budget, "dtype": str(model.dtype),
            "steps": args.steps, "repeats": args.repeats, "threads": torch.get_num_threads()}
    write_results(args.out, "decode", rows, ["seen", "method", "ms_per_token", "tokens_per_s", f"vs_{args.methods[0]}",
                                             "kv_MiB"], meta)
    write_plot(args.out, "decode-speed", rows, "seen", "tokens_per_s", "method", "decode speed vs tokens seen")
    write_plot(args.out, "decode-memory", rows, "seen", "kv_MiB", "method", "KV cache size vs tokens seen")
