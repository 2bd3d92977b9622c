"""`python -m h2o_chat.bench reopen`: a long story reopened from its saved cache, against replaying it.

Stories of --lengths tokens are cut from --text as alternating user and assistant messages (no
reply is generated: a 35,000-token story is fed, not written) and fed through a ChatSession with a
data folder, in a fresh process: that feed is the replay every reopen cost before the cache was
saved (its seconds), and the state it leaves is saved beside the conversation (its MiB). Then,
per story in another fresh process (the model loaded first, not timed): `ChatSession.open` from
the saved cache, its seconds and the tokens it computed (0: nothing replayed), and a second open
in the same process. Then the page (`--page`, Debian's chromium): the app started anew on that
data folder (a restart), each story picked in *Saved conversations* and restored, timed from the
click until its messages and its stats are drawn; then the page reloaded (the live session
attached), timed the same way.

Also what saving costs a reply (a chat of --replies short replies: the ms the reply's end waits
for the state's copy, the ms the background thread takes to write it, MiB per state and states
per reply), and Open WebUI's edit-and-regenerate pattern through /v1 with the real openai client:
a story of 5 messages, an edit of message 3 and a regenerate, then the story's first 3 and first 5
messages resent; the share of their prompt reused, with saved caches and with --kv-disk-mib 0
(the app before them).
"""

import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .common import api_client, app_server, read_input, served_model, wait_healthy, write_results

MESSAGE_TOKENS = 250  # one message of the story (fewer in a short story: at least 8 messages)


def story_messages(tokenizer, text, n_tokens):
    """Alternating user / assistant messages cut from `text`, about n_tokens tokens rendered."""
    from ..chat.conversation import Message

    sample = text[:4000]
    chars_per_token = len(sample) / max(1, len(tokenizer(sample, add_special_tokens=False).input_ids))
    size = max(1, round(chars_per_token * min(MESSAGE_TOKENS, n_tokens // 8)))
    messages, pos, total = [], 0, 0
    while total < n_tokens:
        chunk = text[pos : pos + size]
        if not chunk:
            raise ValueError(f"the text holds fewer than {n_tokens} tokens")
        pos += size
        total += len(tokenizer(chunk, add_special_tokens=False).input_ids) + 5  # the template's head and end
        if not messages:  # a first line of its own (a few tokens more): the page's saved list names a story by it
            chunk = f"A story of {n_tokens:,} tokens. {chunk}"
        messages.append(Message("user" if len(messages) % 2 == 0 else "assistant", chunk))
    return messages


def load(args):
    from ..models.load import load_model

    return load_model(args["model"], dtype=args["dtype"], quantization=args["quantization"])


def build(args, data_dir, queue):
    """In a fresh process: every story fed (timed: the replay) and saved; then a short chat timed per reply."""
    from ..chat import saved_kv
    from ..chat.conversation import Conversation
    from ..chat.session import ChatSession

    model, tokenizer = load(args)
    text, cache = read_input(args["text"]), dict(budget=args["budget"])
    stories = []
    for n_tokens in args["lengths"]:
        conversation = Conversation(messages=story_messages(tokenizer, text, n_tokens))
        conversation.settings.cache.budget = args["budget"]
        start = time.perf_counter()
        session = ChatSession.from_conversation(model, tokenizer, conversation, data_dir)
        replay_s = time.perf_counter() - start
        session.autosave()
        saved_kv.flush(600)
        files = list((Path(data_dir) / "kv" / session.id).glob("*.safetensors"))
        stories.append({"tokens": len(session.ledger), "id": session.id, "messages": len(conversation.messages),
                        "asked": n_tokens,
                        "replay_s": round(replay_s, 2), "disk_MiB": round(sum(f.stat().st_size for f in files) / 2**20, 2)})
        print(f"{stories[-1]['tokens']} tokens: replayed in {replay_s:.1f} s, saved", flush=True)
        session.close()
    session = ChatSession(model, tokenizer, cache=cache, temperature=0, max_new_tokens=args["new_tokens"],
                          data_dir=data_dir)
    waits, real = [], session._save_state

    def timed():  # what the reply's end waits for: the state's copy (the write runs in the background)
        start = time.perf_counter()
        real()
        waits.append(time.perf_counter() - start)

    session._save_state = timed
    first_write = len(saved_kv.WRITER.written)
    for i in range(args["replies"]):
        "".join(session.send(f"Turn {i}: tell me more about the lighthouse and its keeper."))
        saved_kv.flush(600)
    writes = saved_kv.WRITER.written[first_write:]
    queue.put({"stories": stories, "waits_ms": [w * 1000 for w in waits],
               "writes": [(w.bytes, w.seconds * 1000) for w in writes], "dtype": str(model.dtype)})


def reopen(args, data_dir, conversation_id, queue):
    """In a fresh process: the model loaded, then the story opened from its saved cache, twice."""
    from ..chat.session import ChatSession

    model, tokenizer = load(args)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        session = ChatSession.open(model, tokenizer, conversation_id, data_dir)
        times.append(time.perf_counter() - start)
        computed, notices = session.timeline.tokens_processed, session.take_notices()
        session.close()
    queue.put({"open_s": round(times[0], 3), "open_again_s": round(times[1], 3), "computed": computed,
               "notices": " ".join(notices)})


def in_fresh_process(target, *args):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def page_opens(flags, data_dir, stories):
    """{tokens: (restore_s, reload_s)} of each story opened in the page of a freshly started app
    on `data_dir`, or None without chromium and Playwright."""
    from .page import can_drive, chromium_page

    if not can_drive():
        return None
    # drawn: every message of the story, and the stats of its cache (its tokens seen)
    shown = ("([rows, seen]) => document.querySelectorAll('#chat .message-row').length === rows && "
             "document.querySelector('#stats').innerText.includes(seen + ' tokens seen')")
    times = {}
    with app_server(flags, data_dir=str(data_dir)) as (url, app):
        wait_healthy(url, app)
        with chromium_page(url) as page:
            for story in stories:
                if not page.locator("#saved input").is_visible():  # closed on each reload
                    page.get_by_text("Saved conversations and export").click()
                drawn = [story["messages"], f"{story['tokens']:,}"]
                picker = page.locator("#saved input")
                picker.click()
                options = page.locator(f"#{picker.get_attribute('aria-controls')}").get_by_role("option")
                options.filter(has_text=f"A story of {story['asked']:,} tokens").first.click()
                start = time.perf_counter()
                page.click("#restore")
                page.wait_for_function(shown, arg=drawn, polling=20)
                restore_s = time.perf_counter() - start
                start = time.perf_counter()
                page.reload()
                page.wait_for_function(shown, arg=drawn, polling=20)
                times[story["tokens"]] = (round(restore_s, 2), round(time.perf_counter() - start, 2))
                print(f"page: {story['tokens']} tokens restored in {restore_s:.2f} s", flush=True)
    return times


def openwebui_branches(client, model, max_tokens=32):
    """Open WebUI's pattern: a story of 5 messages, an edit of message 3 and a regenerate, then the
    story's first 3 and first 5 messages resent. Returns the usage of those last two requests."""
    def ask(messages):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content, r.usage

    turns = ["Tell me a story about a lighthouse keeper named Mira.", "What did she find on the beach?",
             "Who came to the door that night?"]
    messages = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": ask(messages)[0]})
    edited = messages[:2] + [{"role": "user", "content": "What did she find in the cave?"}]
    ask(edited)
    ask(edited)  # regenerate
    return ask(messages[:3])[1], ask(messages[:5])[1]


def v1_reuse(args, flags):
    """The older-branch reuse through /v1, for the app started with `flags`."""
    rows = []
    for arm, extra in (("saved caches", []), ("--kv-disk-mib 0 (before)", ["--kv-disk-mib", "0"])):
        with app_server([*flags, *extra], args.threads) as (url, process):
            wait_healthy(url, process)
            client = api_client(url)
            usages = openwebui_branches(client, served_model(url), args.max_tokens)
        for resent, usage in zip((3, 5), usages):
            cached = usage.prompt_tokens_details.cached_tokens
            rows.append({"arm": arm, "resent": f"first {resent} messages", "prompt_tokens": usage.prompt_tokens,
                         "cached_tokens": cached, "reused": f"{cached / usage.prompt_tokens:.1%}"})
            print(rows[-1], flush=True)
    return rows


def run(args):
    settings = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization, "text": args.text,
                "lengths": args.lengths, "budget": args.budget, "replies": args.replies, "new_tokens": args.new_tokens}
    torch.set_num_threads(torch.get_num_threads())
    flags = ["--model", args.model] if args.model else []
    flags += ["--dtype", args.dtype, "--quantization", args.quantization, "--budget", str(args.budget)]
    with tempfile.TemporaryDirectory(prefix="h2o-bench-reopen-") as data_dir:
        built = in_fresh_process(build, settings, data_dir)
        rows = []
        for story in built["stories"]:
            opened = in_fresh_process(reopen, settings, data_dir, story["id"])
            rows.append({"tokens": story["tokens"], "messages": story["messages"], "replay_s": story["replay_s"],
                         **opened, "disk_MiB": story["disk_MiB"]})
            print(rows[-1], flush=True)
        pages = page_opens(flags, data_dir, built["stories"]) if args.page else None
        for row in rows:
            row["page_restore_s"], row["page_reload_s"] = pages[row["tokens"]] if pages else ("", "")
    sizes = [b for b, _ in built["writes"]]
    writes = [{"replies": args.replies, "states_written": len(built["writes"]),
               "MiB_per_state": round(statistics.median(sizes) / 2**20, 2) if sizes else "",
               "reply_end_wait_ms": round(statistics.median(built["waits_ms"]), 1) if built["waits_ms"] else "",
               "background_write_ms": round(statistics.median(ms for _, ms in built["writes"]), 1) if sizes else ""}]
    meta = {"command": args.command_line, "budget": args.budget, "dtype": built["dtype"], "threads":
            torch.get_num_threads(), "note": "open_s: ChatSession.open in a fresh process, the model already loaded; "
            "replay_s: the same story fed through a fresh cache (what every open cost before); page_restore_s: "
            "Restore in the page of a freshly started app until the story and its stats are drawn; page_reload_s: "
            "the page reloaded after that (the live session attached)"}
    write_results(args.out, "reopen", rows, ["tokens", "messages", "replay_s", "open_s", "open_again_s", "page_restore_s",
                                             "page_reload_s", "computed", "disk_MiB", "notices"], meta)
    write_results(args.out, "reopen_writes", writes, list(writes[0]), meta)
    if not args.skip_v1:
        v1 = v1_reuse(args, flags)
        write_results(args.out, "reopen_v1", v1, ["arm", "resent", "prompt_tokens", "cached_tokens", "reused"], meta)
