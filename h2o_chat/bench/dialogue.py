"""`python -m h2o_chat.bench dialogue`: one long chat over the user turns of a jsonl file.

Per turn: time to first token, decode tokens/s, KV bytes and RSS of ChatSession with H2O (and
with the full cache), against a naive app that re-prefills the whole history every turn, and
against kvpress (its H2O-like ObservedAttentionPress, re-prefilling the history each turn at the
same budget; run in its own venv, --kvpress-python). The naive app and kvpress are timed on the
first method's transcript, at turn 1 and every --naive-every turns.

With --llamacpp: h2o against llama.cpp's server (xllamacpp, in its own venv), each on its own
conversation over the same user turns, interleaved turn by turn.
"""

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..chat.session import ChatSession
from ..models.load import embedded_gguf_path, load_model
from ..models.quantize import weights_label
from .common import rss_kib, user_turns, write_plot, write_results
from .peers import kvpress, llamacpp


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
    result = kvpress.run_tasks(worker, model, tasks)
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
    except llamacpp.LlamaCppError as e:
        note = f"{len(ids)} tokens refused ({str(e)[:80]}); oldest turns dropped"
        ids = history_ids(tokenizer, history, n_ctx - new_tokens)[0].tolist()
        response = server.complete(ids, new_tokens)
    history.append({"role": "assistant", "content": response["choices"][0]["text"]})
    t, usage = response["timings"], response["usage"]
    return {"ttft_s": t["prompt_ms"] / 1000, "decode_tok_s": t["predicted_per_second"],
            "tokens_seen": usage["prompt_tokens"] + usage["completion_tokens"], "prefilled": t["prompt_n"],
            "new": usage["completion_tokens"], "note": note}


def session_turn(session, text):
    """One turn of a ChatSession (h2o or full): its figures, unrounded."""
    for _ in session.send(text):
        pass
    st = session.stats
    return {"ttft_s": st["ttft_s"], "decode_tok_s": st["tokens_per_s"], "tokens_seen": st["tokens_seen"],
            "kv_MiB": st["kv_bytes"] / 2**20, "rss_MiB": rss_kib("VmRSS") / 1024}


def dialogue_vs_llamacpp(args, model, tokenizer, turns):
    """h2o (ChatSession) and llama.cpp's server, each on its own conversation over the same user
    turns, interleaved turn by turn so machine noise hits both alike; the whole chat --repeats
    times, each row the median over repeats."""
    python = llamacpp.find_python(args.llamacpp or None)
    if python is None:
        raise SystemExit(f"--llamacpp: no llama.cpp venv found; make one with: {llamacpp.MAKE_VENV}")
    n_ctx = args.llamacpp_ctx or model.config.max_position_embeddings
    runs = {"h2o": [], "llama.cpp": []}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with llamacpp.start_server(python, embedded_gguf_path(), threads=torch.get_num_threads(),
                               n_ctx=n_ctx, log=Path(args.out) / "llamacpp-server.log") as server:
        for repeat in range(args.repeats):
            session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget),
                                  temperature=0, max_new_tokens=args.new_tokens)
            history, per_turn = [], {"h2o": [], "llama.cpp": []}
            for i, text in enumerate(turns, 1):
                per_turn["h2o"].append(session_turn(session, text))
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


def run(args):
    model, tokenizer = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    if args.llamacpp is not None:
        turns = user_turns(args.turns_file, args.turns, cycle=True)
        rows, settings = dialogue_vs_llamacpp(args, model, tokenizer, turns)
        meta = {"command": args.command_line, "budget": args.budget, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": str(model.dtype),
                "weights": weights_label(model), "llamacpp": settings}
        write_results(args.out, "dialogue-llamacpp", rows, ["turn", "method", "ttft_s", "decode_tok_s", "tokens_seen",
                                                            "prefilled", "kv_MiB", "note"], meta)
        write_plot(args.out, "dialogue-llamacpp", rows, "turn", "decode_tok_s", "method", "decode tokens/s per turn")
        return
    turns = user_turns(args.turns_file, args.turns)
    worker = kvpress.worker_for(args.kvpress_python, model, "kvpress arm") if "kvpress" in args.methods else None
    transcripts = []  # (turn, history ids) for the kvpress arm, timed in its own process after the chat
    rows = []
    for method in args.methods:
        if method in ("naive", "kvpress"):
            continue
        cache = dict(policy="h2o", budget=args.budget) if method == "h2o" else dict(policy="full")
        session = ChatSession(model, tokenizer, cache=cache, temperature=0, max_new_tokens=args.new_tokens)
        for i, text in enumerate(turns, 1):
            st = session_turn(session, text)
            row = {"turn": i, "method": method, "ttft_s": round(st["ttft_s"], 3),
                   "decode_tok_s": round(st["decode_tok_s"], 2), "tokens_seen": st["tokens_seen"],
                   "kv_MiB": round(st["kv_MiB"], 2), "rss_MiB": round(st["rss_MiB"])}
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
    meta = {"command": args.command_line, "budget": args.budget, "new_tokens": args.new_tokens,
            "threads": torch.get_num_threads(), "weights": weights_label(model), "kvpress": versions}
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
