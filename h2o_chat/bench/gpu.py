"""`python -m h2o_chat.bench gpu`: the compiled decode step on a GPU (CUDA graphs) against the eager
one and against transformers' forward with a DynamicCache, at batch 1 and 8, for the embedded model
and a 1B-class Q4_0 GGUF (user-gguf's random Llama-3.2-1B-shaped file); and a check that the
compiled step computes what the eager one does.

Per model and batch, three arms decode greedily after --seen tokens of random ids per row:

    eager      the app's lean step (models/decode.py) over H2O caches at --budget: one cache at
               batch 1, else one per conversation stacked in an arena (chat/batch.py, as the app's
               batcher does)
    compiled   the same, through the app's background compiler (models/compile.py: on CUDA,
               inductor with CUDA graphs, mode="reduce-overhead"; elsewhere inductor's default);
               its time to compiled is reported, and whether every timed step ran compiled
    dynamic    transformers' forward over a DynamicCache (no eviction: it grows), batch rows in one
               tensor

Timed windows of --steps tokens alternate between the arms (--repeats each, medians reported),
CUDA synchronized around each window. tokens_per_s counts every row's tokens.

The check (the model's weights dequantized, float32 throughout): two caches fed the same ids, one
stepped eagerly and one compiled, the same fixed tokens for --check-tokens steps (the caches full,
every step evicts; --quick passes twice the budget, so positions are re-laid too): the logits
within --atol (1e-5, as tests/test_decode.py holds the compiled step), the kept token ids of every
layer identical, and at least one step run compiled. A failed check exits 1. Why not on the int4 weights: their kernels take bf16 rows, so a
float32 difference of one ulp in the residual stream (inductor fuses the elementwise ops) can round
a kernel's input to the next bf16 value: measured on the tiny Q4_0 file, float32, one step in 60
differed by 2**-10 (the kept ids equal), the other 59 bitwise.

`--device cpu --quick` runs it on a tiny random Q4_0 GGUF on this CPU (tests/test_bench_gpu.py):
the command end to end, without CUDA graphs.
"""

import statistics
import time
from pathlib import Path

import torch

from ..cache.h2o import H2OCache
from ..chat.batch import Arena, Request
from ..models.compile import StepCompiler
from ..models.decode import Decoder
from ..models.load import load_model
from .common import write_results
from .random_gguf import LLAMA_1B, TINY, written

MODELS = {"embedded": None, "llama-1b": LLAMA_1B, "tiny": TINY}  # a shape: a random Q4_0 GGUF of it


def model_file(name, out):
    """load_model's spec for `name`: None (the embedded model) or a random Q4_0 GGUF, written once into `out`."""
    shape = MODELS[name]
    return None if shape is None else written(Path(out) / f"random-{name}-Q4_0.gguf", shape, "Q4_0")


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def prompts(model, rows, seen, seed=0):
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (rows, seen), generator=torch.Generator().manual_seed(seed)).to(model.device)


@torch.no_grad()
def fed_caches(model, ids, budget):
    """One H2O cache per row of ids [rows, seen], each fed its row."""
    caches = []
    for row in ids:
        cache = H2OCache(model, budget=budget)
        model(row[None], cache=cache)
        caches.append(cache)
    return caches


def lean_stepper(decoder, caches):
    """step(tokens [rows, 1]) -> logits [rows, vocab]: the lean step, alone or stacked in an arena."""
    if len(caches) == 1:
        return lambda tokens: decoder.forward(tokens, caches[0])
    arena = Arena()
    for cache in caches:
        arena.join(cache)
    return lambda tokens: arena.step(decoder, [Request(c, tokens[i : i + 1]) for i, c in enumerate(caches)])


def dynamic_stepper(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return lambda tokens: model(tokens, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def wait_compiled(compiler, timeout):
    """Block until `compiler` has compiled what was asked (a deadline: --compile-timeout)."""
    if not compiler.wait(timeout):
        raise SystemExit(f"bench gpu: compiling took over {timeout} s (--compile-timeout)")
    if compiler.failed:
        raise SystemExit(f"bench gpu: {compiler.failed}")


@torch.no_grad()
def time_arms(model, compiler, name, batch, args):
    """Rows of the table for one model at one batch size."""
    ids = prompts(model, batch, args.seen)
    compiled = Decoder(model).switch_to(compiler.step())
    steppers = {"eager": lean_stepper(Decoder(model), fed_caches(model, ids, args.budget)),
                "compiled": lean_stepper(compiled, fed_caches(model, ids, args.budget)),
                "dynamic": dynamic_stepper(model, ids)}
    tokens = {arm: ids[:, -1:] for arm in steppers}
    start = time.perf_counter()
    tokens["compiled"] = steppers["compiled"](tokens["compiled"]).argmax(-1, keepdim=True)  # asks for its shape
    wait_compiled(compiler, args.compile_timeout)
    to_compiled = time.perf_counter() - start
    for arm, step in steppers.items():  # warm-up (CUDA graphs record in this thread at their first runs)
        for _ in range(3):
            tokens[arm] = step(tokens[arm]).argmax(-1, keepdim=True)
    times, ran = {arm: [] for arm in steppers}, set()
    for _ in range(args.repeats):
        for arm, step in steppers.items():
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                tokens[arm] = step(tokens[arm]).argmax(-1, keepdim=True)
                if arm == "compiled":
                    ran.add(compiled.compiled.kind)
            sync(args.device)
            times[arm].append(time.perf_counter() - start)
    eager_s = statistics.median(times["eager"])
    rows = []
    for arm, seconds in times.items():
        t = statistics.median(seconds)
        rows.append({"model": name, "batch": batch, "arm": arm, "ms_per_step": round(1000 * t / args.steps, 3),
                     "tokens_per_s": round(batch * args.steps / t, 1), "vs_eager": f"{eager_s / t:.2f}x",
                     "ran": ("+".join(sorted(ran)) if arm == "compiled" else arm),
                     "to_compiled_s": round(to_compiled, 1) if arm == "compiled" else ""})
        print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def check(model, compiler, tokens, budget, seen, atol, timeout):
    """Compiled against eager over `tokens` fixed tokens with evictions (see the module's notes):
    a dict with `ok` and what it found."""
    ids = prompts(model, 1, seen, seed=1)
    (ours, theirs), vocab = fed_caches(model, ids.expand(2, -1), budget), model.config.get_text_config(decoder=True).vocab_size
    eager, compiled = Decoder(model), Decoder(model).switch_to(compiler.step())
    worst, ran_compiled = 0.0, 0
    for t in range(tokens):
        token = torch.full((1, 1), (7 * t + 3) % vocab, device=model.device)
        expected, got = eager.forward(token, theirs), compiled.forward(token, ours)
        if t == 0:
            wait_compiled(compiler, timeout)
        ran_compiled += compiled.compiled.kind == "compiled"
        worst = max(worst, float((got - expected).abs().max()))
    kept = all(torch.equal(ours.token_ids(i), theirs.token_ids(i)) for i in range(len(ours.layers)))
    evicted = ours.get_seq_length() - ours.slots_used()
    return {"ok": bool(ran_compiled > 0 and worst <= atol and kept), "tokens": tokens, "compiled_steps": ran_compiled,
            "max_abs_diff": worst, "atol": atol, "kept_ids_equal": kept, "evicted_per_head": evicted}


def run(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: needs a CUDA GPU (--device cpu runs it here, without CUDA graphs); none here, skipped.")
        write_results(args.out, "gpu", [], ["model"], {"command": args.command_line, "skipped": "no CUDA GPU"})
        return
    rows, checks = [], []
    for name in args.models:
        spec = model_file(name, args.out)
        model, _ = load_model(spec, dtype=args.dtype, device=args.device)
        compiler = StepCompiler(model)
        for batch in args.batches:
            rows += time_arms(model, compiler, name, batch, args)
        del compiler, model
        model, _ = load_model(spec, dtype="float32", quantization="none", device=args.device)  # see the module's notes
        compiler = StepCompiler(model)
        checks.append({"model": name, **check(model, compiler, args.check_tokens, args.budget, args.seen, args.atol,
                                              args.compile_timeout),
                       "compiles_s": [round(s, 1) for _, s in compiler.compiles]})
        print(checks[-1], flush=True)
        del compiler, model
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta = {"command": args.command_line, "device": device, "budget": args.budget, "seen": args.seen,
            "steps": args.steps, "repeats": args.repeats, "dtype": args.dtype, "checks": checks,
            "cudagraph_skips": dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0),
            "note": "tokens_per_s: every row's tokens; ran: what the compiled arm's timed steps ran; "
                    "checks: compiled against eager in float32 (see bench/gpu.py)"}
    write_results(args.out, "gpu", rows, ["model", "batch", "arm", "ms_per_step", "tokens_per_s", "vs_eager", "ran",
                                          "to_compiled_s"], meta)
    failed = [c["model"] for c in checks if not c["ok"]]
    for c in checks:
        print(f"check {c['model']}: {'ok' if c['ok'] else 'FAILED'} ({c['compiled_steps']} of {c['tokens']} steps "
              f"compiled, max |diff| {c['max_abs_diff']:.2e} (atol {c['atol']:g}), kept ids equal: {c['kept_ids_equal']})")
    if failed:
        raise SystemExit(f"bench gpu: the compiled step differs from the eager one ({', '.join(failed)})")
