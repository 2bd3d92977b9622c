"""`python -m h2o_chat.bench soak`: one session over many turns, as a user who leaves the app
running would: per turn RSS, time to first token, speed, and whether the replies degenerate
(distinct bigrams, reply lengths); a failed turn ends the run with the error, after the rows so far
are written.
"""

import json
import statistics

from tqdm import tqdm

from ..chat.session import ChatSession
from ..models.load import load_model
from .common import rss_kib, user_turns, write_plot, write_results


def distinct_bigrams(ids):
    """Share of a reply's token bigrams that are distinct: near 1 for varied text, low for loops."""
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 1.0


def run(args):
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
                     "rss_MiB": round(rss_kib("VmRSS") / 1024, 1), "ttft_s": round(st["ttft_s"], 3),
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
