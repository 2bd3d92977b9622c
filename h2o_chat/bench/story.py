"""`python -m h2o_chat.bench story`: a 36-turn role-play story through `/v1`, sent as SillyTavern sends it.

SillyTavern's Chat Completion (source "Custom (OpenAI-compatible)") resends the whole story every
turn: its main prompt, the character card and "[Start a new Chat]" as leading system messages, the
character's greeting as the first assistant message, then every turn so far; with its default
samplers (temperature 1, top_p 1, frequency and presence penalties 0, an empty logit_bias, 300 new
tokens, streamed). One app serves every arm: each seed's story runs once per arm, on the same
requests (the same user turns, the seed of turn t is seed * 1000 + t; each arm resends its own
replies). An arm is the request's `"h2o"` object (ARMS): `h2o` the app's cache (budget from the
flags), `full` never evicts, `sink` StreamingLLM's sinks + newest tokens at the same budget.

Per turn and arm: prompt tokens, cached tokens (what the server did not recompute: from turn 2 on,
a server that reuses the previous reply has nearly all of the prompt cached), whether the previous
reply was reused (the turn computed no more than what the client added after it: the reply's
end-of-turn and the new message), TTFT, the reply's tokens, and whether it is degenerate. `--app-dir` runs the app from another checkout
(a worktree of an older commit), to measure before and after a change with the same client.
"""

import json
import math
import re
import statistics
import threading
import time
import zlib
from pathlib import Path

from ..cache.config import CacheConfig
from .common import REPO, api_client, app_server, served_model, wait_healthy, write_results

CHARACTER = "Mira"
SYSTEM = [  # SillyTavern's default prompt order, as separate system messages
    f"Write {CHARACTER}'s next reply in a fictional chat between {CHARACTER} and User.",
    f"{CHARACTER} is a lighthouse keeper on the storm coast of Veyra, forty years old, dry-humoured and "
    "careful. She keeps a logbook of every ship that passes and distrusts the harbour council.",
    f"[{CHARACTER}'s personality: patient, sardonic, brave when it matters, fond of tea and old maps]",
    "[Circumstances and context of the dialogue: a winter night; a stranger (User) has knocked at the "
    "lighthouse door, soaked, asking for shelter and carrying a sealed letter.]",
    "[Start a new Chat]",
]
GREETING = ("*The door creaks open against the wind. Mira raises her lantern and looks you over.* "
            "\"You picked a fine night to be lost. Come in before the sea takes you, and tell me why "
            "you are carrying the council's seal.\"")
TURNS = [
    "I step inside, shaking off the rain. \"Thank you. I'm not lost, I was sent to find you.\"",
    "\"The council says a ship went missing near your light three nights ago. The Heron.\"",
    "I hand her the letter. \"They want your logbook. All of it, from the autumn on.\"",
    "\"I didn't write it. I only carry it. Do you have anything hot to drink?\"",
    "I sit by the stove and warm my hands. \"Did you see the Heron that night?\"",
    "\"Someone on the council thinks you put the light out on purpose.\"",
    "\"I don't believe them. But I need proof to bring back.\"",
    "I look at the old maps on the wall. \"Which of these is the reef the Heron would have passed?\"",
    "\"Who else lives out here? Anyone who could have seen the ship?\"",
    "\"Tell me about the fisherman. Can we reach him tonight?\"",
    "The wind howls and the lamp flickers. \"Is that normal?\"",
    "\"Let's climb to the lamp room. I want to see the mechanism.\"",
    "I notice scratches on the lamp housing. \"These look fresh. Were they here before?\"",
    "\"Someone was up here. Who has a key besides you?\"",
    "\"Your brother? Where is he now?\"",
    "I find a torn piece of sailcloth under the stairs. \"Look at this.\"",
    "\"It has a painted bird on it. A heron.\"",
    "\"So someone from the ship was here. Alive, after the wreck.\"",
    "A knock comes at the door below. I freeze. \"Are you expecting anyone?\"",
    "\"I'll stay behind you. Open it slowly.\"",
    "It is a young sailor, shivering, with a bandaged arm. \"Ask him his name.\"",
    "\"He says he was the Heron's cabin boy. He says the light was out.\"",
    "\"Why would the light be out if you were here the whole night?\"",
    "\"Then someone drugged your tea. Who brought you supplies that day?\"",
    "\"The council's own supply boat. That is not a coincidence.\"",
    "I turn to the boy. \"What was the Heron carrying?\"",
    "\"Silver for the harbour treasury. And it never arrived.\"",
    "\"So the council sank its own ship and blamed you. We need the logbook as evidence.\"",
    "\"Where do you keep the logbook? Somewhere safe?\"",
    "\"Then we hide it and make a copy for the council.\"",
    "At dawn the storm calms. \"The supply boat is coming. I can see its sail.\"",
    "\"Let them come. We'll be ready. What's your plan?\"",
    "The councilman steps ashore and demands the logbook. I hand him the copy.",
    "\"He's reading it. He's gone pale. He knows the page about the supply boat is there.\"",
    "\"The boy is ready to testify. Shall we sail to the harbour together?\"",
    "On the deck, looking back at the lighthouse, I ask: \"Will you ever leave it?\"",
]
# SillyTavern's default Chat Completion samplers (its default preset), and its default reply length
ST_SAMPLERS = {"temperature": 1, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
ST_MAX_TOKENS = 300
ARMS = {"h2o": {}, "full": {"policy": "full"}, "sink": {"policy": "sink"},  # arm -> the request's "h2o" object
        "template": {"keep_template": True}}  # h2o with the chat template's tokens never evicted
REUSE_SLACK = 2  # tokens a reused reply may still cost (a stop-string cut inside a token is re-tokenized)

HYPHEN_RUN = re.compile(r"\b[A-Za-z]+(?:-[A-Za-z]+){4,}\b")  # five or more words joined by hyphens
# Parts of one or two letters that are English words: "son-in-law", "up-to-date", "Mira-I-Love..."
SHORT_WORDS = frozenset("a i o of to in on at by is it be go up so no or me my we he us an as do if am".split())
FRAGMENTS = 2  # non-word parts in one hyphen run that make it degenerate ("Ere-ry-Mer-Euse-A-Ar": ry, Ar)


def fragments(run):
    """The parts of a hyphen run that are not words: one or two letters, not in SHORT_WORDS."""
    return [part for part in run.split("-") if len(part) <= 2 and part.lower() not in SHORT_WORDS]


def degenerate(text, tokens):
    """A reply that is no longer language: a run of hyphen-joined fragments (what the issue saw),
    text so fragmented that a token holds under 2.5 characters (English holds ~4 in SmolLM2's
    tokenizer), or a loop (the text compresses to under a fifth). A hyphen run counts only with at
    least FRAGMENTS parts of one or two letters that are not words: English joins whole words
    ("great-great-grandfather", "state-of-the-art"), the collapse joins pieces of them."""
    if any(len(fragments(run.group())) >= FRAGMENTS for run in HYPHEN_RUN.finditer(text)):
        return True
    if tokens >= 20 and len(text) / tokens < 2.5:
        return True
    raw = text.encode()
    return len(raw) >= 200 and len(zlib.compress(raw)) < len(raw) / 5


def st_messages(replies, turn):
    """The body's messages for turn `turn` (0-based): what SillyTavern resends."""
    messages = [{"role": "system", "content": s} for s in SYSTEM] + [{"role": "assistant", "content": GREETING}]
    for i in range(turn + 1):
        messages.append({"role": "user", "content": TURNS[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def run_story(client, model, seed, policy, turns, max_tokens, samplers=ST_SAMPLERS):
    """One story: a row per turn."""
    replies, rows = [], []
    extra = {"h2o": ARMS[policy]} if ARMS[policy] else {}
    for turn in range(turns):
        start, first, pieces, usage = time.perf_counter(), None, [], None
        stream = client.chat.completions.create(
            model=model, messages=st_messages(replies, turn), max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, seed=seed * 1000 + turn, extra_body={**samplers, **extra})
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    pieces.append(choice.delta.content)
        text = "".join(pieces)
        replies.append(text)
        prompt, cached = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
        before = rows[-1] if rows else None
        added = prompt - before["prompt_tokens"] - before["completion_tokens"] if before else prompt
        rows.append({"seed": seed, "policy": policy, "turn": turn + 1, "prompt_tokens": prompt, "cached_tokens": cached,
                     "cached_share": round(cached / prompt, 4), "recomputed": prompt - cached,
                     "reply_reused": before is not None and prompt - cached <= added + REUSE_SLACK,
                     "completion_tokens": usage.completion_tokens,
                     "ttft_s": round((first or time.perf_counter()) - start, 3),
                     "degenerate": degenerate(text, usage.completion_tokens), "text": text})
        r = rows[-1]
        reuse = "" if turn == 0 else "reused " if r["reply_reused"] else "RECOMPUTED the previous reply "
        print(f"seed {seed} {policy} turn {r['turn']}: cached {cached}/{prompt} {reuse}ttft {r['ttft_s']} s "
              f"{r['completion_tokens']} tokens{' DEGENERATE' if r['degenerate'] else ''}: {text[:70]!r}", flush=True)
    return rows


def wilson(k, n, z=1.96):
    """The Wilson score interval of a proportion: k successes in n trials -> (low, high), at 95% for
    z = 1.96. Unlike k/n +- z*se it stays inside [0, 1] and is not empty at k = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def rate(k, n):
    """"k/n = 12.5% [5.1, 27.0]": a count, its rate and its 95% Wilson interval, in percent."""
    low, high = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * low:.1f}, {100 * high:.1f}]" if n else "0/0"


def degeneration(rows):
    """(degenerate replies, replies, stories with a degenerate reply, stories) of one arm's rows."""
    stories = {}
    for r in rows:
        stories[r["seed"]] = stories.get(r["seed"], False) or r["degenerate"]
    return sum(r["degenerate"] for r in rows), len(rows), sum(stories.values()), len(stories)


def summary(rows, policies, seeds, budget=None):
    """Per arm, from turn 2: turns that reused the previous reply, turns with >= 95% of the prompt
    cached, the median and worst cached share; median TTFT of the first and last five turns;
    turns whose prompt was over `budget` (evicting, for a bounded arm); degenerate replies, and
    stories with at least one, each with its 95% interval. Replies of one story are not
    independent (a broken reply is resent and followed): the story count is the one to judge by."""
    out = []
    for policy in policies:
        arm = [r for r in rows if r["policy"] == policy and r["seed"] in seeds]
        later = [r for r in arm if r["turn"] >= 2]
        n = max((r["turn"] for r in arm), default=0)
        replies_bad, replies, stories_bad, stories = degeneration(arm)
        out.append({"policy": policy, "turns": len(arm),
                    "reply_reused": f"{sum(r['reply_reused'] for r in later)}/{len(later)}",
                    "cached_95": f"{sum(r['cached_share'] >= 0.95 for r in later)}/{len(later)}",
                    "median_cached": round(statistics.median(r["cached_share"] for r in later), 3) if later else "",
                    "worst_cached": round(min(r["cached_share"] for r in later), 3) if later else "",
                    "ttft_first5_s": round(statistics.median(r["ttft_s"] for r in arm if r["turn"] <= 5), 3),
                    "ttft_last5_s": round(statistics.median(r["ttft_s"] for r in arm if r["turn"] > n - 5), 3),
                    "over_budget": "" if budget is None else f"{sum(r['prompt_tokens'] > budget for r in arm)}/{len(arm)}",
                    "degenerate": rate(replies_bad, replies), "stories_degenerate": rate(stories_bad, stories)})
    return out


def budget_of(h2o_args):
    """The app's budget in slots as these flags set it (CacheConfig's default without --budget);
    None for a fraction (resolved per prompt)."""
    words = h2o_args.split()
    given = [w.split("=", 1)[1] for w in words if w.startswith("--budget=")] + \
        [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--budget"]
    budget = float(given[-1]) if given else CacheConfig.budget
    return int(budget) if budget >= 1 else None


def run(args):
    flags = ["--model", args.model] if args.model else []
    flags += args.h2o_args.split()
    samplers = {**ST_SAMPLERS, **json.loads(args.samplers)}
    stories = [(seed, policy) for seed in args.seeds for policy in args.policies]
    with app_server(flags, args.threads, checkout=args.app_dir or REPO) as (url, process):
        wait_healthy(url, process)
        client, model = api_client(url), served_model(url)
        results = {}

        def tell(seed, policy):
            results[seed, policy] = run_story(client, model, seed, policy, args.turns, args.max_tokens, samplers)

        if args.parallel:  # every story at once: the app decodes them in one batch (TTFT then includes waiting)
            threads = [threading.Thread(target=tell, args=story, daemon=True) for story in stories]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for story in stories:
                tell(*story)
        rows = [row for story in stories for row in results.get(story, [])]
    meta = {"command": args.command_line, "app_dir": str(args.app_dir or REPO), "turns": args.turns,
            "seeds": args.seeds, "max_tokens": args.max_tokens, "h2o_args": args.h2o_args, "samplers": samplers,
            "parallel": args.parallel}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "story_turns.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    per_turn = []
    for turn in range(1, args.turns + 1):
        row = {"turn": turn}
        for policy in args.policies:
            at = [r for r in rows if r["policy"] == policy and r["turn"] == turn]
            row[f"{policy} cached"] = " ".join(f"{r['cached_share']:.2f}" + ("" if r["reply_reused"] or r["turn"] == 1
                                                                               else "*") for r in at)
            row[f"{policy} ttft_s"] = round(statistics.median(r["ttft_s"] for r in at), 3)
            row[f"{policy} degenerate"] = sum(r["degenerate"] for r in at)
        per_turn.append(row)
    write_results(out, "story", summary(rows, args.policies, args.seeds, budget_of(args.h2o_args)),
                  ["policy", "turns", "reply_reused", "cached_95", "median_cached", "worst_cached", "ttft_first5_s",
                   "ttft_last5_s", "over_budget", "degenerate", "stories_degenerate"], meta)
    write_results(out, "story_per_turn", per_turn, list(per_turn[0]), meta)
