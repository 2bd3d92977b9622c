"""What the UI pieces share: the App (the model and the defaults every new conversation gets),
the per-tab view state, and the small helpers every callback uses.

A tab holds one ChatSession (gr.State) and the browser remembers its conversation id
(gr.BrowserState), so a reload or a restarted server reopens the saved conversation from its saved cache.
"""

import os
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from ..chat import store
from ..chat.session import ChatSession

# How often a streaming reply updates the page. The browser redraws each update and, on a small
# machine, shares the cores with the decode: in headless chromium on 2 cores, the chat at every
# token cost the page ~0.9 CPU-seconds more per 96-token reply than 10 updates a second did
# (bench_page's browser CPU, this build against one patched to send every token, interleaved).
CHAT_EVERY_S = 0.1
PANEL_EVERY_S = 0.5  # the live view (token map, retention map, stats); the charts wait for the end
WATCH_EVERY_S = 1.0  # a watched /v1 conversation: chat and the whole panel, charts included, when it changed
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

    @property
    def n_layers(self):
        return self.model.config.num_hidden_layers

    @property
    def n_heads(self):
        return self.model.config.num_key_value_heads

    def new_session(self):
        return ChatSession(self.model, self.tokenizer, cache=dict(self.cache_defaults), data_dir=self.data_dir,
                           batcher=self.batcher, **self.chat_defaults)

    def open(self, conversation_id, progress=None):
        """A saved conversation, its cache loaded from the state saved beside it; replayed through a
        fresh cache when that cannot be used (with a progress bar when given, and a notice why)."""
        if not conversation_id:
            raise ValueError("choose a saved conversation first")
        on_progress = None
        if progress is not None:
            on_progress = lambda done, total: progress(done / max(total, 1), desc="Replaying the conversation")  # noqa: E731
        try:
            return ChatSession.open(self.model, self.tokenizer, conversation_id, self.data_dir, on_progress=on_progress,
                                    batcher=self.batcher)
        except store.SessionFileError as e:
            raise ValueError(str(e)) from None

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
        live = [(live_label(session, client), session.id) for session, client in self.live_api()]
        ids = {i for _, i in live}
        saved = [(summary_label(s), s.id) for s in store.summaries(self.data_dir)] if self.data_dir else []
        return live + [(label, i) for label, i in saved if i not in ids]

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
    `own` and comes back on New chat, Restore or a reload."""

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

    def close(self):
        """The tab is gone or moves on: its own session is freed; the API's is not the tab's to close."""
        if self.own is not None:
            self.own.close()

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


def new_view():
    """The panel's per-tab view: layer and head (None = all)."""
    return {"layer": None, "head": None}


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


def chat_view(session):
    """The Chatbot's value. Typed text parts: Gradio runs a plain string through
    inspect.cleandoc, which would show pasted code dedented and edge blank lines dropped. A tool's
    result (an API client's) is input to the model, shown as the user's: the Chatbot has no tool role."""
    if session is None:
        return []
    return [{"role": "user" if m["role"] == "tool" else m["role"], "content": [{"type": "text", "text": m["content"]}]}
            for m in session.history]


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
