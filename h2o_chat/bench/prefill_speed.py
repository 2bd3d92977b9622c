"""`python -m h2o_chat.bench prefill-speed`: prefill tokens/s of DynamicCache and H2OCache (h2o at
--budget, prefilled --chunk tokens at a time inside each layer) per dtype and prompt length: timed
runs interleaved between the two, medians reported, plus one profiled run each for the counts
(aten ops per token, bytes allocated).
"""

import statistics
import time

import torch
from transformers import DynamicCache

from ..models.load import load_model
from .common import make_cache, text_tokens, write_results


def prefill_counts(model, prompt, cache):
    """One prefill of `prompt` [1, n] under the profiler: (aten ops per prompt token, MiB
    allocated in all, summed over every allocation, freed or not: what the prefill materialised)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(prompt, cache=cache, logits_to_keep=1)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in events)
    return ops / prompt.shape[1], allocated / 2**20


def run(args):
    rows = []
    for dtype in args.dtypes:
        model, tokenizer = load_model(args.model, dtype=dtype)
        text = text_tokens(tokenizer, args.text, max(args.tokens))
        for n in args.tokens:
            prompt = text[:, :n]
            make = {"dynamic": lambda: DynamicCache(),
                    "h2o": lambda model=model: make_cache(model, "h2o", budget=args.budget, prefill_chunk=args.chunk)}
            times = {m: [] for m in make}
            for m in make:  # warm-up, untimed
                with torch.no_grad():
                    model(prompt, cache=make[m](), logits_to_keep=1)
            for _ in range(args.repeats):
                for m in make:
                    cache = make[m]()
                    start = time.perf_counter()
                    with torch.no_grad():
                        model(prompt, cache=cache, logits_to_keep=1)
                    times[m].append(time.perf_counter() - start)
            for m in make:
                ops, mib = prefill_counts(model, prompt, make[m]()) if args.counts else ("", "")
                t = statistics.median(times[m])
                rows.append({"dtype": str(model.dtype).removeprefix("torch."), "tokens": n, "method": m,
                             "tokens_per_s": round(n / t, 1), "vs_dynamic": "",
                             "ops_per_token": ops if ops == "" else round(ops, 1),
                             "alloc_MiB": mib if mib == "" else round(mib, 1)})
            rows[-1]["vs_dynamic"] = f"{rows[-1]['tokens_per_s'] / rows[-2]['tokens_per_s']:.2f}x"
            print(rows[-2], rows[-1], sep="\n", flush=True)
    meta = {"command": args.command_line, "budget": args.budget, "chunk": args.chunk, "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "note": "median of interleaved repeats; ops and MiB allocated from one profiled run each"}
    write_results(args.out, "prefill-speed", rows, ["dtype", "tokens", "method", "tokens_per_s", "vs_dynamic",
                                                    "ops_per_token", "alloc_MiB"], meta)
