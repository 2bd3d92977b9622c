"""`python -m h2o_chat.bench decode`: time per generated token and KV bytes after N tokens seen,
for DynamicCache and H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict),
through transformers' forward or the app's lean step ('+lean'), for each of --quantization's
weights (none: float in --dtype; auto: the embedded GGUF's int4 blocks; int8; int4).

Each arm (weights x method x --native) prefills once per length; then timed windows of decode steps
alternate between all the arms, so machine noise hits them alike. The median window is reported,
and each arm's time against the first weights' on the same method. `--native on,off` times the C
kernels (native/: attention, rotation, one-row int4 matmuls) against torch's ops in one process:
an `off` arm runs everything, its setup included, with H2O_CHAT_NATIVE=0.
"""

import os
import statistics
import time
from unittest import mock

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


def native_kernels(on):
    """H2O_CHAT_NATIVE as an arm wants it while its code runs (read when a Decoder, a layer's
    DecodeStep or an int4 layer's kernel is made), then as it was."""
    return mock.patch.dict(os.environ, H2O_CHAT_NATIVE="1" if on else "0")


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
    if not set(args.native) <= {"on", "off"}:
        raise SystemExit(f"bench decode: --native takes on, off or on,off (not {','.join(args.native)})")
    natives = [n == "on" for n in args.native]
    arms = [(q, m, n) for m in args.methods for q in args.quantization for n in natives]
    rows = []
    for seen in tqdm(args.seen, desc="tokens seen"):
        caches, tokens, first, times, steps = {}, {}, {}, {arm: [] for arm in arms}, {}
        for q, m, n in arms:
            model = models[q][0]
            budget = seen + (args.repeats + 1) * args.steps + 2 if m == "h2o-noevict" else args.budget
            with native_kernels(n):
                steps[q, m, n] = decode_step(model, m)
                caches[q, m, n] = make_cache(model, "h2o" if m == "h2o-noevict" else m, budget=budget)
                with torch.no_grad():
                    tokens[q, m, n] = model(text[:, :seen], cache=caches[q, m, n]).logits[:, -1:].argmax(-1)
                # warm-up, apart
                tokens[q, m, n], first[q, m, n] = greedy_steps(steps[q, m, n], tokens[q, m, n], caches[q, m, n], 1)
        for _ in range(args.repeats):
            for arm in arms:
                with native_kernels(arm[2]):
                    tokens[arm], seconds = greedy_steps(steps[arm], tokens[arm], caches[arm], args.steps)
                times[arm].append(seconds / args.steps)
        base_method = statistics.median(times[args.quantization[0], args.methods[0], natives[0]])
        for q, m, n in arms:
            t, base_weights = statistics.median(times[q, m, n]), statistics.median(times[args.quantization[0], m, n])
            rows.append({"seen": seen, "quantization": q, "method": m, "native": "on" if n else "off",
                         "ms_per_token": round(1000 * t, 2), "tokens_per_s": round(1 / t, 2),
                         f"vs_{args.methods[0]}": f"{base_method / t:.2f}x", f"vs_{args.quantization[0]}": f"{t / base_weights:.2f}x",
                         "kv_MiB": round(kv_bytes(caches[q, m, n]) / 2**20, 2), "first_step_s": round(first[q, m, n], 2)})
            print(rows[-1], flush=True)
        del caches
    meta = {"command": args.command_line, "budget": args.budget, "steps": args.steps, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "dtype": {q: str(m.dtype) for q, (m, _) in models.items()},
            "weights": {q: weights_label(m) for q, (m, _) in models.items()},
            "note": f"vs_{args.quantization[0]}: ms per token against the {args.quantization[0]} weights' (same method); "
                    "first_step_s: the untimed first step (a '+compiled' arm compiles in it)"}
    columns = ["seen", "quantization", "method", "native", "ms_per_token", "tokens_per_s", f"vs_{args.methods[0]}",
               f"vs_{args.quantization[0]}", "kv_MiB", "first_step_s"]
    write_results(args.out, "decode", rows, columns, meta)
    for row in rows:
        row["arm"] = f"{row['method']} {row['quantization']}" + ("" if len(natives) == 1 else f" native {row['native']}")
    write_plot(args.out, "decode-speed", rows, "seen", "tokens_per_s", "arm", "decode speed vs tokens seen")
    write_plot(args.out, "decode-memory", rows, "seen", "kv_MiB", "arm", "KV cache size vs tokens seen")
