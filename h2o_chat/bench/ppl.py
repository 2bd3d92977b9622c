"""`python -m h2o_chat.bench.evaluate ppl`: streaming perplexity of a long text, the same tokens
through each cache policy at several budgets (fractions of the span): full, window, sink
(StreamingLLM), h2o with each score mode; lists of --n-sink, --n-recent and --positions sweep those
knobs. Then a long part: --long-tokens (past the model's context) at one budget, ppl per segment of
--segment tokens; the full cache is scored only within the trained positions.

The caches evict every --chunk tokens (1 is strict token-by-token streaming; larger is faster,
and the cache then holds up to budget + chunk - 1 tokens while a chunk is attended). The model
itself is called on --feed tokens at a time: H2OCache splits them into --chunk pieces inside each
layer, which gives exactly what feeding --chunk tokens per call gives, with far fewer calls.

--quantization none,auto,int8 runs the short part once per weights (each row against the same
cache's on the first weights: vs_none); the long part runs on the first weights only.

--memory 0.1,0.2 gives the short part's budgets as fractions of the full cache's KV bytes instead
of its tokens: each arm (each --kv-quant width) gets the most slots whose bytes fit in that share
of what a full cache at the model's width holds at the end of the stream (memory.py; a slot's
bytes measured), so int8 slots get 1.88x the tokens of bf16 ones in the same bytes.

--head-budget library,per-head,ada-kv runs the h2o arms through H2OCache (library) or through
head_budgets.py's cache: every head its budget (per-head, which must equal library exactly) or a
layer's heads sharing their slots (ada-kv, Ada-KV's joint choice); docs/budgets.md.
"""

import itertools
import math
import time

import torch
from tqdm import tqdm

from ..cache.config import CacheConfig
from ..cache.h2o import H2OCache
from ..models.load import load_model
from ..models.quantize import weights_label
from . import memory
from .common import make_cache, text_tokens, write_plot, write_results
from .head_budgets import SHARED_BY, HeadBudgetCache

PPL_METHODS = ["full", "window", "sink", "h2o-sum", "h2o-mean", "h2o-decay"]
LONG_METHODS = ["full", "window", "sink", "h2o-sum"]


@torch.no_grad()
def streaming_nlls(model, tokens, cache, feed):
    """Negative log-likelihood of each of tokens[1:] given everything before it, the model called
    on `feed` tokens at a time (the cache evicts at its own prefill_chunk): a float tensor [n - 1]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    nlls = []
    for s in tqdm(range(0, inputs.shape[1], feed), leave=False, desc="tokens", unit_scale=feed):
        logits = model(inputs[:, s : s + feed], cache=cache).logits.float()
        nlls.append(torch.nn.functional.cross_entropy(logits[0], targets[0, s : s + feed], reduction="none"))
    return torch.cat(nlls)


def ppl_of(nlls):
    return round(math.exp(nlls.double().mean().item()), 3)


def ppl_configs(args, budget_at):
    """The caches to run: (label, method, CacheConfig kwargs, resolved Budget, point, head budget), each distinct
    cache once. `point` is a --budgets or --memory value; budget_at(point, kv_quant) its slots for
    that width. Knobs that mean nothing to a policy are not swept for it: full has none, window
    and sink keep the newest tokens (n_recent changes nothing), window has no sinks. A label
    names only the knobs that vary on the command line."""
    varies = {"n_sink": len(args.n_sink) > 1, "n_recent": len(args.n_recent) > 1, "positions": len(args.positions) > 1,
              "budget_shape": len(args.budget_shape) > 1, "head_budget": len(args.head_budget) > 1}
    seen, configs = set(), []
    for method, point, n_sink, recent, positions, shape, kv_quant, heads in itertools.product(
            args.methods, points_of(args), args.n_sink, args.n_recent, args.positions, args.budget_shape,
            args.kv_quant, args.head_budget):
        policy, _, score = method.partition("-")
        budget = budget_at(point, kv_quant)
        # n_recent: a fraction of the budget, a slot count, or None (the library's default split)
        n_recent = round(recent * budget) if isinstance(recent, float) else recent
        kw = dict(policy=policy, budget=budget, n_sink=n_sink, score=score or "sum",
                  n_recent=n_recent if policy == "h2o" else None, positions=positions, budget_shape=shape,
                  kv_quant=kv_quant)
        try:
            limits = CacheConfig(**kw).resolve(args.tokens)
        except ValueError:
            if shape == "uniform":
                raise
            continue  # a pyramid with nothing to share (window, sink keep only sinks and newest): skipped
        if policy == "full" and heads != "library":
            continue  # nothing evicted: the head budgets are H2OCache's full cache
        key = ("full", kv_quant) if policy == "full" else (method, limits, positions, shape, kv_quant, heads)
        if key in seen:
            continue
        seen.add(key)
        label = [method + ("" if kv_quant == "none" else f":{kv_quant}")]
        if policy in ("h2o", "sink") and varies["n_sink"]:
            label.append(f"sink{n_sink}")
        if policy == "h2o" and varies["n_recent"]:
            label.append("recent-auto" if recent is None else
                         f"recent{recent:.0%}" if isinstance(recent, float) else f"recent{recent}")
        if policy != "full" and varies["positions"]:
            label.append(positions)
        if policy != "full" and varies["budget_shape"]:
            label.append(shape)
        if policy != "full" and varies["head_budget"]:
            label.append(heads)
        configs.append((" ".join(label), method, kw, limits, point, heads))
    return configs


def points_of(args):
    """The short part's points: --memory's fractions of the full cache's bytes, else --budgets'
    fractions of --tokens (0.1) or slot counts (410)."""
    return args.memory or args.budgets


def budgets_for(args, model):
    """budget_at(point, kv_quant) -> slots per layer and KV head. A --budgets point: a fraction of
    --tokens or a count. A --memory point: the most slots of that width whose bytes fit in that share
    of a full cache at the model's width holding the stream (its --tokens - 1 inputs: what
    full_kv_bytes() counts at the end), a slot's bytes measured (memory.bytes_per_token). Also
    returns the bytes a token measured, per width (empty without --memory)."""
    if not args.memory:
        return (lambda point, kv_quant: max(1, round(point * args.tokens)) if isinstance(point, float) else point), {}
    per_token = {"model width": memory.bytes_per_token(model)}
    per_token.update({q: memory.bytes_per_token(model, q) for q in args.kv_quant if q != "none"})

    def budget_at(point, kv_quant):
        width = "model width" if kv_quant == "none" else kv_quant
        return max(1, memory.slots_at(point, args.tokens - 1, per_token["model width"], per_token[width]))

    return budget_at, per_token


def run(args):
    rows, weights, first, per_token = [], {}, None, {}
    for quantization in args.quantization:
        model, tokenizer = load_model(args.model, dtype=args.dtype, quantization=quantization)
        weights[quantization] = weights_label(model)
        short_rows, per_token = short_ppl(args, model, tokenizer, quantization)
        rows += short_rows
        if first is None:
            first = (model, tokenizer)
        else:
            del model
    base = {r["label"]: r["ppl"] for r in rows if r["quantization"] == args.quantization[0]}
    for r in rows:
        r[f"vs_{args.quantization[0]}"] = f"{(r['ppl'] / base[r['label']] - 1) * 100:+.2f}%" if r["label"] in base else ""
    model = first[0]
    meta = {"command": args.command_line, "text": args.text, "tokens": args.tokens,
            "chunk": args.chunk, "dtype": str(model.dtype), "threads": torch.get_num_threads(), "weights": weights,
            "note": "budget, n_sink, n_recent: slots per layer and KV head; h2o's heavy hitters get the rest"
                    + ("; memory: the share of a full cache's KV bytes (at the model's width, for the tokens fed) "
                       "the budget fits in; kv_pct: what the cache held at the end" if args.memory else ""),
            **({"bytes_per_token": per_token} if args.memory else {})}
    heads = ["head_budget"] if args.head_budget != ["library"] else []  # the column only where the bench's cache ran
    columns = ["label", *(["memory"] if args.memory else []), "budget", "budget_pct", "kv_pct", "n_sink", "n_recent",
               "positions", "budget_shape", *heads, "ppl", "vs_full", "seconds"]
    if len(args.quantization) > 1:
        columns[1:1] = ["quantization"]
        columns.insert(-1, f"vs_{args.quantization[0]}")
    write_results(args.out, "ppl", rows, columns, meta)
    # the full cache has no budget: drawn as a flat line across the budgets
    first_rows = [r for r in rows if r["quantization"] == args.quantization[0]]
    full = next((r["ppl"] for r in first_rows if r["method"] == "full"), None)
    points = [r for r in first_rows if r["method"] != "full"]
    points = [{"label": "full", "budget": b, "ppl": full} for b in sorted({r["budget"] for r in points}) if full] + points
    write_plot(args.out, "ppl", points, "budget", "ppl", "label",
               f"perplexity of {args.tokens} streamed tokens vs budget", logy=True)
    if args.long_tokens:
        long_ppl(args, *first)


def short_ppl(args, model, tokenizer, quantization):
    """The rows of the short part for one model."""
    # budgets: fractions of the span (0.2 = 20% of --tokens) or slot counts
    budget_at, per_token = budgets_for(args, model)
    tokens = text_tokens(tokenizer, args.text, args.tokens)
    rows = []
    for label, method, kw, limits, point, heads in ppl_configs(args, budget_at):
        shared = SHARED_BY[heads]
        cache = (H2OCache(model, prefill_chunk=args.chunk, **kw) if shared is None else
                 HeadBudgetCache(model, shared=shared, prefill_chunk=args.chunk, **kw))
        start = time.perf_counter()
        nlls = streaming_nlls(model, tokens, cache, args.feed)
        ppl = ppl_of(nlls)
        unbounded = kw["policy"] == "full"
        rows.append({"label": label, "quantization": quantization, "method": method,
                     **({"memory": "100%" if unbounded else memory.percent(point)} if args.memory else {}),
                     "budget": "all" if unbounded else limits.budget,
                     "budget_pct": "100%" if unbounded else f"{limits.budget / args.tokens:.0%}",
                     # the bytes it holds at the end against a full cache at the model's width
                     "kv_pct": f"{cache.kv_bytes() / cache.full_kv_bytes():.1%}",
                     "kv_bytes": cache.kv_bytes(), "full_kv_bytes": cache.full_kv_bytes(),
                     "n_sink": "" if unbounded else limits.n_sink, "n_recent": "" if unbounded else limits.n_recent,
                     "positions": "" if unbounded else kw["positions"],
                     "budget_shape": "" if unbounded else kw["budget_shape"],
                     "head_budget": "" if unbounded else heads, "ppl": ppl,
                     # unrounded, in the JSON only: two arms that must agree (per-head, library) compared exactly
                     "mean_nll": nlls.double().mean().item(),
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    full = next((r["ppl"] for r in rows if r["label"] == "full"), None)
    for r in rows:
        r["vs_full"] = f"{(r['ppl'] / full - 1) * 100:+.1f}%" if full else ""
    return rows, per_token


def long_ppl(args, model, tokenizer):
    """--long-tokens streamed through each of --long-methods at --long-budget (with the first
    --n-sink, --n-recent and --positions): perplexity per --segment tokens. The full cache is
    scored only within the model's trained positions: past them its ppl is reported as n/a."""
    max_positions = model.config.get_text_config(decoder=True).max_position_embeddings
    tokens = text_tokens(tokenizer, args.text, args.long_tokens)
    n = args.long_tokens - 1  # tokens scored: each given everything before it
    recent = args.n_recent[0]
    nlls, seconds = {}, {}
    for method in args.long_methods:
        policy = method.partition("-")[0]
        n_recent = (round(recent * args.long_budget) if isinstance(recent, float) else recent) if policy == "h2o" else None
        cache = make_cache(model, method, budget=args.long_budget, n_sink=args.n_sink[0], n_recent=n_recent,
                           positions=args.positions[0], prefill_chunk=args.chunk)
        start = time.perf_counter()
        nlls[method] = streaming_nlls(model, tokens[:, :max_positions] if policy == "full" else tokens, cache, args.feed)
        seconds[method] = round(time.perf_counter() - start, 1)
        print(f"long: {method} {len(nlls[method])} tokens scored, ppl {ppl_of(nlls[method])}, {seconds[method]} s",
              flush=True)

    def cell(method, s, e):
        return ppl_of(nlls[method][s:e]) if e <= len(nlls[method]) + 1 else "n/a"

    # nlls[m][i] is the NLL of token i + 1; a segment [s, e) scores tokens s + 1 .. e
    rows, points = [], []
    for s in range(0, n, args.segment):
        e = min(s + args.segment, n)
        rows.append({"tokens": f"{s + 1}-{e}", **{m: cell(m, s, e) for m in nlls}})
        points += [{"method": m, "token": e, "ppl": "" if rows[-1][m] == "n/a" else rows[-1][m]} for m in nlls]
    within = min(n, max_positions - 1)
    rows.append({"tokens": f"1-{within} (all within context)", **{m: cell(m, 0, within) for m in nlls}})
    if n > within:
        rows.append({"tokens": f"{within + 1}-{n} (all past context)", **{m: cell(m, within, n) for m in nlls}})
    meta = {"command": args.command_line, "text": args.text,
            "tokens": args.long_tokens, "budget": args.long_budget, "n_sink": args.n_sink[0], "n_recent": recent,
            "positions": args.positions[0], "chunk": args.chunk, "max_position_embeddings": max_positions,
            "seconds": seconds, "threads": torch.get_num_threads(),
            "note": f"ppl per segment of scored tokens; the full cache cannot go past the model's {max_positions} "
                    f"positions, so it is scored over its first {max_positions} tokens only (n/a after)"}
    write_results(args.out, "ppl-long", rows, ["tokens", *nlls], meta)
    write_plot(args.out, "ppl-long", points, "token", "ppl", "method",
               f"ppl per {args.segment} tokens, budget {args.long_budget} ({args.positions[0]} positions)", logy=True)
