"""OpenVINO GenAI beside h2o-chat: the `openvino-genai` wheel, in a virtual environment of its own.

A shipped engine with an H2O-style cache eviction of its own: its continuous-batching pipeline
(what `LLMPipeline(..., scheduler_config=...)` runs) reads the GGUF file directly and, with
`SchedulerConfig.use_cache_eviction`, keeps each sequence's KV cache within `max_cache_size`
tokens: a start area and a recent area that are never evicted, and between them the blocks
with the least attention summed over the steps (AggregationMode.SUM) are evicted, per layer, a
block (32 tokens on the CPU) at a time, after the prompt's prefill (no eviction during it). Like
llamacpp.py beside it, this one file has two halves and imports only the standard library at
module level:

  - the worker (`main`, run as a script by the OpenVINO venv's python) reads one JSON line of
    settings on stdin, loads the pipeline, decodes the prompt's token ids greedily (a short
    warm-up first), writes one JSON line of figures on stdout and exits;
  - the client (`decode`), imported from our environment, spawns a worker per call: each
    measurement is a process of its own.

A second job, `generate` (what `evaluate summarize --openvino` runs), decodes many prompts
greedily in one worker, one pipeline per distinct eviction setting, and reports the KV bytes each
held: allocated at the last token (OpenVINO frees and allocates its cache in blocks) and at the
peak (after the prompt's prefill, before its first eviction). Its KV cache is stored at
KV_CACHE_PRECISION u8, the CPU plugin's own default, set explicitly so that a change of default
cannot change what is measured; `bytes_per_token` measures what a token then costs.

Making the environment (outside the repository):

    python3 -m venv ~/openvino-venv && ~/openvino-venv/bin/pip install openvino-genai

then pass `--openvino ~/openvino-venv/bin/python` (or just `--openvino`, which looks there and in
$H2O_OPENVINO_PYTHON).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ENV_VAR = "H2O_OPENVINO_PYTHON"
DEFAULT_PYTHON = "~/openvino-venv/bin/python"
MAKE_VENV = "python3 -m venv ~/openvino-venv && ~/openvino-venv/bin/pip install openvino-genai"
WARMUP_TOKENS = 4
BLOCK = 32  # tokens per KV block of OpenVINO's CPU plugin: eviction and allocation go by whole blocks
KV_PRECISION = "u8"  # the CPU plugin's default KV cache precision (2026.4), made explicit
PROBE_PROMPTS = (100, 300)  # prompt lengths whose allocations give a token's bytes (twice, as a check)


class OpenVinoError(RuntimeError):
    """The worker failed (the message is its own, or its exit code and last lines of stderr)."""


# ---------------------------------------------------------------------------------------------
# Client: runs in our environment


def find_python(arg=None):
    """The OpenVINO venv's python: `arg`, else $H2O_OPENVINO_PYTHON, else ~/openvino-venv; None
    when the one chosen is not there."""
    from ..common import venv_python  # not at the top: the worker half runs where this package is not

    return venv_python(arg, ENV_VAR, DEFAULT_PYTHON)


def eviction(budget, start, recent, mode="SUM"):
    """CacheEvictionConfig's fields for a cache of `budget` tokens in all: the first `start` and the
    newest `recent` never evicted, the rest (budget - start - recent) the evictable area, scored by
    `mode` (an AggregationMode: SUM, attention summed over the steps, is H2O's accumulated score;
    NORM_SUM divides it by the steps a token has been seen). OpenVINO also wants each size a
    multiple of its KV block (32 tokens on the CPU) and says so itself; this refuses what no block
    size allows."""
    if not isinstance(budget, int):
        raise ValueError(f"OpenVINO's cache eviction keeps a number of tokens; give the budget as one, not {budget!r}")
    if min(start, recent) < 1 or start + recent >= budget:
        raise ValueError(f"OpenVINO's cache eviction needs start ({start}) and recent ({recent}) areas of at "
                         f"least one token that leave room for an evictable area in the budget ({budget})")
    return {"start_size": start, "recent_size": recent, "max_cache_size": budget, "aggregation_mode": mode}


def generate(python, gguf, tasks, threads, timeout=7200):
    """Greedy generations by OpenVINO GenAI in one worker of the venv of `python`, on the GGUF file
    `gguf`: tasks are {"prompt_ids": [...], "max_new_tokens": n, "stop": [...], "eviction": `eviction`'s
    fields or None, optionally "ignore_eos": true}. Returns {"results": [{"tokens", "kv_bytes_last",
    "kv_bytes_peak", "seconds"}, ...] in the tasks' order, "version", "schedulers": {eviction as JSON:
    SchedulerConfig text}}."""
    settings = {"kind": "generate", "model": str(gguf), "threads": threads, "tasks": tasks}
    return run_worker(python, settings, timeout)


def bytes_per_token(python, gguf, threads):
    """What one token costs in OpenVINO's KV cache (all layers and KV heads), measured: prompts of
    PROBE_PROMPTS tokens with nothing evicted, one new token each, their cache allocated at that
    token divided by the tokens its whole blocks hold. The two must agree (else the block size is
    not BLOCK and this count would be wrong: OpenVinoError)."""
    tasks = [{"prompt_ids": list(range(1000, 1000 + n)), "max_new_tokens": 1, "stop": [], "eviction": None}
             for n in PROBE_PROMPTS]
    results = generate(python, gguf, tasks, threads)["results"]
    per_token = {r["kv_bytes_last"] / (BLOCK * -(-(n + 1) // BLOCK)) for n, r in zip(PROBE_PROMPTS, results)}
    if len(per_token) != 1 or not float(next(iter(per_token))).is_integer():
        raise OpenVinoError(f"OpenVINO's cache did not grow by whole blocks of {BLOCK} tokens: {per_token} bytes a token")
    return int(per_token.pop())


def split(budget):
    """start and recent areas for a cache of `budget` tokens (a multiple of BLOCK, at least 3 blocks):
    one block of start tokens (OpenVINO's smallest; h2o keeps 4 sinks) and half of the rest, in whole
    blocks, recent (h2o's default split), the evictable area the remainder."""
    recent = max(BLOCK, (budget - BLOCK) // 2 // BLOCK * BLOCK)
    return BLOCK, recent


def decode(python, gguf, prompt_ids, new_tokens, threads, cache_eviction=None, timeout=900):
    """Greedy decode of `new_tokens` tokens after `prompt_ids` (a list of token ids, prefilled
    first) by OpenVINO GenAI on the CPU, in a fresh worker process of the venv of `python`, on
    the GGUF file `gguf`, with `threads` inference threads; end-of-text ignored, so every run
    decodes the same count. cache_eviction: `eviction(...)`'s fields, or None for none.

    Returns the worker's figures: decode_tok_s (wall clock from the first generated token to the
    last, over a token streamer: tokens after the first / seconds), tpot_tok_s (1000 / OpenVINO's
    own mean time per output token, a check on the first), ttft_s (its prefill), new_tokens,
    tokens (the ids), kv_MiB (its KV cache in use at the last token), scheduler (its
    SchedulerConfig as it prints it), version. OpenVinoError when the worker fails."""
    settings = {"model": str(gguf), "prompt_ids": list(prompt_ids), "new_tokens": new_tokens, "threads": threads,
                "eviction": cache_eviction}
    return run_worker(python, settings, timeout)


def run_worker(python, settings, timeout):
    """A fresh worker of the venv of `python` given `settings` (one JSON line): its figures."""
    try:
        done = subprocess.run([python, str(Path(__file__).resolve())], input=json.dumps(settings) + "\n",
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OpenVinoError(f"OpenVINO's worker did not finish within {timeout} s") from None
    return worker_result(done.returncode, done.stdout, done.stderr)


def worker_result(returncode, stdout, stderr):
    """The figures of a finished worker: its last stdout line, a JSON object. OpenVinoError with
    its own message when that object is {"error": ...}, or with its exit code, the last lines of
    stderr and how to make the venv when it wrote none."""
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    if isinstance(result, dict) and "error" in result:
        raise OpenVinoError(f"OpenVINO GenAI failed: {result['error']}")
    if returncode or not isinstance(result, dict):
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise OpenVinoError(f"OpenVINO's worker exited with {returncode} and no figures ({tail}); "
                            f"make its venv with: {MAKE_VENV}")
    return result


# ---------------------------------------------------------------------------------------------
# Worker: runs in the OpenVINO venv


def scheduler_config(genai, cache_eviction):
    """The SchedulerConfig of one run, from the module `genai` (openvino_genai): its defaults (KV
    cache allocated as it grows, no prefix caching), with the cache eviction `cache_eviction`
    (`eviction`'s fields) on, or off for None."""
    config = genai.SchedulerConfig()
    config.use_cache_eviction = cache_eviction is not None
    if cache_eviction is not None:
        fields = dict(cache_eviction)
        fields["aggregation_mode"] = getattr(genai.AggregationMode, fields["aggregation_mode"])
        config.cache_eviction_config = genai.CacheEvictionConfig(**fields)
    return config


def measure(genai, ov, settings):
    """In the worker: load, warm up, one timed greedy decode (see `decode`)."""
    import numpy

    config = scheduler_config(genai, settings["eviction"])
    pipe = genai.ContinuousBatchingPipeline(settings["model"], config, "CPU",
                                            {"INFERENCE_NUM_THREADS": settings["threads"]})

    def greedy(n):
        g = genai.GenerationConfig()
        g.max_new_tokens, g.do_sample, g.ignore_eos = n, False, True
        return g

    prompt = numpy.array([settings["prompt_ids"]], dtype=numpy.int64)
    pipe.generate([ov.Tensor(prompt[:, :16])], [greedy(WARMUP_TOKENS)])  # untimed: first-call costs

    class Clock(genai.StreamerBase):
        """Each generated token's arrival time, and the cache in use when it came (percent, bytes)."""

        def __init__(self):
            super().__init__()
            self.times, self.usage = [], None

        def write(self, token):
            self.times.append(time.perf_counter())
            metrics = pipe.get_metrics()
            self.usage = (metrics.cache_usage, metrics.kv_cache_size_in_bytes)
            return genai.StreamingStatus.RUNNING

        def end(self):
            pass

    clock = Clock()
    result = pipe.generate([ov.Tensor(prompt)], [greedy(settings["new_tokens"])], clock)[0]
    metrics, times = result.perf_metrics, clock.times
    percent, kv_bytes = clock.usage
    return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "tpot_tok_s": 1000 / metrics.get_tpot().mean,
            "ttft_s": metrics.get_ttft().mean / 1000, "new_tokens": len(times),
            "tokens": list(result.m_generation_ids[0]), "kv_MiB": percent / 100 * kv_bytes / 2**20,
            "scheduler": config.to_string(), "version": genai.__version__}


def generate_all(genai, ov, settings):
    """In the worker: the `generate` job. Tasks with the same eviction share one pipeline (loading
    one costs seconds); each task's KV bytes are read after every token from the pipeline's metrics
    (cache_usage percent of kv_cache_size_in_bytes: what its blocks hold)."""
    import numpy

    results, schedulers = [None] * len(settings["tasks"]), {}
    groups = {}
    for i, task in enumerate(settings["tasks"]):
        groups.setdefault(json.dumps(task["eviction"], sort_keys=True), []).append(i)
    for key, indices in groups.items():
        config = scheduler_config(genai, json.loads(key))
        schedulers[key] = config.to_string()
        pipe = genai.ContinuousBatchingPipeline(settings["model"], config, "CPU", {
            "INFERENCE_NUM_THREADS": settings["threads"], "KV_CACHE_PRECISION": KV_PRECISION})

        class Usage(genai.StreamerBase):
            def __init__(self, pipe):
                super().__init__()
                self.pipe, self.bytes = pipe, []

            def write(self, token):
                metrics = self.pipe.get_metrics()
                self.bytes.append(round(metrics.cache_usage / 100 * metrics.kv_cache_size_in_bytes))
                return genai.StreamingStatus.RUNNING

            def end(self):
                pass

        for i in indices:
            task = settings["tasks"][i]
            g = genai.GenerationConfig()
            g.max_new_tokens, g.do_sample, g.ignore_eos = task["max_new_tokens"], False, task.get("ignore_eos", False)
            if task["stop"]:
                g.stop_strings = set(task["stop"])
            usage, start = Usage(pipe), time.perf_counter()
            prompt = ov.Tensor(numpy.array([task["prompt_ids"]], dtype=numpy.int64))
            result = pipe.generate([prompt], [g], usage)[0]
            results[i] = {"tokens": [int(t) for t in result.m_generation_ids[0]], "kv_bytes_last": usage.bytes[-1],
                          "kv_bytes_peak": max(usage.bytes), "seconds": time.perf_counter() - start}
    return {"results": results, "version": genai.__version__, "schedulers": schedulers}


def main():
    settings = json.loads(sys.stdin.readline())
    try:
        import openvino
        import openvino_genai

        job = generate_all if settings.get("kind") == "generate" else measure
        figures = job(openvino_genai, openvino, settings)
    except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    # Run by path, python puts this folder first on sys.path, where our own modules would shadow
    # installed ones (this very file is named openvino.py); the worker needs none of them.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
