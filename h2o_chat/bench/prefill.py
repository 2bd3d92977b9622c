"""`python -m h2o_chat.bench prefill`: peak memory (RSS) of prefilling a long prompt, DynamicCache
against h2o, each in a fresh process so neither inherits the other's allocations.
"""

import multiprocessing
import time
from pathlib import Path

import torch

from ..models.load import load_model
from .common import kv_bytes, make_cache, rss_kib, text_tokens, write_results


def prefill_peak(model_spec, text_path, n_tokens, method, budget, queue):
    """In a fresh process: load the model, prefill n_tokens of the text into `method`'s cache, and
    put the RSS peak above what was there before, the seconds and the KV size on `queue`."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(model_spec)
    prompt = text_tokens(tokenizer, text_path, n_tokens)
    cache = make_cache(model, method, budget)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = rss_kib("VmHWM")  # the reset value, not VmRSS read separately: the peak can't go below it
    start = time.perf_counter()
    with torch.no_grad():
        model(prompt, cache=cache, logits_to_keep=1)
    seconds = time.perf_counter() - start
    queue.put({"peak_MiB": round((rss_kib("VmHWM") - before) / 1024, 1), "seconds": round(seconds, 4),
               "kv_MiB": round(kv_bytes(cache) / 2**20, 2)})


def run(args):
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for method in ["dynamic", "h2o"]:
        queue = ctx.Queue()
        proc = ctx.Process(target=prefill_peak, args=(args.model, args.text, args.tokens, method, args.budget, queue))
        proc.start()
        result = queue.get()
        proc.join()
        rows.append({"method": method, "tokens": args.tokens, **result})
        print(rows[-1], flush=True)
    meta = {"command": args.command_line, "budget": args.budget,
            "note": "peak RSS above the RSS before the prefill, each method in a fresh process"}
    write_results(args.out, "prefill", rows, ["method", "tokens", "peak_MiB", "kv_MiB", "seconds"], meta)
