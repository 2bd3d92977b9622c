"""`python -m h2o_chat.bench decode`: time per generated token and KV bytes after N tokens seen,
for DynamicCache and H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict),
through transformers' forward or the app's lean step ('+lean'), for each of --quantization's
weights (none: float in --dtype; auto: the embedded GGUF's int4 blocks; int8; int4).

Each arm (weights x method) prefills once per length; then timed windows of decode steps
alternate between all the arms, so machine noise hits them alike. The median window is reported,
and each arm's time against the first weights' on the same method.
"""

import statistics
import time

import torch
from tqdm import tqdm

from ..models.decode import Decoder
from ..models.load import load_model
from ..models.quantize import weights_label
from .common import COMPILED, LEAN, kv_bytes, make_cache, text_tokens, write_plot, write_results


def decode_step(model, method):
    """`step(token [batch, 1], cache) -> next greedy token [batch, 1]` for `method`: the model's own
    forward, or for a '+lean' method ('h2o+lean') models/decode.py's lean step, what the app runs;
    '+compiled': the lean step with its tensor work compiled by inductor (`Decoder.compile`: its
    first full step compiles, minutes on a CPU)."""
    if method.endswith((LEAN, COMPILED)):
        decoder = Decoder(model)
        if method.endswith(COMPILED):
            decoder.compile()
        if decoder.why_not:
            raise SystemExit(f"bench: {method}: the lean step cannot run this model ({decoder.why_not})")
        return lambda token, cache: decoder.forward(token, cache).argmax(-1, keepdim=True)
    return lambda token, cache: model(token, cache=cache).logits[:, -1:].argmax(-1)


@torch.no_grad()
def greedy_steps(step, token, cache, steps):
    """`steps` greedy decode steps (`decode_step`'s) from `token` [batch, 1]; the last token and seconds."""
    start = time.perf_counter()
    for _ in range(steps):
        token = step(token, cache)
    return token, time.perf_counter() - start


def run(args):
    models = {q: load_model(args.model, dtype=args.dtype, quantization=q) for q in args.quantization}
    tokenizer = models[args.quantization[0]][1]
    text = text_tokens(tokenizer, args.text, max(args.seen))
    arms = [(q, m) for m in args.methods for q in args.quantization]
    rows = []
    for seen in tqdm(args.seen, desc="tokens seen"):
        caches, tokens, first, times = {}, {}, {}, {arm: [] for arm in arms}
        steps = {(q, m): decode_step(models[q][0], m) for q, m in arms}
        for q, m in arms:
            model = models[q][0]
            budget = seen + (args.repeats + 1) * args.steps + 2 if m == "h2o-noevict" else args.budget
            caches[q, m] = make_cache(model, "h2o" if m == "h2o-noevict" else m, budget=budget)
            with torch.no_grad():
                tokens[q, m] = model(text[:, :seen], cache=caches[q, m]).logits[:, -1:].argmax(-1)
            tokens[q, m], first[q, m] = greedy_steps(steps[q, m], tokens[q, m], caches[q, m], 1)  # warm-up, apart
        for _ in range(args.repeats):
            for arm in arms:
                tokens[arm], seconds = greedy_steps(steps[arm], tokens[arm], caches[arm], args.steps)
                times[arm].append(seconds / args.steps)
        base_method = statistics.median(times[args.quantization[0], args.methods[0]])
        for q, m in arms:
            t, base_weights = statistics.median(times[q, m]), statistics.median(times[args.quantization[0], m])
            rows.append({"seen": seen, "quantization": q, "method": m, "ms_per_token": round(1000 * t, 2),
                         "tokens_per_s": round(1 / t, 2), f"vs_{args.methods[0]}": f"{base_method / t:.2f}x",
                         f"vs_{args.quantization[0]}": f"{t / base_weights:.2f}x",
                         "kv_MiB": round(kv_bytes(caches[q, m]) / 2**20, 2), "first_step_s": round(first[q, m], 2)})
            print(rows[-1], flush=True)
        del caches
    meta = {"command": args.command_line, "budget": args.budget, "steps": args.steps, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "dtype": {q: str(m.dtype) for q, (m, _) in models.items()},
            "weights": {q: weights_label(m) for q, (m, _) in models.items()},
            "note": f"vs_{args.quantization[0]}: ms per token against the {args.quantization[0]} weights' (same method); "
                    "first_step_s: the untimed first step (a '+compiled' arm compiles in it)"}
    columns = ["seen", "quantization", "method", "ms_per_token", "tokens_per_s", f"vs_{args.methods[0]}",
               f"vs_{args.quantization[0]}", "kv_MiB", "first_step_s"]
    write_results(args.out, "decode", rows, columns, meta)
    for row in rows:
        row["arm"] = f"{row['method']} {row['quantization']}"
    write_plot(args.out, "decode-speed", rows, "seen", "tokens_per_s", "arm", "decode speed vs tokens seen")
    write_plot(args.out, "decode-memory", rows, "seen", "kv_MiB", "arm", "KV cache size vs tokens seen")
