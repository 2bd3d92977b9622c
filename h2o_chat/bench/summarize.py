"""`python -m h2o_chat.bench.evaluate summarize`: the paper's XSUM-style task from a jsonl of
requests (article = the whole prompt, summary_gt, max_tokens, temperature, stop: the H2O authors'
summarization files): ROUGE-1/2/L of full vs h2o, window and sink at budgets that are fractions of
each prompt, and each output's ROUGE-L against the full cache's own.

With --memory the budgets are fractions of the full cache's KV bytes for each prompt instead, and
each arm keeps what its width affords (memory.py; 'h2o:int8' for int8 slots). --openvino adds
OpenVINO GenAI's own eviction (peers/openvino.py) at the same bytes, one arm per --openvino-modes
AggregationMode, and OpenVINO with nothing evicted: its cache counted at its own bytes a token
(u8, measured), its budget the most whole blocks of 32 tokens that fit. Every arm decodes greedily
(--temperature 0 is forced: OpenVINO's sampler draws other random numbers than torch's), and each
engine's outputs are also scored against its own full cache's (rougeL_vs_full).
"""

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..chat.detok import cut_at_stop
from ..models.load import load_model
from . import memory
from .common import make_cache, read_input, write_plot, write_results
from .peers import openvino
from .svg import write_chart

SUMMARIZE_METHODS = ["full", "h2o", "window", "sink"]


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


def ov_label(mode):
    return "openvino" if mode is None else f"openvino-{mode}"


def run(args):
    from rouge_score import rouge_scorer

    model, tokenizer = load_model(args.model)
    ov_python = openvino_python(args)
    if args.memory or ov_python:
        args.temperature = 0  # one decoding rule for both engines (see the module's docstring)
    requests = read_requests(args.file)[args.skip:]
    points = args.memory or args.fractions
    full_per_token = memory.bytes_per_token(model)
    per_token = {w: memory.bytes_per_token(model, w) for w in {memory.width_of(m) for m in args.methods}}
    args.threads = args.threads or torch.get_num_threads()
    ov_per_token = openvino.bytes_per_token(ov_python, openvino_gguf(args), args.threads) if ov_python else None

    def budget_of(method, point, n):
        if method == "full":
            return n
        if not args.memory:
            return max(1, round(point * n))
        return memory.slots_at(point, n, full_per_token, per_token[memory.width_of(method)])

    # the requests: tokenized (the article is the whole prompt, without special tokens); with
    # OpenVINO, only those where its smallest budget still has 3 blocks (start, evictable, recent)
    prompts, skipped = [], 0
    for request in requests:
        ids = tokenizer(request["article"], add_special_tokens=False, return_tensors="pt").input_ids
        if ov_python and memory.slots_at(min(points), ids.shape[1], full_per_token, ov_per_token, openvino.BLOCK) \
                < 3 * openvino.BLOCK:
            skipped += 1
            continue
        prompts.append((request, ids))
        if args.limit and len(prompts) == args.limit:
            break
    if skipped:
        print(f"{skipped} requests skipped: too short for OpenVINO's smallest budget to hold 3 blocks of "
              f"{openvino.BLOCK} tokens at {memory.percent(min(points))}", flush=True)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    arms = [(m, f) for m in args.methods for f in ([1.0] if m == "full" else points)]
    results = {arm: [] for arm in arms}  # arm -> per request dict
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summarize-generations.jsonl", "w", encoding="utf-8") as gens:
        def record(arm, i, request, n, budget, text, n_new, seconds, kv, kv_peak, own_full):
            score = scorer.score(request["summary_gt"], text)
            results.setdefault(arm, []).append({
                "budget": budget, "new_tokens": n_new, "seconds": seconds,
                "kv_pct": 100 * kv / (n * full_per_token), "kv_pct_peak": 100 * kv_peak / (n * full_per_token),
                **{k: 100 * v.fmeasure for k, v in score.items()},
                # how far the cache moved the output from the full cache's own: sensitive even
                # where the model is too weak for the reference summaries to tell methods apart
                "rougeL_vs_full": None if own_full is None else 100.0 if text == own_full else
                100 * scorer.score(own_full, text)["rougeL"].fmeasure})
            gens.write(json.dumps({"request": i, "method": arm[0], "point": float(arm[1]), "prompt_tokens": n,
                                   "budget": budget, "text": text, "summary_gt": request["summary_gt"]}) + "\n")

        for i, (request, ids) in enumerate(tqdm(prompts, desc="requests")):
            n, full_text = ids.shape[1], None
            for method, point in arms:
                budget = budget_of(method, point, n)
                cache = make_cache(model, method, budget=budget, n_sink=args.n_sink, prefill_chunk=args.chunk)
                start = time.perf_counter()
                text, n_new = summarize_one(model, tokenizer, ids, cache, request, args, args.seed + i)
                full_text = text if method == "full" else full_text
                # the peak: a prefill chunk attended beside the budget, at the cache's own bytes a slot
                peak = min(n, budget + args.chunk - 1) * per_token.get(memory.width_of(method), full_per_token)
                record((method, point), i, request, n, budget, text, n_new, time.perf_counter() - start,
                       cache.kv_bytes(), peak, full_text)
        if ov_python:
            versions = openvino_arms(args, ov_python, prompts, points, full_per_token, ov_per_token, tokenizer, record)
    rows = summary_rows(results, args)
    meta = {"command": args.command_line, "file": str(args.file), "skip": args.skip,
            "requests": len(prompts), "skipped_too_short": skipped, "n_sink": args.n_sink, "chunk": args.chunk,
            "seed": args.seed, "threads": torch.get_num_threads(), "temperature": args.temperature,
            "bytes_per_token": {"model width": full_per_token, **{w or "model width": b for w, b in per_token.items()},
                                **({"openvino u8": ov_per_token} if ov_python else {})},
            "openvino": versions if ov_python else None,
            "prompt_tokens": {"mean": round(sum(ids.shape[1] for _, ids in prompts) / len(prompts), 1),
                              "min": min(ids.shape[1] for _, ids in prompts),
                              "max": max(ids.shape[1] for _, ids in prompts)},
            "note": "ROUGE F-measure x 100 (rouge-score, stemming) against summary_gt; rougeL_vs_full against the "
                    "same engine's full cache's own output; budget = slots per layer and KV head (OpenVINO: its "
                    "max_cache_size); kv_pct: the KV bytes held at the end as % of a full cache at the model's "
                    "width for the prompt (OpenVINO: allocated, whole blocks), kv_pct_peak: the most held at once "
                    "(h2o: budget + chunk - 1 slots during the prefill; OpenVINO: its cache after the prefill, "
                    "before its first eviction)"}
    point_name = "memory" if args.memory else "fraction"
    write_results(args.out, "summarize", rows, ["method", point_name, "budget_mean", "kv_pct", "kv_pct_peak",
                                                "rouge1", "rouge2", "rougeL", "rougeL_vs_full", "new_tokens",
                                                "seconds"], meta)
    if args.memory:
        series = {}
        for r in rows:
            series.setdefault(r["method"], []).append((r["kv_pct"], r["rougeL"]))
        write_chart(out / "summarize-kv.svg", series, f"ROUGE-L of {len(prompts)} summaries vs KV memory",
                    "KV bytes held at the end, % of the full cache's at the model's width", "ROUGE-L")
    else:
        full = next((r for r in rows if r["method"] == "full"), None)
        points_ = [r for r in rows if r["method"] != "full"]
        points_ += [{**full, "fraction": f} for f in args.fractions] if full else []
        write_plot(args.out, "summarize", points_, "fraction", "rougeL", "method",
                   f"ROUGE-L of {len(prompts)} summaries vs budget (fraction of the prompt)")


def summary_rows(results, args):
    """One row per arm: the means over the requests."""
    rows = []
    for (method, point), rs in results.items():
        mean = lambda k, rs=rs: round(sum(r[k] for r in rs) / len(rs), 2) if rs and rs[0][k] is not None else ""  # noqa: E731
        label = memory.percent(point) if args.memory and point != 1.0 else point
        rows.append({"method": method, "memory" if args.memory else "fraction": label,
                     "budget_mean": mean("budget"), "kv_pct": mean("kv_pct"), "kv_pct_peak": mean("kv_pct_peak"),
                     "rouge1": mean("rouge1"), "rouge2": mean("rouge2"), "rougeL": mean("rougeL"),
                     "rougeL_vs_full": mean("rougeL_vs_full"), "new_tokens": mean("new_tokens"),
                     "seconds": round(sum(r["seconds"] for r in rs), 1)})
        print(rows[-1], flush=True)
    return rows


def openvino_python(args):
    """The OpenVINO venv's python when --openvino was given (a missing one ends the command saying how
    to make it), else None."""
    if args.openvino is None:
        return None
    python = openvino.find_python(args.openvino or None)
    if python is None:
        raise SystemExit(f"--openvino: no OpenVINO GenAI venv found; make one with: {openvino.MAKE_VENV}")
    return python


def openvino_gguf(args):
    """The GGUF file OpenVINO reads: the embedded model's (OpenVINO cannot read a transformers folder)."""
    from ..models.load import embedded_gguf_path

    if args.model is not None:
        raise SystemExit("--openvino reads the embedded model's GGUF file; leave --model out to compare with it")
    return embedded_gguf_path()


def openvino_arms(args, python, prompts, points, full_per_token, ov_per_token, tokenizer, record):
    """OpenVINO with nothing evicted, then each of --openvino-modes at each memory point, on every
    prompt, in one worker; each output recorded like ours. Returns the worker's version and settings."""
    tasks, arms = [], []
    for i, (request, ids) in enumerate(prompts):
        n = ids.shape[1]
        for mode in [None] + args.openvino_modes:
            for point in [1.0] if mode is None else points:
                evict = None
                if mode is not None:
                    budget = memory.slots_at(point, n, full_per_token, ov_per_token, openvino.BLOCK)
                    evict = openvino.eviction(budget, *openvino.split(budget), mode)
                max_tokens = request["max_tokens"] if args.max_tokens is None else min(args.max_tokens,
                                                                                      request["max_tokens"])
                tasks.append({"prompt_ids": ids[0].tolist(), "max_new_tokens": max_tokens,
                              "stop": request.get("stop") or [], "eviction": evict})
                arms.append((i, mode, point))
    print(f"OpenVINO: {len(tasks)} generations in {python}", flush=True)
    done = openvino.generate(python, openvino_gguf(args), tasks, args.threads)
    own_full = {}
    for (i, mode, point), task, r in zip(arms, tasks, done["results"]):
        request, ids = prompts[i]
        stop = request.get("stop") or ()
        text = cut_at_stop(tokenizer.decode(r["tokens"], skip_special_tokens=True), stop).strip()
        if mode is None:
            own_full[i] = text
        n = ids.shape[1]
        budget = n if mode is None else task["eviction"]["max_cache_size"]
        # OpenVINO evicts nothing during the prefill: the whole prompt's blocks are held at once before
        # its first eviction, which may come before the streamer's first look (r["kv_bytes_peak"])
        prompt_blocks = -(-n // openvino.BLOCK) * openvino.BLOCK * ov_per_token
        record((ov_label(mode), point), i, request, n, budget, text, len(r["tokens"]), r["seconds"],
               r["kv_bytes_last"], max(r["kv_bytes_peak"], prompt_blocks), own_full[i])
    return {"version": done["version"], "kv_cache_precision": openvino.KV_PRECISION, "block": openvino.BLOCK,
            "schedulers": done["schedulers"]}
