"""`python -m h2o_chat.bench.evaluate compress`: one context cut to a fraction of its length by each
method, then the perplexity of the tokens that follow over the compressed cache: ours (h2o with
each score mode, sink, window) against kvpress's presses, run in their own venv (--kvpress-python).
With --keep every method keeps the same number of slots per layer and KV head (equal tokens).
With --memory the arms hold the same KV bytes instead: each memory point, a fraction of the bytes
the full cache holds for the context, buys each arm the slots its width affords (memory.py): a
method named with ':int8' (h2o-sum:int8) stores int8 slots, kvpress keeps the model's width.
Then a figure, compress-kv.svg: ppl against KV MiB, one line per method and width.
"""

import math
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..models.load import load_model
from . import memory
from .common import kv_bytes, make_cache, text_tokens, write_plot, write_results
from .peers import kvpress
from .svg import write_chart

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


def kvpress_rows(args, model, context, continuation, kept_at):
    """The kvpress arms, run in the kvpress venv: (rows, versions), or ([], None) when skipped.
    kept_at(width, point) -> the slots a point (a --keep or --memory value) gives a cache of width."""
    worker = kvpress.worker_for(args.kvpress_python, model)
    if worker is None:
        return [], None
    arms = [(label, point) for label in args.presses for point in points_of(args)]
    tasks = [{"kind": "compress_nll", "press": KVPRESS_PRESSES.get(label, label), "kept": kept_at("dynamic", point),
              "context_ids": context[0].tolist(), "continuation_ids": continuation[0].tolist()} for label, point in arms]
    print(f"kvpress: {len(tasks)} runs in {worker[0]}", flush=True)
    result = kvpress.run_tasks(worker, model, tasks)
    per_token = memory.bytes_per_token(model, "dynamic")
    rows = []
    for (label, point), task, r in zip(arms, tasks, result["results"]):
        if not r["kept_min"] == r["kept_max"] == task["kept"]:  # the comparison is at equal memory or not at all
            raise RuntimeError(f"{label} kept {r['kept_min']}..{r['kept_max']} slots, {task['kept']} asked")
        if r["kv_bytes"] != task["kept"] * per_token:  # kvpress's cache is the width we counted it at
            raise RuntimeError(f"{label} holds {r['kv_bytes']} bytes for {task['kept']} slots, not {per_token} a slot")
        rows.append(compress_row(label, point, task["kept"], r["nll"], r["kv_bytes"], r["seconds"]))
    return rows, result["versions"]


def points_of(args):
    """The comparison's points: --memory's fractions of the full cache's bytes, else --keep's of its tokens."""
    return args.memory or args.keep


def compress_row(method, point, kept, nll, kv, seconds):
    row = {"method": method, "point": point, "kept": kept, "ppl": round(math.exp(nll), 3), "nll": round(nll, 4),
           "kv_MiB": round(kv / 2**20, 2), "kv_bytes": kv, "seconds": round(seconds, 1)}
    print(row, flush=True)
    return row


def run(args):
    n, m = args.context, args.continuation
    model, tokenizer = load_model(args.model)
    tokens = text_tokens(tokenizer, args.text, n + m + 1)
    context, continuation = tokens[:, :n], tokens[:, n:]
    full_per_token = memory.bytes_per_token(model)
    per_token = {}

    def kept_at(width, point):
        if not args.memory:
            return round(point * n)
        if width not in per_token:
            per_token[width] = memory.bytes_per_token(model, width)
        return memory.slots_at(point, n, full_per_token, per_token[width])

    rows = []
    for method in ["full"] + args.methods:
        for point in [1.0] if method == "full" else points_of(args):
            kept = n if method == "full" else kept_at(memory.width_of(method), point)
            # absolute positions: kept keys stay where they were written, as kvpress leaves them
            cache = make_cache(model, method, budget=kept, n_sink=args.n_sink, positions="absolute",
                               prefill_chunk=args.chunk)
            start = time.perf_counter()
            nll, slots, kv = compressed_nll(model, context, continuation, cache)
            rows.append(compress_row(method, point, slots, nll, kv, time.perf_counter() - start))
    press_rows, versions = kvpress_rows(args, model, context, continuation, kept_at)
    rows += press_rows
    full = rows[0]
    for r in rows:
        r["vs_full"] = f"{(r['ppl'] / full['ppl'] - 1) * 100:+.1f}%"
        r["kv_pct"] = f"{r['kv_bytes'] / full['kv_bytes']:.1%}"
    point_name = "memory" if args.memory else "keep"
    for r in rows:
        point = r.pop("point")
        r[point_name] = memory.percent(point) if args.memory else point
    meta = {"command": args.command_line, "context": n, "continuation": m,
            "n_sink": args.n_sink, "chunk": args.chunk, "positions": "absolute", "kvpress": versions,
            "bytes_per_token": {"model width": full_per_token, **{w or "model width": b for w, b in per_token.items()}},
            "note": "kept = slots per layer and KV head; ppl of the continuation over the compressed cache; "
                    + ("memory = the arm's KV bytes at most, as a fraction of the full cache's for the context; "
                       "kv_pct = what it held" if args.memory else "keep = the fraction of the context's tokens kept")}
    write_results(args.out, "compress", rows, ["method", point_name, "kept", "ppl", "vs_full", "kv_MiB", "kv_pct",
                                               "seconds"], meta)
    if args.memory:
        write_kv_figure(args.out, rows, n, m)
    else:
        # the full cache keeps everything: drawn as a flat reference line across the fractions
        points = [{**rows[0], "keep": keep} for keep in args.keep] + rows[1:]
        write_plot(args.out, "compress", points, "keep", "ppl", "method",
                   f"{n} tokens compressed, then ppl of the next {m}", logy=True)


def write_kv_figure(out, rows, n, m):
    """out/compress-kv.svg: ppl against KV MiB, a line per method and width; the full cache a
    dashed line at its ppl from the smallest arm's MiB to its own. The axis stops at twice the full
    cache's ppl: an arm that collapses past it is written in numbers on the top edge."""
    full, series = rows[0], {}
    for r in rows[1:]:
        series.setdefault(r["method"], []).append((r["kv_MiB"], r["ppl"]))
    low = min(x for pts in series.values() for x, _ in pts) if series else full["kv_MiB"]
    series[f"full ({full['kv_MiB']} MiB)"] = [(low, full["ppl"]), (full["kv_MiB"], full["ppl"])]
    write_chart(Path(out) / "compress-kv.svg", series, f"{n} tokens compressed, then ppl of the next {m}",
                "KV cache held (MiB)", "perplexity", dashed=[f"full ({full['kv_MiB']} MiB)"],
                y_max=2 * full["ppl"])
