"""Bridge to NVIDIA's kvpress, which has to live in a virtual environment of its own.

kvpress 0.5.5 requires transformers < 5.3 and this project pins 5.24, so the two cannot share
an environment. This one file has two halves, and imports only the standard library at module
level so that both environments can load it:

  - the worker (`main`, run as a script by the kvpress venv's python: `[python, __file__]`) reads
    one JSON job on stdin, loads the model once, runs the job's tasks and writes one JSON object
    on stdout. torch, transformers and kvpress are imported inside its functions.
  - the client (`worker_for`, `run_tasks`), imported from our environment, resolves which python
    to use and spawns the worker.

Both sides see identical inputs: the caller renders and tokenizes with our tokenizer and passes
token ids; the worker never tokenizes. Budgets are given as `kept` slots per layer and KV head
(what our H2OCache's `budget` means), and turned into kvpress's compression_ratio here.

Making the environment (outside the repository; torch first, pinned, so pip takes the CPU build
instead of pulling a CUDA one):

    python3 -m venv ~/kvpress-venv
    ~/kvpress-venv/bin/pip install torch==2.13.0
    ~/kvpress-venv/bin/pip install kvpress==0.5.5      # brings transformers 5.2.0

then pass `--kvpress-python ~/kvpress-venv/bin/python` or set H2O_KVPRESS_PYTHON.

Job (stdin):
    {"model": folder, "dtype": "float32", "device": "cpu", "threads": 2,
     "tasks": [{"kind": "generate", "press": "ObservedAttentionPress", "kept": 512,
                "input_ids": [...], "max_new_tokens": 64, "eos_token_ids": [2]},
               {"kind": "compress_nll", "press": "SnapKVPress", "kept": 717,
                "context_ids": [...], "continuation_ids": [...]}]}
Result (stdout): {"versions": {...}, "results": [one dict per task, in order]}
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENV_VAR = "H2O_KVPRESS_PYTHON"
KVPRESS_VERSION = "0.5.5"
MAKE_VENV = ("python3 -m venv ~/kvpress-venv && ~/kvpress-venv/bin/pip install torch==2.13.0 && "
             f"~/kvpress-venv/bin/pip install kvpress=={KVPRESS_VERSION}")
# ObservedAttentionPress scores by the attention weights the layer returns, which only eager
# attention materialises; the others compute what they need themselves and run on sdpa.
EAGER_PRESSES = ("ObservedAttentionPress",)


# ---------------------------------------------------------------------------------------------
# Client: runs in our environment


def find_python(arg=None):
    """The kvpress venv's python: `arg` (--kvpress-python), else $H2O_KVPRESS_PYTHON; None when
    neither is given or the file is not there (callers print `skip_message()` and go on)."""
    from ..common import venv_python  # not at the top: the worker half runs where this package is not

    return venv_python(arg, ENV_VAR)


def skip_message(what="kvpress arms"):
    return (f"skipping the {what}: no kvpress environment (pass --kvpress-python PATH or set {ENV_VAR}; "
            f"make one with: {MAKE_VENV})")


def model_folder(model):
    """The folder a loaded model came from (config.json there), or None: the worker loads the
    same weights from disk, so models built in memory or read from a GGUF cannot be compared."""
    folder = getattr(model, "name_or_path", "") or ""
    return folder if folder and (Path(folder) / "config.json").is_file() else None


def worker_for(arg, model, what="kvpress arms"):
    """(python, model folder) to run `model`'s kvpress arms with, or None after printing one line
    saying why they are skipped."""
    python, folder = find_python(arg), model_folder(model)
    given = arg or os.environ.get(ENV_VAR)
    if python is None and given:
        print(f"skipping the {what}: {given} (the kvpress venv's python) does not exist; make it with: {MAKE_VENV}",
              flush=True)
    elif python is None:
        print(skip_message(what), flush=True)
    elif folder is None:
        print(f"skipping the {what}: the kvpress worker loads the model from a transformers folder, and "
              f"this one was not loaded from one", flush=True)
    return (python, folder) if python and folder else None


def run_job(python, job, timeout=3600):
    """Run `job` (a dict, see the module docstring) in the kvpress venv; returns its result dict.
    The worker's stderr (warnings, progress) passes through to ours."""
    proc = subprocess.run([python, str(Path(__file__).resolve())], input=json.dumps(job), text=True,
                          stdout=subprocess.PIPE, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kvpress worker ({python}) failed with exit code {proc.returncode}; see its stderr above")
    return json.loads(proc.stdout)


def run_tasks(worker, model, tasks):
    """Run `tasks` in the kvpress venv on the weights `model` was loaded from, with its dtype and
    device and our thread count; `worker` is what worker_for returned. Returns the result dict."""
    import torch  # our environment's: this half never runs in the kvpress venv

    python, folder = worker
    return run_job(python, {"model": folder, "dtype": str(model.dtype), "device": str(model.device),
                            "threads": torch.get_num_threads(), "tasks": tasks})


def kept_to_ratio(kept, n_tokens):
    """kvpress's compression_ratio that keeps exactly `kept` of `n_tokens` tokens.

    kvpress keeps int(n_tokens * (1 - ratio)); 1 - kept / n_tokens can land a rounding error
    below `kept` and truncate to kept - 1, so aim half a token above it."""
    if kept >= n_tokens:
        return 0.0
    return 1.0 - (kept + 0.5) / n_tokens


# ---------------------------------------------------------------------------------------------
# Worker: runs in the kvpress environment (torch, transformers < 5.3, kvpress)


def load(job):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job.get("dtype", "float32").removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype, attn_implementation="sdpa")
    model.to(job.get("device", "cpu")).eval().requires_grad_(False)
    return model


def make_press(model, task, n_tokens):
    """The press named by the task, at the ratio that keeps task["kept"] of n_tokens (or at
    task["compression_ratio"]); switches the model to the attention the press needs."""
    import kvpress

    ratio = task["compression_ratio"] if "compression_ratio" in task else kept_to_ratio(task["kept"], n_tokens)
    name = task["press"]
    attn = "eager" if name in EAGER_PRESSES else "sdpa"
    if model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    return getattr(kvpress, name)(compression_ratio=ratio), ratio


def cache_slots(cache):
    """Kept tokens per layer (the same for every KV head: kvpress keeps top-k per head)."""
    return [layer.keys.shape[2] for layer in cache.layers]


def cache_bytes(cache):
    return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in cache.layers)


def run_generate(model, task):
    """Prefill input_ids under the press (kvpress compresses each layer right after its
    attention, so the first token comes from the uncompressed prefill, as in kvpress's own
    pipeline), then greedy-decode at the true positions with no further compression."""
    import torch
    from transformers import DynamicCache

    device = model.device
    ids = torch.tensor([task["input_ids"]], device=device)
    n = ids.shape[1]
    press, ratio = make_press(model, task, n)
    eos = set(task.get("eos_token_ids") or [])
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model):
        token = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
    ttft = time.perf_counter() - start
    slots, kv = cache_slots(cache), cache_bytes(cache)
    tokens = [token.item()]
    start = time.perf_counter()
    for i in range(task["max_new_tokens"] - 1):
        if tokens[-1] in eos:
            break
        position = torch.tensor([[n + i]], device=device)
        logits = model(token[:, None], past_key_values=cache, position_ids=position).logits
        token = logits[:, -1].argmax(-1)
        tokens.append(token.item())
    decode_s = time.perf_counter() - start
    steps = len(tokens) - 1
    return {"n_tokens": n, "compression_ratio": ratio, "kept_min": min(slots), "kept_max": max(slots),
            "ttft_s": ttft, "decode_s": decode_s, "decode_tok_s": steps / decode_s if steps else 0.0,
            "kv_bytes": kv, "tokens": tokens}


def run_compress_nll(model, task):
    """Prefill context_ids [n] under the press, then the mean NLL of continuation_ids[1:] given
    everything before, with continuation_ids[:-1] fed at their true positions n, n+1, ... over
    the compressed cache (bottom-right causal: the cache's length sets cache_position)."""
    import torch
    from transformers import DynamicCache

    device = model.device
    context = torch.tensor([task["context_ids"]], device=device)
    continuation = torch.tensor([task["continuation_ids"]], device=device)
    n, m = context.shape[1], continuation.shape[1] - 1
    press, ratio = make_press(model, task, n)
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model):
        model.model(context, past_key_values=cache)  # the base model: no logits needed here
    slots, kv = cache_slots(cache), cache_bytes(cache)
    position_ids = torch.arange(n, n + m, device=device)[None]
    logits = model(continuation[:, :-1], past_key_values=cache, position_ids=position_ids).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[0], continuation[0, 1:]).item()
    return {"n_tokens": n, "compression_ratio": ratio, "kept_min": min(slots), "kept_max": max(slots),
            "kv_bytes": kv, "nll": nll, "seconds": time.perf_counter() - start}


TASKS = {"generate": run_generate, "compress_nll": run_compress_nll}


def warm_up(model):
    """One small untimed forward: the first call of a fresh process pays for allocations."""
    import torch

    model(torch.zeros(1, 8, dtype=torch.long, device=model.device))


def main():
    job = json.load(sys.stdin)
    out = sys.stdout
    # Libraries may print; only our one JSON object may reach stdout.
    with contextlib.redirect_stdout(sys.stderr):
        from importlib import metadata

        import torch

        model = load(job)
        results = []
        with torch.no_grad():
            warm_up(model)
            for task in job["tasks"]:
                results.append(TASKS[task["kind"]](model, task))
        versions = {name: metadata.version(name) for name in ("kvpress", "transformers", "torch")}
    json.dump({"versions": versions, "results": results}, out)
    out.write("\n")


if __name__ == "__main__":
    # Run by path, python puts this folder first on sys.path, where this very file would shadow
    # the kvpress package it imports.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    main()
