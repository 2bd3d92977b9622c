"""`python -m h2o_chat.bench.api`: one long chat through the OpenAI API, h2o-chat's `/v1` against
llama.cpp's server on the same GGUF (xllamacpp in its own venv, started by peers/llamacpp.py).

Each arm is a server in its own process, driven by the same client code (the `openai` client,
streamed, greedy): every turn resends the whole history, as SillyTavern or Open WebUI do. Per
turn: TTFT (request sent -> first text), prompt tokens, cached prompt tokens (what the server
says it did not recompute), decode tokens/s (after the first text), or the error a server gave.
llama.cpp runs with the model's 8,192-token context and its defaults (prompt cache on, context
shift off); h2o-chat with app.py's defaults (budget 512, rolling positions).

Time it alone: `flock -x /tmp/h2o-cpu.lock python -m h2o_chat.bench.api`.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..models.load import embedded_gguf_path
from .common import MT_BENCH, api_client, app_server, served_model, stream_reply, user_turns, wait_healthy
from .peers import llamacpp


def run_chat(base_url, model, turns, max_tokens):
    """One chat, a streamed greedy reply per turn; a row per turn."""
    import openai

    client = api_client(base_url)
    messages, rows = [], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        row = {"turn": i + 1}
        try:
            reply, usage, ttft, streaming = stream_reply(client, model, messages, max_tokens)
        except openai.APIError as e:
            row["error"] = str(getattr(e, "message", e))[:200]
            messages.pop()
            rows.append(row)
            print(f"turn {i + 1}: error {row['error']}", flush=True)
            continue
        details = getattr(usage, "prompt_tokens_details", None)
        row.update(ttft_s=round(ttft, 4), prompt_tokens=usage.prompt_tokens if usage else None,
                   cached_tokens=details.cached_tokens if details else None,
                   completion_tokens=usage.completion_tokens if usage else None,
                   decode_tok_s=round((usage.completion_tokens - 1) / streaming, 2)
                   if usage and streaming > 0 and usage.completion_tokens > 1 else None)
        rows.append(row)
        print(f"turn {i + 1}: {row}", flush=True)
        messages.append({"role": "assistant", "content": reply})
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
                   f"(default: ${llamacpp.ENV_VAR}, else {llamacpp.DEFAULT_PYTHON})")
    p.add_argument("--h2o-args", default="", help="extra app.py flags for the h2o arm, e.g. '--budget 1024'")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    if not Path(args.data).is_file():
        sys.exit(f"bench.api: no MT-Bench file at {args.data} (give --data)")
    turns = user_turns(args.data, args.turns, cycle=True)
    results = {"meta": {"command": "python -m h2o_chat.bench.api " + " ".join(argv or sys.argv[1:]),
                        "turns": args.turns, "max_tokens": args.max_tokens, "threads": args.threads,
                        "n_ctx_llamacpp": args.n_ctx, "h2o_args": args.h2o_args}, "arms": {}}
    for arm in args.arms.split(","):
        with contextlib.ExitStack() as stack:
            if arm == "h2o":
                url, process = stack.enter_context(app_server(args.h2o_args.split(), args.threads))
            elif arm == "llamacpp":
                python = llamacpp.find_python(args.llamacpp)
                if python is None:
                    print(f"skipping llamacpp: no llama.cpp venv; make one with: {llamacpp.MAKE_VENV}")
                    continue
                server = stack.enter_context(llamacpp.start_server(python, embedded_gguf_path(), args.threads,
                                                                   args.n_ctx))
                url, process = server.url, server.process
            else:
                sys.exit(f"bench.api: unknown arm {arm!r}")
            wait_healthy(url, process)
            results["arms"][arm] = run_chat(url, served_model(url), turns, args.max_tokens)
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
