"""`python -m h2o_chat.bench.evaluate template-ppl`: does keeping the chat template's control tokens
(CacheConfig.keep_template) help H2O on dialogue?

The chats are the stories a `bench story` run wrote (its story_turns.json; the arm --arm, the
model's own replies), each rendered as the app renders it: SillyTavern's leading system messages
as the system prompt, the greeting, then every user turn and reply, all turns closed. Each chat
is streamed through each cache (the cache evicting every --chunk tokens, as `evaluate ppl` does)
at budgets that are fractions of that chat's length: full; h2o; h2o with the template's control
tokens pinned (template_ranges: "<|im_end|>", "\\n", "<|im_start|>", "assistant", "\\n" of every
turn), counted against the budget. Perplexity over every token, and over the replies' words only
(the text a story writer reads). A chat whose budget leaves no room for the template's tokens
beside the sinks and the recent window is refused, as a pin is: each budget runs every cache on
the chats that fit it, and its rows count them ("chats": 7/10).
"""

import json
import math
import time
from pathlib import Path

import torch

from ..cache.config import CacheConfig
from ..cache.h2o import H2OCache, PinRefused, check_pins, pinned_slots
from ..chat.conversation import Message
from ..chat.template import render, template_ranges, token_ids
from ..models.load import load_model
from .common import write_results
from .ppl import streaming_nlls
from .story import GREETING, SYSTEM, TURNS


def story_chats(path, arm):
    """[(system_prompt, [Message])]: each story of `arm` in a story run's story_turns.json, whole."""
    rows = json.loads(Path(path).read_text())["rows"]
    by_seed = {}
    for r in sorted((r for r in rows if r["policy"] == arm), key=lambda r: (r["seed"], r["turn"])):
        by_seed.setdefault(r["seed"], []).append(r)
    if not by_seed:
        raise ValueError(f"{path} holds no story of the arm {arm!r}")
    chats = []
    for turns in by_seed.values():
        messages = [Message("assistant", GREETING)]
        for r in turns:
            messages += [Message("user", TURNS[r["turn"] - 1]), Message("assistant", r["text"])]
        chats.append(("\n\n".join(SYSTEM), messages))  # the system prompt as the API joins leading system messages
    return chats


def reply_mask(segments):
    """[n - 1] bool: which predicted tokens (tokens[1:]) are the words of an assistant message."""
    mask = [s.text and s.role == "assistant" for s in segments for _ in s.ids]
    return torch.tensor(mask[1:])


def chat_nlls(model, ids, segments, feed, pins=(), **settings):
    """(nll sum over every token, count, nll sum over the replies' words, count) of one chat
    streamed through H2OCache(**settings) with `pins` protected from the start."""
    cache = H2OCache(model, **settings)
    cache.set_pins(pins)
    nlls = streaming_nlls(model, torch.tensor([ids]), cache, feed).double()
    mask = reply_mask(segments)
    return nlls.sum().item(), len(nlls), nlls[mask].sum().item(), int(mask.sum())


def ppl_row(label, fraction, args, sums, **more):
    nll_all, n_all, nll_reply, n_reply = (sum(x) for x in zip(*sums)) if sums else (0, 0, 0, 0)
    return {"cache": label, "budget": f"{fraction:.0%}", "n_recent": "auto" if args.n_recent is None else
            f"{args.n_recent:.0%}", "tokens": n_all, "ppl": round(math.exp(nll_all / n_all), 3) if n_all else "",
            "ppl_replies": round(math.exp(nll_reply / n_reply), 3) if n_reply else "", **more}


def run(args):
    """Per budget, over the chats whose template tokens fit it (the others are counted, not run):
    full, h2o, h2o + template on the same chats."""
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    chats = [render(tokenizer, system, messages) for system, messages in story_chats(args.stories, args.arm)]
    chats = chats[: args.chats]
    ids = [token_ids(segments) for segments in chats]
    full = {}  # chat -> its full cache's sums, computed once for the first budget it fits
    rows = []
    for fraction in args.budgets:
        fit, settings, pins, limits = [], [], [], []
        for i in ids:
            budget = max(1, round(fraction * len(i)))
            settings.append(dict(policy="h2o", budget=budget, prefill_chunk=args.chunk,
                                 n_recent=None if args.n_recent is None else round(args.n_recent * budget)))
            pins.append(template_ranges(tokenizer, chats[len(pins)]))
            limits.append(CacheConfig(**settings[-1]).resolve(len(i)))
            try:
                check_pins(pins[-1], limits[-1])
                fit.append(len(pins) - 1)
            except PinRefused as e:
                refused = str(e)
        counts = {"chats": f"{len(fit)}/{len(chats)}", "template_tokens": sum(pinned_slots(pins[c], limits[c].n_sink) for c in fit),
                  "budget_slots": sum(settings[c]["budget"] for c in fit)}
        for c in fit:
            full[c] = full.get(c) or chat_nlls(model, ids[c], chats[c], args.feed, policy="full", prefill_chunk=args.chunk)
        rows.append(ppl_row("full", fraction, args, [full[c] for c in fit], **counts, seconds=""))
        start = time.perf_counter()
        plain = [chat_nlls(model, ids[c], chats[c], args.feed, **settings[c]) for c in fit]
        rows.append(ppl_row("h2o", fraction, args, plain, **counts, seconds=round(time.perf_counter() - start, 1)))
        start = time.perf_counter()
        kept = [chat_nlls(model, ids[c], chats[c], args.feed, pins[c], **settings[c]) for c in fit]
        rows.append(ppl_row("h2o + template", fraction, args, kept, **counts,
                            seconds=round(time.perf_counter() - start, 1)))
        if len(fit) < len(chats):
            print(f"budget {fraction:.0%}: {len(chats) - len(fit)} chats refused, e.g. {refused}", flush=True)
        for r in rows[-3:]:
            print(r, flush=True)
    meta = {"command": args.command_line, "stories": str(args.stories), "arm": args.arm, "chats": len(chats),
            "tokens": sum(map(len, ids)), "chunk": args.chunk, "dtype": str(model.dtype),
            "note": "per budget, the chats whose template tokens fit it; template_tokens: the slots they take"}
    write_results(args.out, "template_ppl", rows, ["cache", "budget", "n_recent", "chats", "template_tokens",
                                                   "budget_slots", "tokens", "ppl", "ppl_replies", "seconds"], meta)

