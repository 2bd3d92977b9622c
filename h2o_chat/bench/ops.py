"""`python -m h2o_chat.bench ops`: aten ops (and this project's own, h2o_chat::attend_one, rotate_one
and int4_mm: one op each) and host syncs per decode token, after --seen tokens
(the profiler), for DynamicCache, h2o, full and the app's lean step ('+lean'), and where the time
of a token goes: milliseconds per token without the profiler (the median of --steps), and the
profiler's self time split into the weights' matmuls, the attention (its bmm, softmax and the
score's baddbmm) and every other op (the profiler adds its own cost to each op, most to the
smallest ones, so the split is a proportion, not a sum of the unprofiled time).

A '+compiled' arm (inductor's step, compiled in its first warm-up step, minutes on a CPU) has
few aten ops; its profiled time is split further into what compiled code pays for besides them:
Dynamo's guards (checked before each call), the graph's wrapper (the Python that calls the kernels,
its self time) and inductor's own kernels (compiled with `cpp.enable_kernel_profile`, one record
each: negligible without the profiler, so its ms_per_token stands).

A decode step is the model's forward on the last token, the greedy pick, and the one `.item()`
that streams the token (what ChatSession does). h2o's budget is below --seen, so it evicts at
every step.
"""

import contextlib
import statistics
import time

import torch

from ..models.load import load_model
from ..models.quantize import weights_label
from .common import COMPILED, make_cache, text_tokens, write_results
from .decode import decode_step


class SyncCounter:
    """Counts the host syncs Python code asks for while active: `.tolist()` and `.numpy()` (a
    copy to the host); `.item()` and `bool(tensor)` reach the profiler as aten::_local_scalar_dense
    and are counted there (see `count_ops`), so they are not counted twice here."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, self._counting(method))
        return self

    def _counting(self, method):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return method(tensor, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


MATMULS = {"aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm", "aten::_weight_int8pack_mm",
           "aten::mm", "aten::addmm", "h2o_chat::int4_mm"}
ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::_softmax", "h2o_chat::attend_one"}
OWN_OPS = "h2o_chat::"  # this project's own ops (native/): counted with aten's
# the profiler's records of compiled code (torch 2.13), by name: what a compiled step runs besides aten ops
GUARDS = "TorchDynamo Cache Lookup"
WRAPPER = "## Call CompiledFxGraph"  # a prefix: the graph's hash follows
KERNEL = "cpp_fused"  # inductor's C++ kernels, named graph_<i>_cpp_fused_<ops>


def kind_of(name):
    """Which part of a step's time a profiler record's self time is (None: not counted)."""
    if name.startswith(("aten::", OWN_OPS)):
        return "matmul" if name in MATMULS else "attention" if name in ATTENTION else "rest"
    if name == GUARDS:
        return "guards"
    if name.startswith(WRAPPER):
        return "wrapper"
    return "kernels" if KERNEL in name else None


def count_ops(step, steps):
    """Run `step()` `steps` times under the profiler; returns (aten ops per step, host syncs per
    step, Counter of op names, {"matmul", "attention", "rest", "guards", "wrapper", "kernels"}: self
    milliseconds per step, the last three compiled code's, see `kind_of`). Every aten call counts,
    nested ones too (a matmul that calls a bmm is two), so the figure is what the dispatcher runs,
    not what Python wrote."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with SyncCounter() as python_syncs, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    names = Counter(e.name for e in prof.events() if e.name.startswith(("aten::", OWN_OPS)))
    syncs = names["aten::_local_scalar_dense"] + python_syncs.count
    split = dict.fromkeys(("matmul", "attention", "rest", "guards", "wrapper", "kernels"), 0.0)
    for op in prof.key_averages():
        kind = kind_of(op.key)
        if kind is not None:
            split[kind] += op.self_cpu_time_total / 1e3 / steps
    return sum(names.values()) / steps, syncs / steps, names, split


def kernels_recorded(method):
    """For a '+compiled' arm: inductor compiles its kernels with a profiler record each."""
    if not method.endswith(COMPILED):
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def ms_per_step(step, steps):
    """The median wall time of `step()` over `steps` runs, in milliseconds, without the profiler."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(args):
    rows, counts, weights = [], {}, {}
    for quantization in args.quantization:
        model, tokenizer = load_model(args.model, dtype=args.dtype, quantization=quantization)
        weights[quantization] = weights_label(model)
        text = text_tokens(tokenizer, args.text, args.seen)
        for method in args.methods:
            cache, decode = make_cache(model, method, budget=args.budget), decode_step(model, method)
            with torch.no_grad():
                token = model(text, cache=cache).logits[:, -1:].argmax(-1)

                def step(cache=cache, decode=decode):
                    nonlocal token
                    token = decode(token, cache)
                    token.item()

                with kernels_recorded(method):  # warm-up: first-call paths, lazy state, a compile
                    for _ in range(2):
                        step()
                ms = ms_per_step(step, args.steps)
                ops, syncs, counts[quantization, method], split = count_ops(step, args.steps)
            rows.append({"quantization": quantization, "method": method, "ops_per_token": round(ops),
                         "syncs_per_token": round(syncs, 2), "ms_per_token": round(ms, 2),
                         **{f"profiled_ms_{kind}": round(v, 2) for kind, v in split.items()}})
    base = rows[0]
    for row in rows:
        row[f"added_vs_{base['method']}"] = row["ops_per_token"] - base["ops_per_token"]
        added = counts[row["quantization"], row["method"]] - counts[base["quantization"], base["method"]]
        row["most_added"] = ", ".join(f"{name.removeprefix('aten::')} {n / args.steps:+.0f}"
                                      for name, n in added.most_common(6))
    meta = {"command": args.command_line, "seen": args.seen, "budget": args.budget, "steps": args.steps,
            "dtype": str(model.dtype), "threads": torch.get_num_threads(), "weights": weights}
    columns = ["method", "ops_per_token", f"added_vs_{base['method']}", "syncs_per_token", "ms_per_token",
               "profiled_ms_matmul", "profiled_ms_attention", "profiled_ms_rest"]
    if any(row["method"].endswith(COMPILED) for row in rows):
        columns += ["profiled_ms_guards", "profiled_ms_wrapper", "profiled_ms_kernels"]
    columns.append("most_added")
    if len(args.quantization) > 1:
        columns.insert(0, "quantization")
    write_results(args.out, "ops", rows, columns, meta)
