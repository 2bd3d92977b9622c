"""`python -m h2o_chat.bench concurrent`: N chats at once through the API, decoded in one batch,
against the same chats one at a time.

Two servers (app.py in their own processes, the same flags but --concurrency): "together" with
--concurrency max(sizes), where N clients stream at once and their decode steps share one batched
forward; "one at a time" with --concurrency 1, where the same N chats run one after another. For
each N the two arms run back to back (alternating which goes first), with the `openai` client,
streamed and greedy. Chat i is MT-Bench question i: its turns in order, each resending the
history. `same replies` says whether both arms wrote the same texts: on float weights they do;
on int4 weights a row alone takes int4_mm and a batch's rows aten's kernel (packed.py), which
round differently, so a reply can part where its best two tokens are that close.

With --repeats R the pair of arms runs R times per N (alternating which goes first) and each
figure is the median over the repeats: one run of a few seconds moves by 10-30% on a shared machine.

Reported per N and arm: aggregate tokens/s (every completion token / wall time of the whole
run, prefills included), per-chat decode tokens/s (a chat's tokens after its first one / the
time it spent streaming them; median over chats) and TTFT (request -> first text; median and
max over every turn). Time it alone: `flock -x /tmp/h2o-cpu.lock python -m h2o_chat.bench concurrent`.
"""

import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

from .common import api_client, app_server, read_input, served_model, stream_reply, wait_healthy


def run_chat(url, model, turns, max_tokens):
    """One chat, turn after turn: a row per turn."""
    client = api_client(url)
    messages, rows = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        reply, usage, ttft, streaming = stream_reply(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": reply})
        rows.append({"ttft_s": ttft, "tokens": usage.completion_tokens, "streaming_s": streaming, "text": reply})
    return rows


def run_arm(url, model, chats, max_tokens, together):
    """Every chat, all at once (threads) or one after another: (wall_s, rows per chat)."""
    results = [None] * len(chats)

    def work(i):
        results[i] = run_chat(url, model, chats[i], max_tokens)

    start = time.perf_counter()
    if together:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(chats))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3600)
        if any(t.is_alive() for t in threads):
            raise RuntimeError("a chat did not finish within an hour")
    else:
        for i in range(len(chats)):
            work(i)
    return time.perf_counter() - start, results


def summary(wall_s, chats):
    rows = [row for chat in chats for row in chat]
    per_chat = [(sum(r["tokens"] for r in chat) - len(chat)) / sum(r["streaming_s"] for r in chat)
                for chat in chats if sum(r["streaming_s"] for r in chat) > 0]
    ttft = [r["ttft_s"] for r in rows]
    return {"aggregate_tok_s": round(sum(r["tokens"] for r in rows) / wall_s, 2), "wall_s": round(wall_s, 2),
            "per_chat_tok_s": round(statistics.median(per_chat), 2) if per_chat else None,
            "ttft_median_s": round(statistics.median(ttft), 3), "ttft_max_s": round(max(ttft), 3),
            "tokens": sum(r["tokens"] for r in rows)}


def medians(summaries):
    """One summary per figure: the median over the repeats (their count in `runs`)."""
    figures = {key: [s[key] for s in summaries if s[key] is not None] for key in summaries[0]}
    return {key: round(statistics.median(v), 3) if v else None for key, v in figures.items()} | {"runs": len(summaries)}


def run(args):
    questions = [json.loads(line)["turns"] for line in read_input(args.turns_file).splitlines() if line.strip()]
    if len(questions) < max(args.sizes):
        raise SystemExit(f"bench concurrent: {args.turns_file} has {len(questions)} questions, fewer than {max(args.sizes)}")
    flags = [*(["--model", args.model] if args.model else []), "--budget", str(args.budget), *args.h2o_args.split()]
    results = {"meta": {"command": args.command_line, "sizes": args.sizes, "turns": args.turns,
                        "max_tokens": args.max_tokens, "budget": args.budget, "threads": args.threads,
                        "repeats": args.repeats}, "sizes": {}}
    with contextlib.ExitStack() as stack:
        servers = {arm: stack.enter_context(app_server([*flags, "--concurrency", str(concurrency)], args.threads))
                   for arm, concurrency in (("together", max(args.sizes)), ("one_at_a_time", 1))}
        for url, process in servers.values():  # both load their models at once
            wait_healthy(url, process)
        model = served_model(servers["together"][0])
        for url, _ in servers.values():  # the first request of a process pays for its warm-up
            run_chat(url, model, questions[0][:1], 4)
        for n in args.sizes:
            chats = [q[: args.turns] for q in questions[:n]]
            runs, texts = {"together": [], "one_at_a_time": []}, {}
            for r in range(args.repeats):
                for arm in (("together", "one_at_a_time") if r % 2 == 0 else ("one_at_a_time", "together")):
                    wall, chat_rows = run_arm(servers[arm][0], model, chats, args.max_tokens, arm == "together")
                    runs[arm].append(summary(wall, chat_rows))
                    texts.setdefault(arm, [[row["text"] for row in chat] for chat in chat_rows])
                    print(f"{n} chats, {arm}, run {r + 1}: {runs[arm][-1]}", flush=True)
            row = {arm: medians(summaries) for arm, summaries in runs.items()}
            row.update({f"{arm}_texts": arm_texts for arm, arm_texts in texts.items()})
            row["same_replies"] = texts["together"] == texts["one_at_a_time"]
            results["sizes"][n] = row
    alone = results["sizes"].get(1, {}).get("one_at_a_time")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrent.json").write_text(json.dumps(results, indent=1))
    (out / "concurrent.md").write_text(markdown(results, alone))
    print(markdown(results, alone))


def markdown(results, alone):
    """The table: per N, both arms, and the ratios to one chat alone."""
    lines = [f"Command: `{results['meta']['command']}`", "",
             "| chats | arm | aggregate tok/s | x one chat alone | per-chat tok/s | x alone | TTFT median s | TTFT max s | same replies |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, row in results["sizes"].items():
        for arm in ("together", "one_at_a_time"):
            s = row[arm]
            agg = f"{s['aggregate_tok_s'] / alone['aggregate_tok_s']:.2f}x" if alone else ""
            per = f"{s['per_chat_tok_s'] / alone['per_chat_tok_s']:.2f}x" if alone and s["per_chat_tok_s"] else ""
            lines.append(f"| {n} | {arm.replace('_', ' ')} | {s['aggregate_tok_s']} | {agg} | {s['per_chat_tok_s']} | "
                         f"{per} | {s['ttft_median_s']} | {s['ttft_max_s']} | {row['same_replies']} |")
    return "\n".join(lines) + "\n"
