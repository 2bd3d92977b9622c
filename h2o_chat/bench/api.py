"""`python -m h2o_chat.bench.api`: one long chat through the OpenAI API, h2o-chat's `/v1` against
llama.cpp's server on the same GGUF (xllamacpp in its own venv, started by llamacpp_worker).

Each arm is a server in its own process, driven by the same client code (the `openai` client,
streamed, greedy): every turn resends the whole history, as SillyTavern or Open WebUI do. Per
turn: TTFT (request sent -> first text), prompt tokens, cached prompt tokens (what the server
says it did not recompute), decode tokens/s (after the first text), or the error a server gave.
llama.cpp runs with the model's 8,192-token context and its defaults (prompt cache on, context
shift off); h2o-chat with app.py's defaults (budget 512, rolling positions).

Time it alone: `flock -x /tmp/h2o-cpu.lock python -m h2o_chat.bench.api`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .peers import llamacpp as llamacpp_worker
from .peers.llamacpp import free_port

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench.jsonl"
REPO = Path(__file__).resolve().parents[2]


def wait_healthy(url, process, deadline_s=600):
    import httpx

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {deadline_s} s")


def start_h2o(port, threads, extra):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(REPO / "app.py"), "--port", str(port), "--data-dir", tempfile.mkdtemp(), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)


def user_turns(path, n):
    turns = []
    for line in Path(path).read_text().splitlines():
        turns += json.loads(line)["turns"]
    return (turns * (n // max(len(turns), 1) + 1))[:n]


def run_chat(base_url, model, turns, max_tokens):
    """One chat, a streamed greedy reply per turn; a row per turn."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="bench", timeout=900, max_retries=0)
    messages, rows = [], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        row = {"turn": i + 1}
        start, first, pieces, usage = time.perf_counter(), None, [], None
        try:
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        first = first or time.perf_counter()
                        pieces.append(choice.delta.content)
        except openai.APIError as e:
            row["error"] = str(getattr(e, "message", e))[:200]
            messages.pop()
            rows.append(row)
            print(f"turn {i + 1}: error {row['error']}", flush=True)
            continue
        end = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None)
        row.update(ttft_s=round((first or end) - start, 4), prompt_tokens=usage.prompt_tokens if usage else None,
                   cached_tokens=details.cached_tokens if details else None,
                   completion_tokens=usage.completion_tokens if usage else None,
                   decode_tok_s=round((usage.completion_tokens - 1) / (end - first), 2)
                   if usage and first and end > first and usage.completion_tokens > 1 else None)
        rows.append(row)
        print(f"turn {i + 1}: {row}", flush=True)
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's context (default: the model's 8192)")
    p.add_argument("--data", default=str(MT_BENCH), help="MT-Bench questions (JSONL, one 'turns' list a line)")
    p.add_argument("--arms", default="h2o,llamacpp")
    p.add_argument("--llamacpp", default=None, metavar="PYTHON", help="the llama.cpp venv's python "
                   f"(default: ${llamacpp_worker.ENV_VAR}, else {llamacpp_worker.DEFAULT_PYTHON})")
    p.add_argument("--h2o-args", default="", help="extra app.py flags for the h2o arm, e.g. '--budget 1024'")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    if not Path(args.data).is_file():
        sys.exit(f"bench_api: no MT-Bench file at {args.data} (give --data)")
    import httpx

    from ..models.load import embedded_gguf_path

    turns = user_turns(args.data, args.turns)
    results = {"meta": {"command": "python -m h2o_chat.bench.api " + " ".join(argv or sys.argv[1:]),
                        "turns": args.turns, "max_tokens": args.max_tokens, "threads": args.threads,
                        "n_ctx_llamacpp": args.n_ctx, "h2o_args": args.h2o_args}, "arms": {}}
    for arm in args.arms.split(","):
        if arm == "h2o":
            port = free_port()
            process = start_h2o(port, args.threads, args.h2o_args.split())
            url, stop = f"http://127.0.0.1:{port}", lambda process=process: (process.terminate(), process.wait(30))
        elif arm == "llamacpp":
            python = llamacpp_worker.find_python(args.llamacpp)
            if python is None:
                print(f"skipping llamacpp: no llama.cpp venv; make one with: {llamacpp_worker.MAKE_VENV}")
                continue
            server = llamacpp_worker.start_server(python, embedded_gguf_path(), args.threads, args.n_ctx)
            url, stop, process = server.url, server.stop, server.process
        else:
            sys.exit(f"bench_api: unknown arm {arm!r}")
        try:
            wait_healthy(url, process)
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            results["arms"][arm] = run_chat(url, model, turns, args.max_tokens)
        finally:
            stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "api_vs_llamacpp.json").write_text(json.dumps(results, indent=1))
    (out / "api_vs_llamacpp.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results):
    arms = list(results["arms"])
    lines = [f"Command: `{results['meta']['command']}`", "",
             "| turn | " + " | ".join(f"{a} TTFT s | {a} cached/prompt | {a} tok/s" for a in arms) + " |",
             "|---" * (1 + 3 * len(arms)) + "|"]
    n = max((len(r) for r in results["arms"].values()), default=0)
    for i in range(n):
        cells = []
        for a in arms:
            row = results["arms"][a][i] if i < len(results["arms"][a]) else {}
            if "error" in row:
                cells += ["error", row["error"][:60].replace("|", "/"), ""]
            else:
                cells += [f"{row.get('ttft_s', '')}", f"{row.get('cached_tokens')}/{row.get('prompt_tokens')}",
                          f"{row.get('decode_tok_s')}"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
