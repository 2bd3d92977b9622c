"""What the UI pieces share: the App (the model and the defaults every new conversation gets),
the per-tab view state, and the small helpers every callback uses.

A tab holds one ChatSession (gr.State) and the browser remembers its conversation id
(gr.BrowserState), so a reload or a restarted server reopens the saved conversation by replaying it.
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
BROWSER_KEY = "h2o-chat-conversation"


@dataclass
class App:
    model: object
    tokenizer: object
    cache_defaults: dict
    data_dir: str | None
    chat_defaults: dict = field(default_factory=dict)
    concurrency: int = 1
    batcher: object = None  # batch.Batcher shared with the API when --concurrency > 1

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
        """A saved conversation, replayed through a fresh cache (with a progress bar when given)."""
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
        (a file that cannot be read is listed too, so its error can be shown)."""
        return [(summary_label(s), s.id) for s in store.summaries(self.data_dir)] if self.data_dir else []

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
    inspect.cleandoc, which would show pasted code dedented and edge blank lines dropped."""
    if session is None:
        return []
    return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in session.history]


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
