"""Speed and memory benchmarks: `python -m h2o_chat.bench SUBCOMMAND`.

    decode   time per generated token and KV bytes after N tokens seen, for DynamicCache and
             H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict)
    prefill  peak memory (RSS) of prefilling a long prompt, each method in a fresh process

Every figure comes from running the model here; results go to --out as JSON and Markdown.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .cache import H2OCache
from .model import load_model

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


def text_tokens(tokenizer, path, n_tokens):
    """The first n_tokens tokens of a text file, [1, n_tokens]."""
    text = Path(path).read_text(encoding="utf-8")
    ids = tokenizer(text[: n_tokens * 8], return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"{path} has only {ids.shape[1]} tokens, {n_tokens} wanted")
    return ids[:, :n_tokens]


def make_cache(model, method, budget, n_sink=4, prefill_chunk=256, **kw):
    """'dynamic' (transformers' DynamicCache), 'full', 'window', 'sink', 'h2o' or 'h2o-<score>'."""
    if method == "dynamic":
        return DynamicCache()
    policy, _, score = method.partition("-")
    return H2OCache(model, policy=policy, budget=budget, n_sink=n_sink, score=score or "sum",
                    prefill_chunk=prefill_chunk, **kw)


def kv_bytes(cache):
    if isinstance(cache, H2OCache):
        return cache.kv_bytes()
    return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in cache.layers)


@torch.no_grad()
def time_decode(model, prompt, cache, steps):
    """Prefill `prompt`, then `steps` greedy tokens one by one; mean seconds per decode step."""
    token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
    token = model(token, cache=cache).logits[:, -1:].argmax(-1)  # one untimed step: warm-up
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps


def markdown_table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def write_results(out, name, rows, columns, meta):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown_table(rows, columns)
    (out / f"{name}.md").write_text(f"Command: `{meta['command']}`\n\n{table}\n")
    print(table)


def cmd_decode(args):
    model, tokenizer = load_model(args.model)
    text = text_tokens(tokenizer, args.text, max(args.seen))
    methods = ["dynamic", "full", "h2o", "h2o-noevict"]
    rows = []
    for seen in args.seen:
        prompt = text[:, :seen]
        times = {m: [] for m in methods}
        kv = {}
        for _ in range(args.repeats):  # methods interleaved, so machine noise hits them alike
            for m in methods:
                if m == "h2o-noevict":
                    cache = make_cache(model, "h2o", budget=seen + args.steps + 2)
                else:
                    cache = make_cache(model, m, budget=args.budget)
                times[m].append(time_decode(model, prompt, cache, args.steps))
                kv[m] = kv_bytes(cache)
        base = statistics.median(times["dynamic"])
        for m in methods:
            t = statistics.median(times[m])
            rows.append({"seen": seen, "method": m, "ms_per_token": round(1000 * t, 2),
                         "tokens_per_s": round(1 / t, 2), "vs_dynamic": f"{base / t:.2f}x",
                         "kv_MiB": round(kv[m] / 2**20, 2)})
            print(rows[-1], flush=True)
    meta = {"command": "python -m h2o_chat.bench " + " ".join(args.argv), "budget": args.budget,
            "steps": args.steps, "repeats": args.repeats, "threads": torch.get_num_threads()}
    write_results(args.out, "decode", rows, ["seen", "method", "ms_per_token", "tokens_per_s", "vs_dynamic", "kv_MiB"], meta)


def _rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prefill_peak(model_spec, text_path, n_tokens, method, budget, queue):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(model_spec)
    prompt = text_tokens(tokenizer, text_path, n_tokens)
    cache = make_cache(model, method, budget)
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    start = time.perf_counter()
    with torch.no_grad():
        model(prompt, cache=cache, logits_to_keep=1)
    seconds = time.perf_counter() - start
    queue.put({"peak_MiB": round((_rss_kib("VmHWM") - before) / 1024, 1), "seconds": round(seconds, 2),
               "kv_MiB": round(kv_bytes(cache) / 2**20, 2)})


def cmd_prefill(args):
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for method in ["dynamic", "h2o"]:
        queue = ctx.Queue()
        proc = ctx.Process(target=_prefill_peak, args=(args.model, args.text, args.tokens, method, args.budget, queue))
        proc.start()
        result = queue.get()
        proc.join()
        rows.append({"method": method, "tokens": args.tokens, **result})
        print(rows[-1], flush=True)
    meta = {"command": "python -m h2o_chat.bench " + " ".join(args.argv), "budget": args.budget,
            "note": "peak RSS above the RSS before the prefill, each method in a fresh process"}
    write_results(args.out, "prefill", rows, ["method", "tokens", "peak_MiB", "kv_MiB", "seconds"], meta)


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m h2o_chat.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--text", default=str(DATA_DIR / "tinyshakespeare.txt"), help="text the prompts are cut from")
    parser.add_argument("--out", default="bench-out", help="folder for JSON and Markdown results")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="decode time per token vs tokens seen")
    p.add_argument("--seen", type=lambda s: [int(x) for x in s.split(",")], default=[512, 4096])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=512)
    p.set_defaults(run=cmd_decode)
    p = sub.add_parser("prefill", help="peak memory of prefilling a long prompt")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512)
    p.set_defaults(run=cmd_prefill)
    args = parser.parse_args(argv)
    args.argv = argv
    args.run(args)


if __name__ == "__main__":
    main()
