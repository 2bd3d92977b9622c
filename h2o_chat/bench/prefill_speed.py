"""`python -m h2o_chat.bench prefill-speed`: prefill tokens/s of DynamicCache and H2OCache (h2o at
--budget, prefilled --chunk tokens at a time inside each layer) per dtype, weights (--quantization)
and prompt length: timed runs interleaved between every arm, medians reported, plus one profiled
run each for the counts (aten ops per token, bytes allocated).
"""

import statistics
import time

import torch
from transformers import DynamicCache

from ..models.load import load_model
from ..models.quantize import weights_label
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
    models = {(dtype, q): load_model(args.model, dtype=dtype, quantization=q)
              for dtype in args.dtypes for q in args.quantization}
    tokenizer = next(iter(models.values()))[1]
    text = text_tokens(tokenizer, args.text, max(args.tokens))
    rows = []
    for n in args.tokens:
        prompt = text[:, :n]
        arms = {}
        for (dtype, q), (model, _) in models.items():
            arms[dtype, q, "dynamic"] = (model, lambda: DynamicCache())
            arms[dtype, q, "h2o"] = (model, lambda model=model: make_cache(model, "h2o", budget=args.budget,
                                                                           prefill_chunk=args.chunk))
        times = {arm: [] for arm in arms}
        for model, make in arms.values():  # warm-up, untimed
            with torch.no_grad():
                model(prompt, cache=make(), logits_to_keep=1)
        for _ in range(args.repeats):
            for arm, (model, make) in arms.items():
                cache = make()
                start = time.perf_counter()
                with torch.no_grad():
                    model(prompt, cache=cache, logits_to_keep=1)
                times[arm].append(time.perf_counter() - start)
        first = {}
        for (dtype, q, m), (model, make) in arms.items():
            ops, mib = prefill_counts(model, prompt, make()) if args.counts else ("", "")
            t = statistics.median(times[dtype, q, m])
            first.setdefault((dtype, m), t)
            rows.append({"dtype": str(model.dtype).removeprefix("torch."), "quantization": q, "tokens": n, "method": m,
                         "tokens_per_s": round(n / t, 1),
                         "vs_dynamic": "" if m == "dynamic" else f"{statistics.median(times[dtype, q, 'dynamic']) / t:.2f}x",
                         f"vs_{args.quantization[0]}": f"{first[dtype, m] / t:.2f}x",
                         "ops_per_token": ops if ops == "" else round(ops, 1),
                         "alloc_MiB": mib if mib == "" else round(mib, 1)})
            print(rows[-1], flush=True)
    meta = {"command": args.command_line, "budget": args.budget, "chunk": args.chunk, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "weights": {f"{d} {q}": weights_label(m) for (d, q), (m, _) in models.items()},
            "note": "median of interleaved repeats; ops and MiB allocated from one profiled run each; "
                    f"vs_{args.quantization[0]}: the speed against the {args.quantization[0]} weights' (same dtype, method)"}
    write_results(args.out, "prefill-speed", rows, ["dtype", "quantization", "tokens", "method", "tokens_per_s",
                                                    "vs_dynamic", f"vs_{args.quantization[0]}", "ops_per_token",
                                                    "alloc_MiB"], meta)
