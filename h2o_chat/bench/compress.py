"""`python -m h2o_chat.bench.evaluate compress`: one context cut to a fraction of its length by each
method, then the perplexity of the tokens that follow over the compressed cache: ours (h2o with
each score mode, sink, window) against kvpress's presses, run in their own venv (--kvpress-python).
Every method keeps the same number of slots per layer and KV head: the comparison is at equal memory.
"""

import math
import time

import torch
from transformers import DynamicCache

from ..models.load import load_model
from .common import kv_bytes, make_cache, text_tokens, write_plot, write_results
from .peers import kvpress

COMPRESS_METHODS = ["h2o-sum", "h2o-mean", "h2o-decay", "sink", "window"]
KVPRESS_PRESSES = {"kvpress-observed": "ObservedAttentionPress", "kvpress-snapkv": "SnapKVPress",
                   "kvpress-streamingllm": "StreamingLLMPress"}


def frozen_copy(cache):
    """A DynamicCache holding exactly the slots an H2OCache keeps now: per layer its keys and
    values [batch, kv_heads, slots, head_dim] (slot order means nothing to attention). It never
    evicts, so what runs next attends over these slots plus its own tokens, as it would over a
    kvpress-compressed cache."""
    return DynamicCache([layer.widened(cache.dtype) for layer in cache.layers])


@torch.no_grad()
def compressed_nll(model, context, continuation, cache):
    """Prefill context [1, n] into `cache` (an H2OCache, evicting as it goes), then the mean NLL
    of continuation[1:] given everything before: continuation [1, m + 1] is fed at its true
    positions n, n + 1, ... over the kept slots, with no further eviction.
    Returns (nll, slots kept per layer and head, KV bytes kept)."""
    model(context, cache=cache, logits_to_keep=1)
    slots, kv = cache.slots_used(), kv_bytes(cache)
    n, m = context.shape[1], continuation.shape[1] - 1
    # explicit positions: the frozen cache holds fewer than n tokens, so transformers would count
    # from its length. cache_position does count from there, which makes the mask bottom-right
    # causal: every kept slot is visible to every continuation token.
    position_ids = torch.arange(n, n + m, device=context.device)[None]
    logits = model(continuation[:, :-1], cache=frozen_copy(cache), position_ids=position_ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[0], continuation[0, 1:]).item(), slots, kv


def kvpress_rows(args, model, context, continuation):
    """The kvpress arms, run in the kvpress venv: (rows, versions), or ([], None) when skipped."""
    worker = kvpress.worker_for(args.kvpress_python, model)
    if worker is None:
        return [], None
    n = context.shape[1]
    arms = [(label, keep) for label in args.presses for keep in args.keep]
    tasks = [{"kind": "compress_nll", "press": KVPRESS_PRESSES.get(label, label), "kept": round(keep * n),
              "context_ids": context[0].tolist(), "continuation_ids": continuation[0].tolist()} for label, keep in arms]
    print(f"kvpress: {len(tasks)} runs in {worker[0]}", flush=True)
    result = kvpress.run_tasks(worker, model, tasks)
    rows = []
    for (label, keep), task, r in zip(arms, tasks, result["results"]):
        if not r["kept_min"] == r["kept_max"] == task["kept"]:  # the comparison is at equal memory or not at all
            raise RuntimeError(f"{label} kept {r['kept_min']}..{r['kept_max']} slots, {task['kept']} asked")
        rows.append(compress_row(label, keep, task["kept"], r["nll"], r["kv_bytes"], r["seconds"]))
    return rows, result["versions"]


def compress_row(method, keep, kept, nll, kv, seconds):
    row = {"method": method, "keep": keep, "kept": kept, "ppl": round(math.exp(nll), 3), "nll": round(nll, 4),
           "kv_MiB": round(kv / 2**20, 2), "seconds": round(seconds, 1)}
    print(row, flush=True)
    return row


def run(args):
    n, m = args.context, args.continuation
    model, tokenizer = load_model(args.model)
    tokens = text_tokens(tokenizer, args.text, n + m + 1)
    context, continuation = tokens[:, :n], tokens[:, n:]
    rows = []
    for method in ["full"] + args.methods:
        for keep in [1.0] if method == "full" else args.keep:
            kept = n if method == "full" else round(keep * n)
            # absolute positions: kept keys stay where they were written, as kvpress leaves them
            cache = make_cache(model, method, budget=kept, n_sink=args.n_sink, positions="absolute",
                               prefill_chunk=args.chunk)
            start = time.perf_counter()
            nll, slots, kv = compressed_nll(model, context, continuation, cache)
            rows.append(compress_row(method, keep, slots, nll, kv, time.perf_counter() - start))
    press_rows, versions = kvpress_rows(args, model, context, continuation)
    rows += press_rows
    full = rows[0]["ppl"]
    for r in rows:
        r["vs_full"] = f"{(r['ppl'] / full - 1) * 100:+.1f}%"
    meta = {"command": args.command_line, "context": n, "continuation": m,
            "n_sink": args.n_sink, "chunk": args.chunk, "positions": "absolute", "kvpress": versions,
            "note": "kept = slots per layer and KV head; ppl of the continuation over the compressed cache"}
    write_results(args.out, "compress", rows, ["method", "keep", "kept", "ppl", "vs_full", "kv_MiB", "seconds"], meta)
    # the full cache keeps everything: drawn as a flat reference line across the fractions
    points = [{**rows[0], "keep": keep} for keep in args.keep] + rows[1:]
    write_plot(args.out, "compress", points, "keep", "ppl", "method",
               f"{n} tokens compressed, then ppl of the next {m}", logy=True)
