"""`python -m h2o_chat.bench.evaluate summarize`: the paper's XSUM-style task from a jsonl of
requests (article = the whole prompt, summary_gt, max_tokens, temperature, stop: the H2O authors'
summarization files): ROUGE-1/2/L of full vs h2o, window and sink at budgets that are fractions of
each prompt, and each output's ROUGE-L against the full cache's own.
"""

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..chat.detok import cut_at_stop
from ..models.load import load_model
from .common import make_cache, read_input, write_plot, write_results

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


def run(args):
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
