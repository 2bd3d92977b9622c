"""`python -m h2o_chat.bench panel`: what the live panel costs. In this process: decode tokens/s
with the panel refreshed as the app does while streaming against not at all (interleaved), and the
render time of a long conversation's panel. Then in the real page (page.py: the app in its own
process, chromium): decode tokens/s, TTFT and the browser's CPU time per reply.
"""

import statistics
import time

from ..chat.session import ChatSession
from ..models.load import load_model
from . import page
from .common import text_tokens, write_results


def run(args):
    # here, not at the top: ui.state imports gradio, which no other benchmark needs
    from ..ui import draw
    from ..ui.state import CHAT_EVERY_S, PANEL_EVERY_S

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
                draw.panel(session)
                last = time.perf_counter()
        rows.append({"measure": "decode with panel" if refresh else "decode without panel",
                     "value": round(session.last_turn.new_tokens / session.last_turn.decode_s, 2), "unit": "tokens/s"})
        print(rows[-1], flush=True)
    text = text_tokens(tokenizer, args.text, args.tokens)
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=args.budget), max_new_tokens=1)
    "".join(session.send(tokenizer.decode(text[0])))  # prefilled, and the one-token reply drawn
    for _ in range(3):
        start = time.perf_counter()
        view = draw.panel(session)
        rows.append({"measure": f"render panel of {len(session.ledger):,} tokens", "value":
                     round(time.perf_counter() - start, 3), "unit": "s"})
        print(rows[-1], f"{len(view['token_map']) / 1e6:.2f} MB of HTML", flush=True)
    del model  # the page's app loads its own
    turns = page.page_speed(args.model, args.budget, args.turns, args.new_tokens, args.app_dir) if args.turns else None
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
