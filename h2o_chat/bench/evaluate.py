"""Quality evaluations: `python -m h2o_chat.bench.evaluate SUBCOMMAND`.

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

The caches evict every --chunk tokens (1 is strict token-by-token streaming; larger is faster,
and the cache then holds up to budget + chunk - 1 tokens while a chunk is attended). The model
itself is called on --feed tokens at a time: H2OCache splits them into --chunk pieces inside each
layer, which gives exactly what feeding --chunk tokens per call gives, with far fewer calls.
"""

import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from ..cache.config import CacheConfig
from ..cache.h2o import H2OCache
from ..chat.detok import cut_at_stop
from ..models.load import load_model
from . import (
    DATA_DIR,
    add_quick,
    apply_quick,
    base_parser,
    kv_bytes,
    make_cache,
    read_input,
    text_tokens,
    write_plot,
    write_results,
)
from .peers import kvpress as kvpress_worker

PPL_METHODS = ["full", "window", "sink", "h2o-sum", "h2o-mean", "h2o-decay"]


LONG_METHODS = ["full", "window", "sink", "h2o-sum"]
SUMMARIZE_METHODS = ["full", "h2o", "window", "sink"]


def numbers(text):
    """'0.1,0.2,0.5' -> [0.1, 0.2, 0.5] (fractions), '410,820' -> [410, 820] (counts), 'auto' -> [None]."""
    return [None if x == "auto" else float(x) if "." in x else int(x) for x in text.split(",")]


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


def ppl_configs(args, budgets):
    """The caches to run: (label, method, CacheConfig kwargs, resolved Budget), each distinct
    cache once. Knobs that mean nothing to a policy are not swept for it: full has none, window
    and sink keep the newest tokens (n_recent changes nothing), window has no sinks. A label
    names only the knobs that vary on the command line."""
    varies = {"n_sink": len(args.n_sink) > 1, "n_recent": len(args.n_recent) > 1, "positions": len(args.positions) > 1}
    seen, configs = set(), []
    for method, budget, n_sink, recent, positions in itertools.product(args.methods, budgets, args.n_sink,
                                                                       args.n_recent, args.positions):
        policy, _, score = method.partition("-")
        # n_recent: a fraction of the budget, a slot count, or None (the library's default split)
        n_recent = round(recent * budget) if isinstance(recent, float) else recent
        kw = dict(policy=policy, budget=budget, n_sink=n_sink, score=score or "sum",
                  n_recent=n_recent if policy == "h2o" else None, positions=positions)
        limits = CacheConfig(**kw).resolve(args.tokens)
        key = ("full",) if policy == "full" else (method, limits, positions)
        if key in seen:
            continue
        seen.add(key)
        label = [method]
        if policy in ("h2o", "sink") and varies["n_sink"]:
            label.append(f"sink{n_sink}")
        if policy == "h2o" and varies["n_recent"]:
            label.append("recent-auto" if recent is None else
                         f"recent{recent:.0%}" if isinstance(recent, float) else f"recent{recent}")
        if policy != "full" and varies["positions"]:
            label.append(positions)
        configs.append((" ".join(label), method, kw, limits))
    return configs


def cmd_ppl(args):
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    # budgets: fractions of the span (0.2 = 20% of --tokens) or slot counts
    budgets = [max(1, round(b * args.tokens)) if isinstance(b, float) else b for b in args.budgets]
    tokens = text_tokens(tokenizer, args.text, args.tokens)
    rows = []
    for label, method, kw, limits in ppl_configs(args, budgets):
        cache = H2OCache(model, prefill_chunk=args.chunk, **kw)
        start = time.perf_counter()
        ppl = ppl_of(streaming_nlls(model, tokens, cache, args.feed))
        unbounded = kw["policy"] == "full"
        rows.append({"label": label, "method": method, "budget": "all" if unbounded else limits.budget,
                     "budget_pct": "100%" if unbounded else f"{limits.budget / args.tokens:.0%}",
                     "n_sink": "" if unbounded else limits.n_sink, "n_recent": "" if unbounded else limits.n_recent,
                     "positions": "" if unbounded else kw["positions"], "ppl": ppl,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    full = next((r["ppl"] for r in rows if r["method"] == "full"), None)
    for r in rows:
        r["vs_full"] = f"{(r['ppl'] / full - 1) * 100:+.1f}%" if full else ""
    meta = {"command": args.command_line, "text": args.text, "tokens": args.tokens,
            "chunk": args.chunk, "dtype": str(model.dtype), "threads": torch.get_num_threads(),
            "note": "budget, n_sink, n_recent: slots per layer and KV head; h2o's heavy hitters get the rest"}
    write_results(args.out, "ppl", rows, ["label", "budget", "budget_pct", "n_sink", "n_recent", "positions", "ppl",
                                          "vs_full", "seconds"], meta)
    # the full cache has no budget: drawn as a flat line across the budgets
    points = [r for r in rows if r["method"] != "full"]
    points = [{"label": "full", "budget": b, "ppl": full} for b in sorted({r["budget"] for r in points}) if full] + points
    write_plot(args.out, "ppl", points, "budget", "ppl", "label",
               f"perplexity of {args.tokens} streamed tokens vs budget", logy=True)
    if args.long_tokens:
        long_ppl(args, model, tokenizer)


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


def read_requests(path, limit=None):
    """The requests of a jsonl file (one JSON object a line), the first `limit` of them."""
    requests = [json.loads(line) for line in read_input(path).splitlines() if line.strip()]
    return requests[:limit] if limit else requests


@torch.no_grad()
def summarize_one(model, tokenizer, ids, cache, request, args, seed):
    """Generate a summary of a tokenized prompt ids [1, n] with `cache`: greedy when the
    temperature is 0, else sampled with a fixed seed (each method draws the same random stream,
    so differences come from the cache). Returns (text cut at the stop strings, new tokens)."""
    temperature = request.get("temperature", 0) if args.temperature is None else args.temperature
    max_tokens = request["max_tokens"] if args.max_tokens is None else min(args.max_tokens, request["max_tokens"])
    stop = request.get("stop") or []
    sampling = dict(do_sample=True, temperature=temperature, top_p=request.get("top_p", 1.0), top_k=0) \
        if temperature > 0 else dict(do_sample=False)
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=max_tokens,
                         stop_strings=stop or None, tokenizer=tokenizer if stop else None,
                         pad_token_id=model.generation_config.pad_token_id or 0, **sampling)
    new = out[0, ids.shape[1] :]
    return cut_at_stop(tokenizer.decode(new, skip_special_tokens=True), stop or ()).strip(), len(new)


def cmd_summarize(args):
    from rouge_score import rouge_scorer

    model, tokenizer = load_model(args.model)
    requests = read_requests(args.file, args.limit)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    arms = [(m, f) for m in args.methods for f in ([1.0] if m == "full" else args.fractions)]
    results = {arm: [] for arm in arms}  # arm -> per request dict
    prompt_tokens = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summarize-generations.jsonl", "w", encoding="utf-8") as gens:
        for i, request in enumerate(tqdm(requests, desc="requests")):
            # the article is the whole prompt (instructions included), tokenized without special tokens
            ids = tokenizer(request["article"], add_special_tokens=False, return_tensors="pt").input_ids
            prompt_tokens.append(ids.shape[1])
            full_text = None
            for method, fraction in arms:
                budget = ids.shape[1] if method == "full" else max(1, round(fraction * ids.shape[1]))
                cache = make_cache(model, method, budget=budget, n_sink=args.n_sink, prefill_chunk=args.chunk)
                start = time.perf_counter()
                text, n_new = summarize_one(model, tokenizer, ids, cache, request, args, args.seed + i)
                score = scorer.score(request["summary_gt"], text)
                if method == "full":
                    full_text = text
                results[(method, fraction)].append({
                    "budget": budget, "new_tokens": n_new, "seconds": time.perf_counter() - start,
                    **{k: 100 * v.fmeasure for k, v in score.items()},
                    # how far the cache moved the output from the full cache's own: sensitive even
                    # where the model is too weak for the reference summaries to tell methods apart
                    "rougeL_vs_full": None if full_text is None else 100.0 if text == full_text else
                    100 * scorer.score(full_text, text)["rougeL"].fmeasure})
                gens.write(json.dumps({"request": i, "method": method, "fraction": fraction, "prompt_tokens": ids.shape[1],
                                       "budget": budget, "text": text, "summary_gt": request["summary_gt"]}) + "\n")
    rows = []
    for (method, fraction), rs in results.items():
        mean = lambda k, rs=rs: round(sum(r[k] for r in rs) / len(rs), 2) if rs and rs[0][k] is not None else ""  # noqa: E731
        rows.append({"method": method, "fraction": fraction, "budget_mean": mean("budget"), "rouge1": mean("rouge1"),
                     "rouge2": mean("rouge2"), "rougeL": mean("rougeL"), "rougeL_vs_full": mean("rougeL_vs_full"),
                     "new_tokens": mean("new_tokens"), "seconds": round(sum(r["seconds"] for r in rs), 1)})
        print(rows[-1], flush=True)
    meta = {"command": args.command_line, "file": str(args.file),
            "requests": len(requests), "n_sink": args.n_sink, "seed": args.seed, "threads": torch.get_num_threads(),
            "prompt_tokens": {"mean": round(sum(prompt_tokens) / len(prompt_tokens), 1), "min": min(prompt_tokens),
                              "max": max(prompt_tokens)},
            "note": "ROUGE F-measure x 100 (rouge-score, stemming) against summary_gt; rougeL_vs_full against the "
                    "full cache's own output; budget = fraction x prompt tokens, per layer and KV head"}
    write_results(args.out, "summarize", rows, ["method", "fraction", "budget_mean", "rouge1", "rouge2", "rougeL",
                                                "rougeL_vs_full", "new_tokens", "seconds"], meta)
    full = next((r for r in rows if r["method"] == "full"), None)
    points = [r for r in rows if r["method"] != "full"]
    points += [{**full, "fraction": f} for f in args.fractions] if full else []
    write_plot(args.out, "summarize", points, "fraction", "rougeL", "method",
               f"ROUGE-L of {len(requests)} summaries vs budget (fraction of the prompt)")


COMPRESS_METHODS = ["h2o-sum", "h2o-mean", "h2o-decay", "sink", "window"]
KVPRESS_PRESSES = {"kvpress-observed": "ObservedAttentionPress", "kvpress-snapkv": "SnapKVPress",
                   "kvpress-streamingllm": "StreamingLLMPress"}


def frozen_copy(cache):
    """A DynamicCache holding exactly the slots an H2OCache keeps now: per layer its keys and
    values [batch, kv_heads, slots, head_dim] (slot order means nothing to attention). It never
    evicts, so what runs next attends over these slots plus its own tokens, as it would over a
    kvpress-compressed cache."""
    return DynamicCache([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


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
    worker = kvpress_worker.worker_for(args.kvpress_python, model)
    if worker is None:
        return [], None
    n = context.shape[1]
    arms = [(label, keep) for label in args.presses for keep in args.keep]
    tasks = [{"kind": "compress_nll", "press": KVPRESS_PRESSES.get(label, label), "kept": round(keep * n),
              "context_ids": context[0].tolist(), "continuation_ids": continuation[0].tolist()} for label, keep in arms]
    print(f"kvpress: {len(tasks)} runs in {worker[0]}", flush=True)
    result = kvpress_worker.run_tasks(worker, model, tasks)
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


def cmd_compress(args):
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, shared = base_parser("python -m h2o_chat.bench.evaluate", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ppl", parents=[shared], help="streaming perplexity per policy and budget, then past the model's context")
    p.add_argument("--text", default=str(DATA_DIR / "tinyshakespeare.txt"), help="any UTF-8 text file")
    p.add_argument("--tokens", type=int, default=4096, help="the span streamed at each budget")
    p.add_argument("--budgets", "--budget", type=numbers, default=[0.1, 0.2, 0.5],
                   help="slots per layer and KV head: fractions of --tokens (0.1,0.2,0.5) or counts (410,820)")
    p.add_argument("--n-sink", type=numbers, default=[4], help="first tokens kept; a list sweeps it (0,4,8)")
    p.add_argument("--n-recent", type=numbers, default=[None],
                   help="h2o's recent window: fractions of the budget (0.25,0.5,0.75), counts, or auto "
                        "(half of what the sinks leave); the heavy hitters get the rest")
    p.add_argument("--positions", type=lambda s: s.split(","), default=["rolling"], help="rolling, absolute or both")
    p.add_argument("--chunk", type=int, default=16, help="the caches evict every this many tokens")
    p.add_argument("--feed", type=int, default=512, help="tokens per model call (the figures do not depend on it)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=PPL_METHODS)
    p.add_argument("--long-tokens", type=int, default=20480, help="the long part's length (0: skip it)")
    p.add_argument("--long-budget", type=int, default=512)
    p.add_argument("--long-methods", type=lambda s: s.split(","), default=LONG_METHODS)
    p.add_argument("--segment", type=int, default=2048, help="the long part's ppl is reported per this many tokens")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CPUs with native bf16, else fp32), float32, bfloat16")
    add_quick(p, tokens=384, long_tokens=768, long_budget=64, segment=192)  # about 2 minutes on the embedded model
    p.set_defaults(run=cmd_ppl)
    p = sub.add_parser("summarize", parents=[shared], help="XSUM-style summaries (the H2O authors' jsonl format), ROUGE per budget")
    p.add_argument("--file", required=True, help="jsonl: article (the whole prompt), summary_gt, max_tokens, "
                                                 "temperature, stop (and top_p)")
    p.add_argument("--fractions", type=numbers, default=[0.1, 0.2, 0.5], help="budgets as fractions of each prompt")
    p.add_argument("--methods", type=lambda s: s.split(","), default=SUMMARIZE_METHODS)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256, help="the prompt is prefilled (and evicted) this many tokens at a time")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--max-tokens", type=int, default=None, help="at most this many new tokens (each request's max_tokens)")
    p.add_argument("--temperature", type=float, default=None, help="instead of each request's (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i, the same for every method")
    add_quick(p, limit=3, max_tokens=24)
    p.set_defaults(run=cmd_summarize)
    p = sub.add_parser("compress", parents=[shared], help="one context compressed by each method, ppl of what follows")
    p.add_argument("--text", default=str(DATA_DIR / "tinyshakespeare.txt"))
    p.add_argument("--context", type=int, default=3584, help="tokens compressed")
    p.add_argument("--continuation", type=int, default=512, help="tokens scored after it")
    p.add_argument("--keep", type=lambda s: [float(x) for x in s.split(",")], default=[0.2],
                   help="fractions of the context kept, e.g. 0.1,0.2,0.5")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256, help="our caches prefill (and evict) this many tokens at a time")
    p.add_argument("--methods", type=lambda s: s.split(","), default=COMPRESS_METHODS)
    p.add_argument("--presses", type=lambda s: s.split(","), default=list(KVPRESS_PRESSES),
                   help="kvpress arms: these names, or the class name of any kvpress ScorerPress")
    p.add_argument("--kvpress-python", default=None, help=f"python of the kvpress venv (or ${kvpress_worker.ENV_VAR})")
    add_quick(p, context=384, continuation=64)  # seconds on the tiny test model, about a minute on the embedded one
    p.set_defaults(run=cmd_compress)
    args = parser.parse_args(argv)
    apply_quick(args, argv)
    args.command_line = "python -m h2o_chat.bench.evaluate " + " ".join(argv)
    args.run(args)


if __name__ == "__main__":
    main()
