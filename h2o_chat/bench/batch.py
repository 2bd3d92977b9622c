"""`python -m h2o_chat.bench batch`: the paper's throughput setting (CUDA): a random-init model of
Llama-2-7B's shape, prompt + generated tokens at several batch sizes, full cache vs h2o at a
fraction of the sequence; each method at the same batch, then doubled until memory runs out.
"""

import json
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from .common import kv_bytes, make_cache, write_plot, write_results

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def _generate_timed(model, prompt, cache, new_tokens):
    """Seconds for prefill + new_tokens greedy tokens (min = max, so every run does the same work)."""
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - start


def run(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench batch: needs a CUDA GPU (the paper's setting); none here, skipped.")
        write_results(args.out, "batch", [], ["method"], {"command": args.command_line,
                                                           "skipped": "no CUDA GPU"})
        return
    shape = LLAMA2_7B if args.shape == "llama2-7b" else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                                num_attention_heads=4, num_key_value_heads=2,
                                                                vocab_size=256, max_position_embeddings=4096)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()
    budget = max(8, int(args.fraction * (args.prompt + args.new_tokens)))
    rows = []

    def timed_run(method, batch):
        prompt = torch.randint(0, shape["vocab_size"], (batch, args.prompt), device=args.device)
        cache = DynamicCache() if method == "full" else make_cache(model, "h2o", budget=budget)
        seconds = _generate_timed(model, prompt, cache, args.new_tokens)
        return {"method": method, "batch": batch, "latency_s": round(seconds, 2),
                "tokens_per_s": round(batch * args.new_tokens / seconds, 1), "kv_MiB": round(kv_bytes(cache) / 2**20, 3)}

    for method in ("full", "h2o"):
        rows.append({**timed_run(method, args.batch), "measure": "same batch"})
        print(rows[-1], flush=True)
        batch = args.batch
        while batch * 2 <= args.max_batch:  # double until the memory runs out: the largest batch that fits
            try:
                row = timed_run(method, batch * 2)
            except torch.OutOfMemoryError:
                break
            finally:
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            batch *= 2
            rows.append({**row, "measure": "larger batch"})
            print(rows[-1], flush=True)
    best = {m: max((r for r in rows if r["method"] == m), key=lambda r: r["tokens_per_s"]) for m in ("full", "h2o")}
    same = {r["method"]: r for r in rows if r["measure"] == "same batch"}
    summary = {"latency_full_over_h2o_same_batch": round(same["full"]["latency_s"] / same["h2o"]["latency_s"], 2),
               "best_throughput_h2o_over_full": round(best["h2o"]["tokens_per_s"] / best["full"]["tokens_per_s"], 2),
               "largest_batch": {m: best[m]["batch"] for m in best}}
    print(json.dumps(summary))
    meta = {"command": args.command_line, "shape": args.shape, "dtype": str(dtype),
            "prompt": args.prompt, "new_tokens": args.new_tokens, "budget": budget, "summary": summary,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}
    write_results(args.out, "batch", rows, ["method", "measure", "batch", "latency_s", "tokens_per_s", "kv_MiB"], meta)
    write_plot(args.out, "batch", rows, "batch", "tokens_per_s", "method", "throughput vs batch size")
