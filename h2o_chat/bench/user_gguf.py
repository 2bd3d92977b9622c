"""`python -m h2o_chat.bench user-gguf`: a user's own 1B-class GGUF file, loaded at its own width
against dequantized, and beside llama.cpp serving the same file.

The file is a Llama-3.2-1B-shaped random-weight GGUF (16 layers, hidden 2048, 32 query and 8
KV heads, MLP 8192, vocabulary 128,256, tied embeddings), written once by random_gguf.py in
--block-type: Q4_0 (656 MB), or Q4_K_M, llama.cpp's mix (Q4_K, and Q6_K for the token table
and half the layers' attn_v and ffn_down: 803 MB), or --file, any GGUF. Each arm runs in a fresh
process, the arms interleaved --repeats times, medians reported:

    h2o <quantization>  load_model(file, quantization=...): seconds, peak RSS of the load (VmHWM),
                        then one ChatSession reply of --new-tokens greedy tokens: decode tokens/s
                        (the app's path; new_tokens says if a random model stopped early)
    llama.cpp           its server (xllamacpp) on the file, the same prompt's token ids, end of
                        text ignored: decode tokens/s from its timings, the server process's peak
                        RSS (it maps the file)
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from .common import write_results
from .peers import llamacpp
from .random_gguf import LLAMA_1B, TINY, TINY_K, written

PROMPT = "Tell me about the history of lighthouses, and how their lights were kept burning through the night."
SHAPES = {"llama-1b": LLAMA_1B, "tiny": TINY, "tiny-k": TINY_K}  # tiny-k: rows of 256, as K-quants need


def measure(file, quantization, new_tokens, threads):
    """In this (fresh) process: load the file, one reply. Returns the figures (a dict)."""
    import time

    import torch

    from ..chat.session import ChatSession
    from ..models.load import load_model
    from ..models.quantize import weights_label
    from .common import rss_kib

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model, tokenizer = load_model(file, quantization=quantization)
    loaded = time.perf_counter() - start
    peak = rss_kib("VmHWM") / 1024
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=512), temperature=0,
                          max_new_tokens=new_tokens)
    for _ in session.send(PROMPT):  # a random model stopping early shows in new_tokens
        pass
    stats = session.stats
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
    return {"load_s": loaded, "peak_rss_MiB": peak, "rss_MiB": rss_kib("VmRSS") / 1024,
            "decode_tok_s": stats["tokens_per_s"], "new_tokens": session.last_turn.new_tokens,
            "weights": weights_label(model), "prompt_ids": list(prompt_ids)}


def h2o_arm(file, quantization, new_tokens, threads):
    """`measure` in a fresh python: peak RSS is this load's alone."""
    spec = json.dumps({"file": str(file), "quantization": quantization, "new_tokens": new_tokens, "threads": threads})
    done = subprocess.run([sys.executable, "-m", "h2o_chat.bench.user_gguf", spec], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode:
        raise RuntimeError(f"the {quantization} arm failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_arm(python, file, prompt_ids, new_tokens, threads, log, n_ctx=2048):
    """llama.cpp's server on `file`, fresh: a warm-up, then `new_tokens` greedy tokens after
    `prompt_ids` (end of text ignored). Its figures, from its own `timings`."""
    with llamacpp.start_server(python, file, threads=threads, n_ctx=n_ctx, log=log) as server:
        server.complete(prompt_ids[:8], 4)  # warm-up
        response = server.complete(prompt_ids, new_tokens, ignore_eos=True)
        peak = _peak_rss_mib(server.process.pid)
        settings = server.settings
    t = response["timings"]
    return {"decode_tok_s": t["predicted_per_second"], "new_tokens": t["predicted_n"], "peak_rss_MiB": peak,
            "ttft_s": t["prompt_ms"] / 1000,
            "load_s": "", "weights": f"llama.cpp {settings.get('version')}"}


def _peak_rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return ""


def run(args):
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file = written(Path(args.file) if args.file else out / f"random-{args.shape}-{args.block_type}.gguf",
                   SHAPES[args.shape], args.block_type)
    threads = args.threads or torch.get_num_threads()
    python = llamacpp.find_python(args.llamacpp or None) if args.llamacpp is not None else None
    if args.llamacpp is not None and python is None:
        raise SystemExit(f"--llamacpp: no llama.cpp venv found; make one with: {llamacpp.MAKE_VENV}")
    arms = [f"h2o {q}" for q in args.quantization] + (["llama.cpp"] if python else [])
    runs, prompt_ids = {arm: [] for arm in arms}, None
    for repeat in range(args.repeats):
        for arm in arms:
            if arm == "llama.cpp":
                result = llamacpp_arm(python, file, prompt_ids, args.new_tokens, threads, out / "llamacpp-server.log")
            else:
                result = h2o_arm(file, arm.split()[1], args.new_tokens, threads)
                prompt_ids = result.pop("prompt_ids")
            runs[arm].append(result)
            print(repeat, arm, result, flush=True)
    rows = []
    for arm, results in runs.items():
        row = {"arm": arm, "weights": results[0]["weights"]}
        for key in ("load_s", "peak_rss_MiB", "decode_tok_s", "new_tokens"):
            values = [r[key] for r in results if r[key] != ""]
            row[key] = round(statistics.median(values), 2) if values else ""
        rows.append(row)
    base = {r["arm"]: r for r in rows}
    none, peer = base.get("h2o none"), base.get("llama.cpp")
    for row in rows:
        row["rss_vs_none"] = f"{row['peak_rss_MiB'] / none['peak_rss_MiB']:.0%}" if none else ""
        row["speed_vs_none"] = f"{row['decode_tok_s'] / none['decode_tok_s']:.2f}x" if none else ""
        row["speed_vs_llamacpp"] = f"{row['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else ""
    meta = {"command": args.command_line, "file": str(file), "file_MiB": round(file.stat().st_size / 2**20, 1),
            "repeats": args.repeats, "threads": threads, "new_tokens": args.new_tokens,
            "note": "each arm a fresh process, arms interleaved, medians; peak RSS of the h2o arms is the load's "
                    "(before the reply), llama.cpp's its server's after the reply"}
    write_results(args.out, "user-gguf", rows, ["arm", "weights", "load_s", "peak_rss_MiB", "rss_vs_none", "decode_tok_s",
                                                "speed_vs_none", "speed_vs_llamacpp", "new_tokens"], meta)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(measure(spec["file"], spec["quantization"], spec["new_tokens"], spec["threads"])))
