"""`python -m h2o_chat.bench decode-peers`: decode tokens/s after a held-out history, h2o-chat
against llama.cpp and OpenVINO GenAI on the same GGUF file and the same token ids.

The history is one user message: an instruction and the first --history tokens of --text (the
held-out text `bench decode` reads), rendered by the model's chat template (~1,040 tokens for the
embedded model at the default 1,000). Every arm prefills it, then decodes greedily; what is
timed is the decode alone, from the first generated token on. The arms, each a fresh process per
round, in an order that rotates round by round, --repeats rounds, medians reported:

    h2o                 the app's path: ChatSession (policy h2o, --budget, greedy, --quantization
                        weights of --model) sends the message after a short warm-up reply;
                        tokens/s is its own stats line's (reply tokens / first text -> end), a
                        reply that ends at end-of-text sooner shows in new_tokens
    llama.cpp           (--llamacpp) its server (xllamacpp) on the file, the token ids the h2o
                        arm fed, end of text ignored; tokens/s from its `timings`
    OpenVINO evict      (--openvino) its continuous-batching pipeline on the file with its
                        H2O-style cache eviction: SUM of attention, --budget tokens in all
                        (--openvino-start + evictable + --openvino-recent), same ids, end of text
                        ignored; tokens/s by the wall clock over a token streamer (tokens after
                        the first / first -> last), OpenVINO's own TPOT beside it
    OpenVINO full       the same without eviction (its cache holds the whole history)
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from .common import write_results
from .peers import llamacpp, openvino
from .user_gguf import llamacpp_arm

INSTRUCTION = "Continue this play, in the same style:\n\n"
EVICT, FULL = "OpenVINO evict", "OpenVINO full"


def measure(spec):
    """In this (fresh) process: the h2o arm. `spec`: model, dtype, quantization, text, history,
    budget, new_tokens, threads. Returns its figures (a dict) and the prompt's token ids."""
    import torch

    from ..chat.session import ChatSession
    from ..models.load import load_model
    from ..models.quantize import weights_label
    from .common import text_tokens

    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_model(spec["model"], dtype=spec["dtype"], quantization=spec["quantization"])
    history = INSTRUCTION + tokenizer.decode(text_tokens(tokenizer, spec["text"], spec["history"])[0])
    chat = dict(cache=dict(policy="h2o", budget=spec["budget"]), temperature=0)
    for _ in ChatSession(model, tokenizer, **chat, max_new_tokens=4).send("Hello"):  # untimed: first-call costs
        pass
    session = ChatSession(model, tokenizer, **chat, max_new_tokens=spec["new_tokens"])
    for _ in session.send(history):
        pass
    turn, stats = session.last_turn, session.stats
    return {"decode_tok_s": stats["tokens_per_s"], "ttft_s": stats["ttft_s"], "new_tokens": turn.new_tokens,
            "kv_MiB": stats["kv_bytes"] / 2**20, "weights": weights_label(model),
            "prompt_ids": [int(i) for i in session.timeline.fed[:turn.prompt_tokens]]}


def h2o_arm(spec):
    """`measure` in a fresh python, so no arm inherits another's warm caches or allocations."""
    done = subprocess.run([sys.executable, "-m", "h2o_chat.bench.decode_peers", json.dumps(spec)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2])
    if done.returncode:
        raise RuntimeError(f"the h2o arm failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def openvino_arm(python, gguf, prompt_ids, new_tokens, threads, cache_eviction):
    result = openvino.decode(python, gguf, prompt_ids, new_tokens, threads, cache_eviction)
    return {**result, "weights": f"OpenVINO GenAI {result['version']}"}


def peer_python(module, flag):
    """The python of a peer's venv for `flag`'s value (None: not asked for); a peer asked for and
    not found ends the command with how to make its venv."""
    if flag is None:
        return None
    python = module.find_python(flag or None)
    if python is None:
        raise SystemExit(f"no venv found for this peer; make one with: {module.MAKE_VENV}")
    return python


def peer_gguf(model):
    """The GGUF file the peers read: --model's when it is one, else the embedded model's."""
    if model is None:
        from ..models.load import embedded_gguf_path

        return embedded_gguf_path()
    if str(model).endswith(".gguf") and Path(model).is_file():
        return Path(model)
    raise SystemExit(f"--model {model}: llama.cpp and OpenVINO read a GGUF file; give one, or leave --model "
                     "out for the embedded model")


def rotated(arms, round_index):
    """The arms in the order of round `round_index`: each round starts one arm later, so no arm
    always runs first or after the same one."""
    k = round_index % len(arms)
    return arms[k:] + arms[:k]


def summary_rows(runs):
    """One row per arm, each figure the median over its runs; the ratios against h2o and against
    OpenVINO with eviction, where they ran."""
    rows = []
    for arm, results in runs.items():
        row = {"arm": arm, "weights": results[0]["weights"]}
        for key in ("decode_tok_s", "tpot_tok_s", "ttft_s", "new_tokens", "kv_MiB"):
            values = [r[key] for r in results if r.get(key) not in (None, "")]
            row[key] = round(statistics.median(values), 2) if values else ""
        rows.append(row)
    speed = {r["arm"]: r["decode_tok_s"] for r in rows}
    for row in rows:
        for name, base in (("vs_h2o", "h2o"), ("vs_openvino_evict", EVICT)):
            row[name] = f"{row['decode_tok_s'] / speed[base]:.2f}x" if base in speed else ""
    return rows


def run(args):
    import torch

    threads = args.threads or torch.get_num_threads()
    llama_python = peer_python(llamacpp, args.llamacpp)
    openvino_python = peer_python(openvino, args.openvino)
    cache_eviction = None
    if openvino_python:
        try:
            cache_eviction = openvino.eviction(args.budget, args.openvino_start, args.openvino_recent)
        except ValueError as e:
            raise SystemExit(f"--openvino: {e}") from None
    gguf = peer_gguf(args.model) if llama_python or openvino_python else None
    spec = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization, "text": args.text,
            "history": args.history, "budget": args.budget, "new_tokens": args.new_tokens, "threads": threads}
    arms = ["h2o"] + (["llama.cpp"] if llama_python else []) + ([EVICT, FULL] if openvino_python else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, prompt_ids = {arm: [] for arm in arms}, None
    for repeat in range(args.repeats):
        for arm in rotated(arms, repeat):  # round 0 starts with h2o: its prompt ids are the peers'
            if arm == "h2o":
                result = h2o_arm(spec)
                ids = result.pop("prompt_ids")
                if prompt_ids not in (None, ids):
                    raise RuntimeError("the h2o arm fed other prompt ids than in its first run")
                prompt_ids = ids
            elif arm == "llama.cpp":
                result = llamacpp_arm(llama_python, gguf, prompt_ids, args.new_tokens, threads,
                                      out / "llamacpp-server.log", n_ctx=len(prompt_ids) + args.new_tokens + 64)
            else:
                result = openvino_arm(openvino_python, gguf, prompt_ids, args.new_tokens, threads,
                                      cache_eviction if arm == EVICT else None)
            runs[arm].append(result)
            print(repeat, arm, {k: v for k, v in result.items() if k not in ("tokens", "scheduler")}, flush=True)
    rows = summary_rows(runs)
    meta = {"command": args.command_line, "gguf": str(gguf) if gguf else None, "repeats": args.repeats,
            "threads": threads, "budget": args.budget, "history_tokens": len(prompt_ids),
            "new_tokens": args.new_tokens, "openvino_eviction": cache_eviction,
            "openvino_scheduler": {arm: runs[arm][0]["scheduler"] for arm in (EVICT, FULL) if arm in runs},
            "runs": {arm: [{k: v for k, v in r.items() if k not in ("tokens", "scheduler")} for r in results]
                     for arm, results in runs.items()},
            "note": "decode tokens/s after the history's prefill, prefill excluded; each arm a fresh process per "
                    "round, the order rotating, medians. tpot_tok_s: OpenVINO's own 1000 / mean TPOT, beside its "
                    "wall-clock decode_tok_s. kv_MiB: h2o's cache, OpenVINO's cache in use at the last token"}
    write_results(args.out, "decode-peers", rows, ["arm", "weights", "decode_tok_s", "vs_h2o", "vs_openvino_evict",
                                                   "tpot_tok_s", "ttft_s", "new_tokens", "kv_MiB"], meta)


if __name__ == "__main__":
    figures = measure(json.loads(sys.argv[1]))
    print(json.dumps(figures))
