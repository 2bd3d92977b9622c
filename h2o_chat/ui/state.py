"""What the UI pieces share: the App (the model, the defaults every new conversation gets, the
live conversations), the per-tab view state, and the small helpers every callback uses.

The server holds one ChatSession per conversation (App.live, ui/live.py); a tab shows one
(gr.State) and the browser remembers its id (gr.BrowserState), so a reload or a second tab
attaches to the live session at once, and a restarted server reopens the saved one (App.open:
from the cache saved beside it).
"""

import os
import secrets
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from ..chat import saved_kv, store
from ..chat.session import ChatSession
from ..chat.template import tokenize
from ..models.compile import Compilation
from .live import LiveSessions

# How often a streaming reply updates the page. The browser redraws each update and, on a small
# machine, shares the cores with the decode: in headless chromium on 2 cores, the chat at every
# token cost the page ~0.9 CPU-seconds more per 96-token reply than 10 updates a second did
# (bench_page's browser CPU, this build against one patched to send every token, interleaved).
CHAT_EVERY_S = 0.1
PANEL_EVERY_S = 0.5  # the live view (token map, retention map, stats); the charts wait for the end
WATCH_EVERY_S = 1.0  # a watched /v1 conversation: chat and the whole panel, charts included, when it changed
LIST_EVERY_S = 3.0  # the saved list looks for new live /v1 conversations (and sends only a change)
BROWSER_KEY = "h2o-chat-conversation"
VIEW_KEY = "h2o-chat-view"  # the panel's layer and head, remembered by the browser


@dataclass
class App:
    model: object
    tokenizer: object
    cache_defaults: dict
    data_dir: str | None
    chat_defaults: dict = field(default_factory=dict)
    concurrency: int = 1
    batcher: object = None  # batch.Batcher shared with the API when --concurrency > 1
    # () -> [(session, client)]: the conversations the /v1 API holds live (serve/cli.py hands the
    # pool's `watchable`; ui/ never imports serve/); None: no API beside the page
    watchable: object = None
    compile: str = Compilation.compile  # the sessions' compiled decode step (models/compile.py)
    live: LiveSessions = field(default_factory=LiveSessions)  # the page's conversations, one session each
    prefill: "PrefillSpeed" = field(default_factory=lambda: PrefillSpeed())  # how fast this machine reads a prompt

    @property
    def n_layers(self):
        return self.model.config.num_hidden_layers

    @property
    def n_heads(self):
        return self.model.config.num_key_value_heads

    def new_session(self):
        return ChatSession(self.model, self.tokenizer, cache=dict(self.cache_defaults), data_dir=self.data_dir,
                           batcher=self.batcher, compile=self.compile, **self.chat_defaults)

    def open(self, conversation_id, progress=None):
        """A saved conversation, its cache loaded from the state saved beside it; replayed through a
        fresh cache when that cannot be used (with a progress bar when given, and a notice why).
        A replay's speed is this machine's prefill speed: it is recorded (self.prefill)."""
        if not conversation_id:
            raise ValueError("choose a saved conversation first")
        on_progress = None
        if progress is not None:
            on_progress = lambda done, total: progress(done / max(total, 1), desc="Replaying the conversation")  # noqa: E731
        started = time.perf_counter()
        try:
            session = ChatSession.open(self.model, self.tokenizer, conversation_id, self.data_dir,
                                       on_progress=on_progress, batcher=self.batcher, compile=self.compile)
        except store.SessionFileError as e:
            raise ValueError(str(e)) from None
        self.prefill.record(session.stats["tokens_processed"], time.perf_counter() - started)
        return session

    def attach(self, tab, conversation_id, progress=None):
        """The session `tab` shows for `conversation_id` (what the browser remembers, or picked):
        the live one at once, else the saved one opened (App.open), else a new chat. ValueError
        when the saved one cannot be opened."""
        if conversation_id and (self.live.get(conversation_id) is not None or self.is_saved(conversation_id)):
            return self.live.attach(tab, conversation_id, lambda: self.open(conversation_id, progress))
        return self.live.add(tab, self.new_session())

    def held(self, tab, session, progress=None):
        """The session an action of `tab` acts on, for the one it shows: the live one of that
        conversation (one let go while the tab slept comes back through App.open; a tab whose
        server restarted has none: a new chat). A watched /v1 conversation is itself."""
        if isinstance(session, Watched):
            return session
        if session is None:
            return self.live.add(tab, self.new_session())
        return self.live.held(tab, session, lambda cid: self.open(cid, progress) if cid else self.new_session())

    def delete(self, conversation_id):
        """Delete a saved conversation: its files go, and the live session (if any) with them."""
        if any(s.id == conversation_id for s, _ in self.live_api()):
            raise ValueError("That is a live /v1 conversation: its API client is still using it.")
        live = self.live.get(conversation_id)
        if live is not None and live.busy:
            raise ValueError("A reply is being written in that conversation: stop it first.")
        self.live.forget(conversation_id)
        store.delete(self.data_dir, conversation_id)

    def is_saved(self, conversation_id):
        if not (self.data_dir and conversation_id):
            return False
        try:
            return store.session_path(self.data_dir, conversation_id).is_file()
        except ValueError:
            return False

    def saved(self):
        """(label, id) of every saved conversation, newest first: title, date and message count
        (a file that cannot be read is listed too, so its error can be shown), after the ones the
        /v1 API holds live (named by their first user line and their client: picking one watches it)."""
        live = self.live_choices()
        ids = {i for _, i in live}
        saved = [(summary_label(s), s.id) for s in store.summaries(self.data_dir)] if self.data_dir else []
        return live + [(label, i) for label, i in saved if i not in ids]

    def disk_usage(self):
        """What the saved caches take on disk, in a sentence for the saved list (None without a data folder)."""
        if not self.data_dir:
            return None
        used, allowed = saved_kv.usage(self.data_dir)
        return (f"Saved caches: {used / saved_kv.MIB:,.0f} MiB of {allowed / saved_kv.MIB:,.0f} MiB on disk "
                "(--kv-disk-mib; the least recently used go first)")

    def live_choices(self):
        """(label, id) of the conversations the /v1 API holds live: the part of the list that
        changes without the page doing anything (a page's timer compares it)."""
        return [(live_label(session, client), session.id) for session, client in self.live_api()]

    def live_api(self):
        """(session, client) of every conversation the /v1 API holds live, most recent first."""
        return [(s, client) for s, client in self.watchable() if s.messages] if self.watchable else []

    def watch(self, conversation_id, own):
        """A Watched of the live /v1 conversation with this id (own: the tab's session, kept for
        later), or None when the API holds none by that id."""
        found = next(((s, client) for s, client in self.live_api() if s.id == conversation_id), None)
        return Watched(*found, own) if found else None

    def still_live(self, watched):
        return any(s is watched.session for s, _ in self.live_api())

    def browser_secret(self):
        """The key BrowserState encrypts with: kept in the data folder so that a restarted server
        can still read what the browser remembers (a fresh random key would make it unreadable)."""
        if not self.data_dir:
            return None
        path = Path(self.data_dir) / ".browser-secret"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
        return path.read_text().strip()


def summary_label(summary):
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.updated)) if summary.updated else "?"
    n = summary.n_messages
    return f"{summary.title} · {when} · {n} message{'s' if n != 1 else ''}"


def live_label(session, client):
    first = next((m["content"] for m in session.history if m["role"] == "user"), "")
    line = " ".join(first.strip().splitlines()[:1])
    line = line if len(line) <= 60 else line[:57] + "..."
    return f"● live /v1 · {client or 'an API client'} · {line}"


class Watched:
    """A conversation the /v1 API holds, shown in a tab read-only. Every read goes to the API's
    session (the panel reads its cache while the client's reply streams, as it reads a tab's
    own); every change is refused with a sentence and touches nothing: no lock is taken and nothing
    is fed, so the API client's turns go on as if no one watched. The tab's own session waits in
    `own` (held by App.live) and comes back when the API lets the watched one go."""

    def __init__(self, session, client, own):
        self.session, self.client, self.own = session, client, own
        self.drawn = None  # what the tab last drew of it (ledger length, messages, busy): redraw on change
        self.charts_drawn = None  # what its charts were drawn again for (page.Tab.charts_after)

    def __getattr__(self, name):  # reads: history, messages, ledger, cache, stats, settings, id, busy ...
        return getattr(self.session, name)

    def _refuse(self, *args, **kwargs):
        raise ValueError(f"This is a /v1 conversation ({self.client or 'an API client'}), watched read-only: "
                         "New chat or Restore to write here.")

    send = regenerate = continue_reply = undo = edit = pin = configure = reset = _refuse

    def stop(self):
        """The page's Stop stops the tab's own replies, never an API client's."""

    def catch_up(self):
        return False

    def take_notices(self):
        return []  # the API session's notices are its client's

    def changed(self):
        """True when there is something new to draw since the last call."""
        now = (len(self.session.ledger), len(self.session.messages), self.session.busy,
               self.session.messages[-1].content if self.session.messages else "")
        new, self.drawn = now != self.drawn, now
        return new

    def charts_due(self):
        """True once after each drawing: the charts are drawn again then (page.Tab.charts_after)."""
        due, self.charts_drawn = self.charts_drawn != self.drawn, self.drawn
        return due

    def live_figures(self):
        """(TTFT, tokens/s) of the API's reply streaming now, for the stats line; None when idle."""
        turn = self.session.last_turn
        if not self.session.busy or turn is None:
            return None
        speed = turn.new_tokens / turn.decode_s if turn.first_at and turn.decode_s else None
        return (turn.ttft_s if turn.first_at else None, speed)


class PrefillSpeed:
    """How fast this machine reads a prompt into the cache, in tokens/s: measured on the app's own
    prefills (each reply's prompt) and replays. One model, one machine: every session's count.
    `estimate(n)`: seconds to read n tokens, None before anything long enough was measured."""

    MIN_TOKENS = 64  # a shorter read is mostly fixed overhead: it would make every estimate too long
    KEEP = 8  # the latest measurements (the machine's load changes)

    def __init__(self):
        self._lock = threading.Lock()
        self._reads = deque(maxlen=self.KEEP)  # (tokens, seconds)

    def record(self, tokens, seconds):
        if tokens >= self.MIN_TOKENS and seconds > 0:
            with self._lock:
                self._reads.append((tokens, seconds))

    def tokens_per_s(self):
        with self._lock:
            tokens, seconds = sum(t for t, _ in self._reads), sum(s for _, s in self._reads)
        return tokens / seconds if seconds else None

    def estimate(self, n_tokens):
        speed = self.tokens_per_s()
        return n_tokens / speed if speed else None


PROBE_CHARS = 2000  # a first measurement, when none was made yet, reads this much of the message
TELL_PREFILL_S = 3.0  # a message whose prefill takes longer is announced with its estimate


def measure_prefill(app, text):
    """Measure the prefill speed on `text` (its first PROBE_CHARS characters) in a throwaway session
    with the app's cache: the first long message, before anything else was read here."""
    probe = ChatSession(app.model, app.tokenizer, cache=dict(app.cache_defaults), max_new_tokens=1)
    try:
        for _ in probe.send(text[:PROBE_CHARS]):
            pass
        turn = probe.last_turn
        app.prefill.record(turn.prompt_computed, turn.ttft_s)
    except ValueError:
        pass  # out of memory even for this: no estimate (the message itself will say what it can)
    finally:
        probe.close()


def prefill_notice(app, text):
    """A sentence for a message whose prefill will take a while here ("... about 40 s ..."), or
    None. The estimate is this machine's measured speed (App.prefill); with none measured yet
    and a message long enough to matter, a short read of its start measures it first."""
    n = len(tokenize(app.tokenizer, text, template=False))
    if n < PrefillSpeed.MIN_TOKENS * 4:
        return None
    if app.prefill.estimate(n) is None:
        measure_prefill(app, text)
    seconds = app.prefill.estimate(n)
    if seconds is None or seconds < TELL_PREFILL_S:
        return None
    return (f"This message is {n:,} tokens: reading it takes about {duration(seconds)} on this machine (measured "
            f"here: {app.prefill.tokens_per_s():,.0f} tokens/s) before the reply starts. Stop ends it.")


def duration(seconds):
    """Roughly, in words a person reads at a glance: "8 s", "40 s", "3 min"."""
    if seconds < 10:
        return f"{seconds:.0f} s"
    if seconds < 90:
        return f"{round(seconds, -1):.0f} s"
    return f"{seconds / 60:.0f} min"


def new_view():
    """The panel's per-tab view: layer and head (None = all); "tab" (the Gradio session hash, set
    by the page's load), "shown" and "pinned" (what the tab last drew of its conversation, and
    which messages it showed pinned), "watching" (the Watched it shows, else None) and "listed"
    (the live /v1 ones its list shows) come later."""
    return {"layer": None, "head": None}


def drawn(session):
    """What a tab's drawing of `session` shows, for telling later whether it changed: its id,
    every message's role, text and pin."""
    if session is None:
        return None
    return hash((session.id, tuple((m.role, m.content, m.pinned) for m in session.messages)))


@contextmanager
def replaying(session, progress, what="Replaying the chat"):
    """While a change replays the chat into the cache, `progress` (a gr.Progress, or None) shows it."""
    if session is None or progress is None:
        yield
        return
    session.on_progress = lambda done, total: progress(done / max(total, 1), desc=what)
    try:
        yield
    finally:
        session.on_progress = None


def warn(error):
    gr.Warning(str(error))


def chat_view(session, sending=None):
    """The Chatbot's value (and `sending`, a user message the session has not taken yet). Typed
    text parts: Gradio runs a plain string through inspect.cleandoc, which would show pasted code
    dedented and edge blank lines dropped. A tool's result (an API client's) is input to the
    model, shown as the user's: the Chatbot has no tool role."""
    history = (session.history if session is not None else []) + ([{"role": "user", "content": sending}]
                                                                   if sending is not None else [])
    return [{"role": "user" if m["role"] == "tool" else m["role"], "content": [{"type": "text", "text": m["content"]}]}
            for m in history]


def tell(session):
    """Show what the session has to say (a save that became a fork: another tab saved first)."""
    for notice in session.take_notices() if session is not None else ():
        gr.Warning(notice)


def number(label, value, kind=int):
    """A number field's value: an empty field or text is the user's to fix, not a crash."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{label} is empty: enter a number")
    try:
        out = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{label} must be a number, got {value!r}") from None
    if kind is int and out != float(value):
        raise ValueError(f"{label} must be a whole number, got {value!r}")
    return out
