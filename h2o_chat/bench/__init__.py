"""Speed and memory benchmarks: `python -m h2o_chat.bench SUBCOMMAND`.

    dialogue one long chat over the user turns of a jsonl file: per turn time to first token,
             decode tokens/s, KV bytes and RSS for ChatSession with H2O (and with the full
             cache), against a naive app that re-prefills the whole history every turn, and
             against kvpress (its H2O-like ObservedAttentionPress, re-prefilling the history
             each turn at the same budget; run in its own venv, --kvpress-python)
    decode   time per generated token and KV bytes after N tokens seen, for DynamicCache and
             H2OCache (full, h2o at a fixed budget, h2o with a budget too large to evict)
    prefill  peak memory (RSS) of prefilling a long prompt, each method in a fresh process
    prefill-speed  prefill tokens/s (interleaved repeats, medians), aten ops per token and bytes
             allocated, h2o against DynamicCache, per dtype and prompt length
    panel    what the live panel costs: render time of a long conversation's panel, and decode
             tokens/s with the panel refreshed as the app does while streaming vs not at all
    concurrent  1, 2, 4, 8 chats at once through the API (decoded in one batch) against the
             same chats one at a time: aggregate and per-chat tokens/s, TTFT (bench_concurrent.py)

Every figure comes from running the model here; results go to --out as JSON and Markdown.
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from ..cache.h2o import H2OCache
from ..chat.session import ChatSession
from ..models.decode import Decoder
from ..models.load import embedded_gguf_path, load_model
from . import concurrent as bench_concurrent
from .peers import kvpress as kvpress_worker
from .peers import llamacpp as llamacpp_worker

DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


def read_input(path):
    """A text or jsonl input's contents; a missing one ends the command with a message that says
    where the defaults live, instead of a traceback."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file. The default inputs live in ../shared/data next to the project "
                         "checkout; pass your own with --text (any UTF-8 text), --turns-file (jsonl with a "
                         "`turns` list per line) or --file.")
    return path.read_text(encoding="utf-8")


def text_tokens(tokenizer, path, n_tokens):
    """The first n_tokens tokens of a text file, [1, n_tokens]."""
    text = read_input(path)
    ids = tokenizer(text[: n_tokens * 8], return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"{path} has only {ids.shape[1]} tokens, {n_tokens} wanted")
    return ids[:, :n_tokens]


def make_cache(model, method, budget, n_sink=4, prefill_chunk=256, **kw):
    """'dynamic' (transformers' DynamicCache), 'full', 'window', 'sink', 'h2o' or 'h2o-<score>'
    (a '+lean' suffix, see `decode_step`, makes the same cache)."""
    method = method.removesuffix(LEAN)
    if method == "dynamic":
        return DynamicCache()
    policy, _, score = method.partition("-")
    return H2OCache(model, policy=policy, budget=budget, n_sink=n_sink, score=score or "sum",
                    prefill_chunk=prefill_chunk, **kw)


LEAN = "+lean"


def decode_step(model, method):
    """`step(token [batch, 1], cache) -> next greedy token [batch, 1]` for `method`: the model's own
    forward, or for a '+lean' method ('h2o+lean') decode.py's lean step, what the app runs."""
    if method.endswith(LEAN):
        decoder = Decoder(model)
        if decoder.why_not:
            raise SystemExit(f"bench: {method}: the lean step cannot run this model ({decoder.why_not})")
        return lambda token, cache: decoder.forward(token, cache).argmax(-1, keepdim=True)
    return lambda token, cache: model(token, cache=cache).logits[:, -1:].argmax(-1)


def kv_bytes(cache):
    if isinstance(cache, H2OCache):
        return cache.kv_bytes()
    return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in cache.layers)


@torch.no_grad()
def greedy_steps(step, token, cache, steps):
    """`steps` greedy decode steps (`decode_step`'s) from `token` [batch, 1]; the last token and seconds."""
    start = time.perf_counter()
    for _ in range(steps):
        token = step(token, cache)
    return token, time.perf_counter() - start


def markdown_table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def write_results(out, name, rows, columns, meta):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown_table(rows, columns)
    (out / f"{name}.md").write_text(f"Command: `{meta['command']}`\n\n{table}\n")
    print(table)


def write_plot(out, name, rows, x, y, series, title, logy=False):
    """One line per value of rows[series], y against x, saved as out/name.png. Rows whose x or y
    is missing ('' or None) are skipped, so one table can feed several plots."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=120)
    for label in dict.fromkeys(r[series] for r in rows):
        points = [(r[x], r[y]) for r in rows if r[series] == label and r[x] not in ("", None) and r[y] not in ("", None)]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=str(label))
    ax.set(xlabel=x, ylabel=y, title=title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(out) / f"{name}.png")
    plt.close(fig)


def cmd_decode(args):
    """Each method prefills once per length; then timed windows of decode steps alternate between
    the methods, so machine noise hits them alike. The median window is reported."""
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    text = text_tokens(tokenizer, args.text, max(args.seen))
    rows = []
    for seen in tqdm(args.seen, desc="tokens seen"):
        caches, tokens, times = {}, {}, {m: [] for m in args.methods}
        steps = {m: decode_step(model, m) for m in args.methods}
        for m in args.methods:
            budget = seen + (args.repeats + 1) * args.steps + 2 if m == "h2o-noevict" else args.budget
            caches[m] = make_cache(model, "h2o" if m == "h2o-noevict" else m, budget=budget)
            with torch.no_grad():
                tokens[m] = model(text[:, :seen], cache=caches[m]).logits[:, -1:].argmax(-1)
            tokens[m], _ = greedy_steps(steps[m], tokens[m], caches[m], 1)  # warm-up step, untimed
        for _ in range(args.repeats):
            for m in args.methods:
                tokens[m], seconds = greedy_steps(steps[m], tokens[m], caches[m], args.steps)
                times[m].append(seconds / args.steps)
        base = statistics.median(times[args.methods[0]])
        for m in args.methods:
            t = statistics.median(times[m])
            rows.append({"seen": seen, "method": m, "ms_per_token": round(1000 * t, 2),
                         "tokens_per_s": round(1 / t, 2), f"vs_{args.methods[0]}": f"{base / t:.2f}x",
                         "kv_MiB": round(kv_bytes(caches[m]) / 2**20, 2)})
            print(rows[-1], flush=True)
        del caches
    meta = {"command": args.command_line, "budget": args.budget, "dtype": str(model.dtype),
            "steps": args.steps, "repeats": args.repeats, "threads": torch.get_num_threads()}
    write_results(args.out, "decode", rows, ["seen", "method", "ms_per_token", "tokens_per_s", f"vs_{args.methods[0]}",
                                             "kv_MiB"], meta)
    write_plot(args.out, "decode-speed", rows, "seen", "tokens_per_s", "method", "decode speed vs tokens seen")
    write_plot(args.out, "decode-memory", rows, "seen", "kv_MiB", "method", "KV cache size vs tokens seen")


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


def count_ops(step, steps):
    """Run `step()` `steps` times under the profiler; returns (aten ops per step, host syncs per
    step, Counter of op names). Every aten call counts, nested ones too (a matmul that calls a
    bmm is two), so the figure is what the dispatcher runs, not what Python wrote."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with SyncCounter() as python_syncs, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    names = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    syncs = names["aten::_local_scalar_dense"] + python_syncs.count
    return sum(names.values()) / steps, syncs / steps, names


def cmd_ops(args):
    """Ops and host syncs per decode token, after --seen tokens: a decode step is the model's
    forward on the last token, the greedy pick, and the one `.item()` that streams the token (what
    ChatSession does). h2o's budget is below --seen, so it evicts at every step."""
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    text = text_tokens(tokenizer, args.text, args.seen)
    rows, counts = [], {}
    for method in args.methods:
        cache, decode = make_cache(model, method, budget=args.budget), decode_step(model, method)
        with torch.no_grad():
            token = model(text, cache=cache).logits[:, -1:].argmax(-1)

            def step(cache=cache, decode=decode):
                nonlocal token
                token = decode(token, cache)
                token.item()

            for _ in range(2):  # warm-up: first-call paths and lazily built state
                step()
            ops, syncs, counts[method] = count_ops(step, args.steps)
        rows.append({"method": method, "ops_per_token": round(ops), "syncs_per_token": round(syncs, 2)})
    base = rows[0]
    for row in rows:
        row[f"added_vs_{base['method']}"] = row["ops_per_token"] - base["ops_per_token"]
        added = counts[row["method"]] - counts[base["method"]]
        row["most_added"] = ", ".join(f"{name[6:]} {n / args.steps:+.0f}" for name, n in added.most_common(6))
    meta = {"command": args.command_line, "seen": args.seen, "budget": args.budget, "steps": args.steps,
            "dtype": str(model.dtype), "threads": torch.get_num_threads()}
    write_results(args.out, "ops", rows, ["method", "ops_per_token", f"added_vs_{base['method']}",
                                          "syncs_per_token", "most_added"], meta)


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


def cmd_batch(args):
    """The paper's throughput setting: a random-init model of Llama-2-7B's shape, prompt +
    generated tokens at several batch sizes, full cache vs h2o at a fraction of the sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

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

    def run(method, batch):
        prompt = torch.randint(0, shape["vocab_size"], (batch, args.prompt), device=args.device)
        cache = DynamicCache() if method == "full" else make_cache(model, "h2o", budget=budget)
        seconds = _generate_timed(model, prompt, cache, args.new_tokens)
        return {"method": method, "batch": batch, "latency_s": round(seconds, 2),
                "tokens_per_s": round(batch * args.new_tokens / seconds, 1), "kv_MiB": round(kv_bytes(cache) / 2**20, 3)}

    for method in ("full", "h2o"):
        rows.append({**run(method, args.batch), "measure": "same batch"})
        print(rows[-1], flush=True)
        batch = args.batch
        while batch * 2 <= args.max_batch:  # double until the memory runs out: the largest batch that fits
            try:
                row = run(method, batch * 2)
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


def user_turns(path, n, cycle=False):
    """The first n user turns of a jsonl file with a `turns` list per line; with cycle, a file
    with fewer starts over (the shared MT-Bench file has 79 questions, 158 turns)."""
    turns = []
    for line in read_input(path).splitlines():
        if line.strip():
            turns += json.loads(line)["turns"]
    if len(turns) < n and not (cycle and turns):
        raise ValueError(f"{path} has {len(turns)} user turns, {n} wanted")
    return [turns[i % len(turns)] for i in range(n)]


def history_ids(tokenizer, history, max_context):
    """The history as a typical app renders it each turn, [1, n]: the chat template with the
    generation prompt, the oldest turns dropped while it does not fit."""
    while True:
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        if ids.shape[1] < max_context or len(history) <= 1:
            return ids
        history = history[2:]


@torch.no_grad()
def naive_ttft(model, ids):
    """Time to first token of a typical app, given the history it rendered (`history_ids`):
    prefill it all with model.generate."""
    start = time.perf_counter()
    model.generate(ids, cache=DynamicCache(), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def kvpress_dialogue_rows(args, model, worker, transcripts):
    """The kvpress arm, timed in its venv on `transcripts` [(turn, ids [1, n])]: each turn
    re-prefills the history under ObservedAttentionPress keeping --budget slots per layer and KV
    head (H2O's budget), then greedy-decodes --new-tokens. Returns (rows, versions)."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    tasks = [{"kind": "generate", "press": "ObservedAttentionPress", "kept": args.budget, "input_ids": ids[0].tolist(),
              "max_new_tokens": args.new_tokens, "eos_token_ids": eos} for _, ids in transcripts]
    print(f"kvpress: timing {len(tasks)} turns in {worker[0]}", flush=True)
    result = kvpress_worker.run_tasks(worker, model, tasks)
    rows = []
    for (i, _), r in zip(transcripts, result["results"]):
        rows.append({"turn": i, "method": "kvpress", "ttft_s": round(r["ttft_s"], 3),
                     "decode_tok_s": round(r["decode_tok_s"], 2), "tokens_seen": r["n_tokens"],
                     "kv_MiB": round(r["kv_bytes"] / 2**20, 2), "rss_MiB": ""})
        print(rows[-1], flush=True)
    return rows, result["versions"]


def llamacpp_turn(server, tokenizer, history, new_tokens, n_ctx):
    """One turn of the llama.cpp arm on its own conversation `history` (messages, its own replies),
    rendered by our chat template into the token ids it is sent; the reply is appended. A prompt
    the server refuses (past its context) is resent as a typical client would: the oldest turns
    dropped until it fits, and so is one that would leave less than `new_tokens` of the context for
    the reply (the server would stop the reply when its context is full). Returns the row's
    figures, from the server's `timings` and `usage`."""
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
    note = ""
    if len(ids) + new_tokens > n_ctx:
        full = len(ids)
        ids = history_ids(tokenizer, history, n_ctx - new_tokens + 1)[0].tolist()
        note = f"{full} + {new_tokens} tokens past the context of {n_ctx}; oldest turns dropped ({len(ids)} sent)"
    try:
        response = server.complete(ids, new_tokens)
    except llamacpp_worker.LlamaCppError as e:
        note = f"{len(ids)} tokens refused ({str(e)[:80]}); oldest turns dropped"
        ids = history_ids(tokenizer, history, n_ctx - new_tokens)[0].tolist()
        response = server.complete(ids, new_tokens)
    history.append({"role": "assistant", "content": response["choices"][0]["text"]})
    t, usage = response["timings"], response["usage"]
    return {"ttft_s": t["prompt_ms"] / 1000, "decode_tok_s": t["predicted_per_second"],
            "tokens_seen": usage["prompt_tokens"] + usage["completion_tokens"], "prefilled": t["prompt_n"],
            "new": usage["completion_tokens"], "note": note}


def h2o_turn(session, text):
    for _ in session.send(text):
        pass
    st = session.stats
    return {"ttft_s": st["ttft_s"], "decode_tok_s": st["tokens_per_s"], "tokens_seen": st["tokens_seen"],
            "kv_MiB": st["kv_bytes"] / 2**20, "rss_MiB": _rss_kib("VmRSS") / 1024}


def dialogue_vs_llamacpp(args, model, tokenizer, turns):
    """h2o (ChatSession) and llama.cpp's server, each on its own conversation over the same user
    turns, interleaved turn by turn so machine noise hits both alike; the whole chat --repeats
    times, each row the median over repeats."""
    python = llamacpp_worker.find_python(args.llamacpp or None)
    if python is None:
        raise SystemExit(f"--llamacpp: no llama.cpp venv found; make one with: {llamacpp_worker.MAKE_VENV}")
    n_ctx = args.llamacpp_ctx or model.config.max_position_embeddings
    runs = {"h2o": [], "llama.cpp": []}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with llamacpp_worker.start_server(python, embedded_gguf_path(), threads=torch.get_num_threads(),
                                      n_ctx=n_ctx, log=Path(args.out) / "llamacpp-server.log") as server:
        for repeat in range(args.repeats):
            session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget, n_sink=4),
                                  temperature=0, max_new_tokens=args.new_tokens)
            history, per_turn = [], {"h2o": [], "llama.cpp": []}
            for i, text in enumerate(turns, 1):
                per_turn["h2o"].append(h2o_turn(session, text))
                history.append({"role": "user", "content": text})
                per_turn["llama.cpp"].append(llamacpp_turn(server, tokenizer, history, args.new_tokens, n_ctx))
                print(repeat, i, {m: {k: v for k, v in r[-1].items()} for m, r in per_turn.items()}, flush=True)
            for m in runs:
                runs[m].append(per_turn[m])
        settings = server.settings
    rows = []
    for i in range(len(turns)):
        for m, reps in runs.items():
            at = [rep[i] for rep in reps]
            row = {"turn": i + 1, "method": m}
            for key in ("ttft_s", "decode_tok_s", "tokens_seen", "kv_MiB", "rss_MiB", "prefilled"):
                values = [r[key] for r in at if key in r]
                row[key] = round(statistics.median(values), 3) if values else ""
            row["note"] = "; ".join(dict.fromkeys(r["note"] for r in at if r.get("note")))
            rows.append(row)
    return rows, settings


def cmd_dialogue(args):
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    if args.llamacpp is not None:
        turns = user_turns(args.turns_file, args.turns, cycle=True)
        rows, settings = dialogue_vs_llamacpp(args, model, tokenizer, turns)
        meta = {"command": args.command_line, "budget": args.budget, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": str(model.dtype),
                "llamacpp": settings}
        write_results(args.out, "dialogue-llamacpp", rows, ["turn", "method", "ttft_s", "decode_tok_s", "tokens_seen",
                                                            "prefilled", "kv_MiB", "note"], meta)
        write_plot(args.out, "dialogue-llamacpp", rows, "turn", "decode_tok_s", "method", "decode tokens/s per turn")
        return
    turns = user_turns(args.turns_file, args.turns)
    worker = kvpress_worker.worker_for(args.kvpress_python, model, "kvpress arm") if "kvpress" in args.methods else None
    transcripts = []  # (turn, history ids) for the kvpress arm, timed in its own process after the chat
    rows = []
    for method in args.methods:
        if method in ("naive", "kvpress"):
            continue
        cache = dict(policy="h2o", budget=args.budget, n_sink=4) if method == "h2o" else dict(policy="full")
        session = ChatSession(model, tokenizer, cache=cache, temperature=0, max_new_tokens=args.new_tokens)
        for i, text in enumerate(turns, 1):
            for _ in session.send(text):
                pass
            st = session.stats
            row = {"turn": i, "method": method, "ttft_s": round(st["ttft_s"], 3),
                   "decode_tok_s": round(st["tokens_per_s"], 2), "tokens_seen": st["tokens_seen"],
                   "kv_MiB": round(st["kv_bytes"] / 2**20, 2), "rss_MiB": round(_rss_kib("VmRSS") / 1024)}
            if method == args.methods[0] and (i % args.naive_every == 0 or i == 1):
                # the naive app and kvpress answer the same transcript: their time to first token
                # depends on the history's length, not on what they would have replied
                ids = history_ids(tokenizer, session.history[:-1], model.config.max_position_embeddings)
                if "naive" in args.methods:
                    rows.append({"turn": i, "method": "naive", "ttft_s": round(naive_ttft(model, ids), 3),
                                 "decode_tok_s": "", "tokens_seen": ids.shape[1], "kv_MiB": "", "rss_MiB": ""})
                    print(rows[-1], flush=True)
                if worker:
                    transcripts.append((i, ids))
            rows.append(row)
            print(row, flush=True)
    versions = None
    if transcripts:
        kv_rows, versions = kvpress_dialogue_rows(args, model, worker, transcripts)
        rows += kv_rows
    meta = {"command": args.command_line, "budget": args.budget,
            "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "kvpress": versions}
    ttft = {(r["method"], r["turn"]): r["ttft_s"] for r in rows}
    summary = {}
    for method in args.methods:
        late = [ttft[(method, t)] for t in range(40, 61) if (method, t) in ttft]
        if late:
            summary[method] = {"ttft_turns_40_60_mean_s": round(statistics.mean(late), 3)}
    for other in ("naive", "kvpress"):
        if other in summary and "h2o" in summary:
            other_turns = [t for t in range(40, 61) if (other, t) in ttft]
            ratio = statistics.mean(ttft[(other, t)] / ttft[("h2o", t)] for t in other_turns)
            summary[f"{other}_over_h2o_turns_40_60"] = round(ratio, 1)
    if ("h2o", 5) in ttft and ("h2o", 60) in ttft:
        summary["h2o_turn60_over_turn5"] = round(ttft[("h2o", 60)] / ttft[("h2o", 5)], 2)
    meta["summary"] = summary
    print(json.dumps(summary, indent=1))
    write_results(args.out, "dialogue", rows, ["turn", "method", "ttft_s", "decode_tok_s", "tokens_seen", "kv_MiB", "rss_MiB"], meta)
    write_plot(args.out, "dialogue", rows, "turn", "ttft_s", "method", "time to first token per turn", logy=True)


def _rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prefill_peak(model_spec, text_path, n_tokens, method, budget, queue):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(model_spec)
    prompt = text_tokens(tokenizer, text_path, n_tokens)
    cache = make_cache(model, method, budget)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss_kib("VmHWM")  # the reset value, not VmRSS read separately: the peak can't go below it
    start = time.perf_counter()
    with torch.no_grad():
        model(prompt, cache=cache, logits_to_keep=1)
    seconds = time.perf_counter() - start
    queue.put({"peak_MiB": round((_rss_kib("VmHWM") - before) / 1024, 1), "seconds": round(seconds, 4),
               "kv_MiB": round(kv_bytes(cache) / 2**20, 2)})


def cmd_prefill(args):
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for method in ["dynamic", "h2o"]:
        queue = ctx.Queue()
        proc = ctx.Process(target=_prefill_peak, args=(args.model, args.text, args.tokens, method, args.budget, queue))
        proc.start()
        result = queue.get()
        proc.join()
        rows.append({"method": method, "tokens": args.tokens, **result})
        print(rows[-1], flush=True)
    meta = {"command": args.command_line, "budget": args.budget,
            "note": "peak RSS above the RSS before the prefill, each method in a fresh process"}
    write_results(args.out, "prefill", rows, ["method", "tokens", "peak_MiB", "kv_MiB", "seconds"], meta)


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


def cmd_prefill_speed(args):
    """Prefill tokens/s of DynamicCache and H2OCache (h2o at --budget, prefilled --chunk tokens at a
    time inside each layer) per dtype and prompt length: timed runs interleaved between the two,
    medians reported, plus one profiled run each for the counts (ops, bytes allocated)."""
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


def cmd_panel(args):
    from ..ui import draw as panel
    from ..ui.state import CHAT_EVERY_S, PANEL_EVERY_S
    from . import page as bench_page

    model, tokenizer = load_model(args.model)
    rows = []
    for refresh in (False, True, False, True):  # interleaved, so machine noise hits both alike
        session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget), temperature=0,
                              max_new_tokens=args.new_tokens)
        for _ in session.send("Tell me a long story about a lighthouse keeper."):
            pass  # warm-up turn; the timed one follows
        last, start, n = 0.0, None, 0
        for _ in session.send("Go on, in much more detail."):
            start = start or time.perf_counter()
            n += 1
            if refresh and time.perf_counter() - last >= PANEL_EVERY_S:
                panel.render(session)
                last = time.perf_counter()
        rows.append({"measure": "decode with panel" if refresh else "decode without panel",
                     "value": round(session.last_turn.new_tokens / session.last_turn.decode_s, 2), "unit": "tokens/s"})
        print(rows[-1], flush=True)
    text = text_tokens(tokenizer, args.text, args.tokens)
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget), max_new_tokens=1)
    "".join(session.send(tokenizer.decode(text[0])))  # prefilled, and the one-token reply drawn
    for _ in range(3):
        start = time.perf_counter()
        view = panel.render(session)
        rows.append({"measure": f"render panel of {len(session.ledger):,} tokens", "value":
                     round(time.perf_counter() - start, 3), "unit": "s"})
        print(rows[-1], f"{len(view['token_map']) / 1e6:.2f} MB of HTML", flush=True)
    del model  # the page's app loads its own
    turns = bench_page.page_speed(args.model, args.budget, args.turns, args.new_tokens, args.app_dir) if args.turns else None
    if args.turns and turns is None:
        print("the page: not measured (needs Debian's chromium and playwright)", flush=True)
    for t in turns or ():
        print(t, flush=True)
    later = [t for t in turns or () if t["turn"] > 1]  # turn 1 warms the app up, as above
    if later:
        rows += [{"measure": "decode, reply streamed into the page (chromium on this machine)",
                  "value": statistics.median(t["server_tokens_per_s"] for t in later), "unit": "tokens/s"},
                 {"measure": "TTFT as the page shows it", "value": statistics.median(t["page_ttft_s"] for t in later),
                  "unit": "s"},
                 {"measure": "browser CPU time per reply", "value": statistics.median(t["browser_cpu_s"] for t in later),
                  "unit": "s"}]
        print(rows[-3:], flush=True)
    meta = {"command": args.command_line, "budget": args.budget, "app_dir": args.app_dir,
            "refresh_every_s": PANEL_EVERY_S,
            "chat_every_s": CHAT_EVERY_S, "page_turns": turns,
            "note": "page rows: medians over turns 2.. of one chat; the browser shares this machine's cores"}
    write_results(args.out, "panel", rows, ["measure", "value", "unit"], meta)


def distinct_bigrams(ids):
    """Share of a reply's token bigrams that are distinct: near 1 for varied text, low for loops."""
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 1.0


def cmd_soak(args):
    """One session over many turns, as a user who leaves the app running would: per turn RSS,
    time to first token, speed, and whether the replies degenerate."""
    model, tokenizer = load_model(args.model)
    turns = user_turns(args.turns_file, args.turns, cycle=True)
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget, positions=args.positions),
                          max_new_tokens=args.new_tokens, seed=args.seed)  # the app's sampling defaults
    rows, error = [], None
    for i, text in enumerate(tqdm(turns, desc=f"soak {args.positions}", unit="turn"), 1):
        try:
            reply = "".join(session.send(text))
        except Exception as e:  # the soak reports a failure instead of hiding it
            error = f"turn {i}: {type(e).__name__}: {e}"
            break
        st = session.stats
        rows.append({"turn": i, "positions": args.positions, "tokens_seen": st["tokens_seen"],
                     "rss_MiB": round(_rss_kib("VmRSS") / 1024, 1), "ttft_s": round(st["ttft_s"], 3),
                     "decode_tok_s": round(st["tokens_per_s"], 2),
                     "reply_tokens": session.last_turn.new_tokens,
                     "distinct2": round(distinct_bigrams(tokenizer(reply).input_ids), 3), "reply": reply[:200]})
    by_turn = {r["turn"]: r for r in rows}
    summary = {"turns_done": len(rows), "error": error, "tokens_seen": rows[-1]["tokens_seen"] if rows else 0,
               "max_position_embeddings": model.config.max_position_embeddings}
    settle = min(20, len(rows))
    if settle:
        summary["rss_after_turn_%d_MiB" % settle] = by_turn[settle]["rss_MiB"]
        summary["rss_growth_after_turn_%d_MiB" % settle] = round(max(r["rss_MiB"] for r in rows[settle - 1:]) - by_turn[settle]["rss_MiB"], 1)
        first, last = rows[:20], rows[-21:]
        summary["distinct2_first_20"] = round(statistics.mean(r["distinct2"] for r in first), 3)
        summary["distinct2_last_21"] = round(statistics.mean(r["distinct2"] for r in last), 3)
        # an empty or one-word reply has no repeated bigrams: report reply lengths beside the ratio
        summary["reply_tokens_first_20"] = round(statistics.mean(r["reply_tokens"] for r in first), 1)
        summary["reply_tokens_last_21"] = round(statistics.mean(r["reply_tokens"] for r in last), 1)
        summary["ttft_s_last_21_mean"] = round(statistics.mean(r["ttft_s"] for r in last), 3)
    print(json.dumps(summary, indent=1))
    meta = {"command": args.command_line, "budget": args.budget,
            "positions": args.positions, "new_tokens": args.new_tokens, "seed": args.seed, "summary": summary}
    name = f"soak-{args.positions}"
    write_results(args.out, name, rows, ["turn", "tokens_seen", "rss_MiB", "ttft_s", "decode_tok_s", "reply_tokens",
                                         "distinct2"], meta)
    write_plot(args.out, name + "-rss", rows, "tokens_seen", "rss_MiB", "positions", "process RSS over the soak")
    write_plot(args.out, name + "-distinct2", rows, "turn", "distinct2", "positions", "distinct bigrams per reply")
    if error:
        raise SystemExit(f"soak failed: {error}")


def add_quick(parser, **small):
    """--quick: these smaller settings, wherever the command line did not set them."""
    parser.add_argument("--quick", action="store_true", help="a short run: " + ", ".join(f"{k}={v}" for k, v in small.items()))
    parser.set_defaults(quick_settings=small)


def apply_quick(args, argv):
    if getattr(args, "quick", False):
        for name, value in args.quick_settings.items():
            flag = "--" + name.replace("_", "-")
            if not any(a == flag or a.startswith(flag + "=") for a in argv):
                setattr(args, name, value)


def base_parser(prog, doc, shared=()):
    """The top-level parser, and the parent every subcommand takes, for the options all commands share.

    A shared option is accepted before the subcommand (`--out DIR dialogue`) and after it (`dialogue
    --out DIR`, where users type it). The parent's copies default to SUPPRESS, so a subcommand that was
    not given the option leaves the top-level value (or its default) in place.
    shared: more (flags, argparse keywords) pairs, beside --model and --out.
    """
    options = [(("--model",), dict(default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")),
               (("--out",), dict(default="bench-out", help="folder for JSON and Markdown results")), *shared]
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parent = argparse.ArgumentParser(add_help=False)
    for flags, kwargs in options:
        parser.add_argument(*flags, **kwargs)
        parent.add_argument(*flags, **{**kwargs, "default": argparse.SUPPRESS})
    return parser, parent


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = (("--text",), dict(default=str(DATA_DIR / "tinyshakespeare.txt"), help="text the prompts are cut from"))
    parser, shared = base_parser("python -m h2o_chat.bench", __doc__, [text])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dialogue", parents=[shared], help="a long multi-turn chat, per-turn latency")
    p.add_argument("--turns-file", default=str(DATA_DIR / "mt_bench.jsonl"))
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--methods", type=lambda s: s.split(","), default=["h2o", "naive", "kvpress", "full"],
                   help="h2o, full (ChatSession), naive and kvpress; naive and kvpress are timed on the first "
                        "method's transcript")
    p.add_argument("--naive-every", type=int, default=10,
                   help="time the naive app and kvpress at turn 1 and every N turns (they re-read the whole history)")
    p.add_argument("--kvpress-python", default=None,
                   help=f"python of the kvpress venv (or ${kvpress_worker.ENV_VAR}); without one the kvpress arm is skipped")
    p.add_argument("--llamacpp", nargs="?", const="", default=None, metavar="PYTHON",
                   help="h2o against llama.cpp's server (xllamacpp, in its own venv: PYTHON, $"
                        f"{llamacpp_worker.ENV_VAR} or {llamacpp_worker.DEFAULT_PYTHON}), interleaved turn by turn")
    p.add_argument("--repeats", type=int, default=1, help="with --llamacpp: chats run, medians reported")
    p.add_argument("--llamacpp-ctx", type=int, default=None,
                   help="with --llamacpp: the server's context (default: the model's trained positions, 8,192 for "
                        "the embedded model); a small one reaches the limit in a few turns")
    p.add_argument("--dtype", default="auto", help="h2o's model dtype: auto (bf16 on CPUs with native bf16), float32")
    add_quick(p, turns=6, new_tokens=16, naive_every=2)
    p.set_defaults(run=cmd_dialogue)
    p = sub.add_parser("decode", parents=[shared], help="decode time per token vs tokens seen")
    p.add_argument("--seen", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per method (median reported)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--methods", type=lambda s: s.split(","), default=["full", "h2o"],
                   help="full, h2o, dynamic (transformers' DynamicCache), h2o-noevict (budget never reached); "
                        "a +lean suffix (h2o+lean) decodes through decode.py's lean step, as the app does")
    p.add_argument("--dtype", default="auto")
    add_quick(p, seen=[512, 2048], steps=8, repeats=1)
    p.set_defaults(run=cmd_decode)
    p = sub.add_parser("ops", parents=[shared], help="aten ops and host syncs per decode token (profiler)")
    p.add_argument("--seen", type=int, default=600)
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["dynamic", "h2o", "full", "h2o+lean", "full+lean"],
                   help="as decode's --methods; the +lean ones are what the app runs")
    p.set_defaults(run=cmd_ops)
    p = sub.add_parser("batch", parents=[shared], help="the paper's batch throughput setting (CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama2-7b", choices=["llama2-7b", "tiny"])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.2, help="h2o budget as a share of prompt + generated")
    p.add_argument("--batch", type=int, default=8, help="the batch size both methods are timed at")
    p.add_argument("--max-batch", type=int, default=1024)
    add_quick(p, prompt=512, new_tokens=128, max_batch=32)
    p.set_defaults(run=cmd_batch)
    p = sub.add_parser("prefill", parents=[shared], help="peak memory of prefilling a long prompt")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512)
    add_quick(p, tokens=1024)
    p.set_defaults(run=cmd_prefill)
    p = sub.add_parser("prefill-speed", parents=[shared], help="prefill tokens/s, ops and bytes allocated: h2o vs DynamicCache")
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256, help="h2o's prefill_chunk")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per method (median reported)")
    p.add_argument("--no-counts", dest="counts", action="store_false", help="skip the profiled run")
    add_quick(p, tokens=[512], repeats=1)
    p.set_defaults(run=cmd_prefill_speed)
    p = sub.add_parser("panel", parents=[shared], help="the live panel's cost")
    p.add_argument("--tokens", type=int, default=20_000, help="length of the conversation whose panel is rendered")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--turns", type=int, default=5, help="replies streamed into the page (chromium; 0: none)")
    p.add_argument("--app-dir", default=None, help="run the page's app from this checkout (e.g. a git worktree of "
                   "an older commit: run both, alternating, to compare)")
    add_quick(p, tokens=2000, new_tokens=32, turns=2)
    p.set_defaults(run=cmd_panel)
    p = sub.add_parser("soak", parents=[shared], help="one session over many turns: memory, speed, reply quality")
    p.add_argument("--turns-file", default=str(DATA_DIR / "mt_bench.jsonl"))
    p.add_argument("--turns", type=int, default=160)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--positions", default="rolling", choices=["rolling", "absolute"])
    p.add_argument("--seed", type=int, default=0)
    add_quick(p, turns=8, new_tokens=16)
    p.set_defaults(run=cmd_soak)
    p = sub.add_parser("concurrent", parents=[shared], help="N chats at once through the API (one batch) vs one at a time")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--turns-file", default=str(DATA_DIR / "mt_bench.jsonl"))
    p.add_argument("--turns", type=int, default=2, help="turns of each chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of each server")
    p.add_argument("--h2o-args", default="", help="more app.py flags for both servers, e.g. '--dtype float32'")
    p.add_argument("--repeats", type=int, default=3, help="runs of both arms per size (medians reported)")
    add_quick(p, sizes=[1, 2], turns=1, max_tokens=8, repeats=1)
    p.set_defaults(run=bench_concurrent.cmd_concurrent)
    args = parser.parse_args(argv)
    apply_quick(args, argv)
    args.command_line = "python -m h2o_chat.bench " + " ".join(argv)  # what the results say made them
    args.run(args)


