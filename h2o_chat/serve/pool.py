"""Live conversations kept for stateless clients (the `/v1` API).

An OpenAI client resends the whole history with every request. The pool keeps several
ChatSessions alive and lends each request the one whose history shares the longest start with
it; the session then feeds only what it has not seen (its own `_sync`: what agrees is kept,
a divergence - a swipe, an edited message, a trimmed start - goes back to the latest snapshot
that still agrees, else replays into a fresh cache). Least recently used sessions are dropped
first once the pool's KV memory passes its bound.

A session is lent to one request at a time; a second request for the same conversation while
the first still streams gets another session (it shares less, so it is chosen only when no
idle one is better).

A conversation the pool dropped, or held before a restart, comes back from disk: `SavedIndex`
knows every saved conversation's messages (by digest), and a request that repeats more of one of
them than of any live session gets it reopened (`open_saved`, lazily: its first sync loads the
saved cache state that shares the most with the request, see chat/saved_kv.py).
"""

import hashlib
import os
import threading
import time

from ..chat import saved_kv, store
from ..chat.session import ChatSession, cache_config
from ..chat.template import Segment, tokenize

# a ChatSession holds its live cache and, after `send`, at most three snapshots of it (before the
# last reply, before this exchange, after this prompt): the pool counts every session at that bound
KV_COPIES = 4
MAX_IDLE_KV_MIB = 1024  # the default bound on the pool's KV memory (the app's --api-kv-mib)
LENT_WAIT_S = 2.0  # how long a request waits for a busy session that shares more of it than any idle one


class TextSession(ChatSession):
    """A session for plain text completion: its one message is the prompt, fed exactly as
    written (special tokens in it are special tokens: it is the client's own template), and the
    reply continues it. Everything else (reuse, snapshots, sampling, stop strings) is ChatSession's.
    Never saved: a raw prompt is no conversation the UI could show. The prompt re-renders as the
    tokens it was fed as (prompt and reply), the rest tokenized: see template.KnownTokens."""

    _template_text = True

    def _segments(self, add_generation_prompt=False, open_reply=True):
        text = "".join(m.content for m in self.messages)
        if not text:
            return []
        return [Segment(self._known.ids(text) or tokenize(self.tokenizer, text, template=True), "assistant", 0)]

    def _remember_reply(self, text, ids):
        self._known.remember("".join(m.content for m in self.messages), self.timeline.fed)


def shared_tokens(session, system_prompt, messages, tools=None):
    """How many of `session`'s fed tokens belong to messages (system prompt included) that
    `messages` repeats word for word: a lower bound of the token prefix the two share, read
    from the ledger's turn of every fed token (the system prompt is turn -1). Different tools
    (the template shows them before the first message): none."""
    if isinstance(session, TextSession):  # one growing text: the characters it starts with
        old, new = "".join(m["content"] for m in session.history), "".join(m["content"] for m in messages)
        return len(os.path.commonprefix([old, new]))
    if session.system_prompt != system_prompt or session.conversation.tools != (tools or None):
        return 0
    same = messages_repeated(session, system_prompt, messages)
    return sum(1 for t in session.ledger.turns if t < same)


class SavedIndex:
    """What the pool can resume from disk: per saved conversation in `data_dir`, its system prompt,
    cache settings, tools and a digest of each message. A file is read once, and again only when it
    changed (its mtime): a request lists the folder, it does not read every conversation."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self._entries = {}  # id -> (mtime_ns, (system_prompt, CacheConfig, tools), [message digest])
        self._lock = threading.Lock()

    def refresh(self):
        try:
            files = {e.name[:-5]: e.stat().st_mtime_ns for e in os.scandir(self.data_dir) if e.name.endswith(".json")}
        except OSError:
            files = {}
        for conversation_id in set(self._entries) - set(files):
            del self._entries[conversation_id]
        for conversation_id, mtime in files.items():
            if conversation_id in self._entries and self._entries[conversation_id][0] == mtime:
                continue
            try:
                saved = store.read(self.data_dir, conversation_id)
            except ValueError:  # an invalid name or an unreadable file: nothing to resume
                self._entries.pop(conversation_id, None)
                continue
            runs_with = (saved.settings.system_prompt, saved.settings.cache, saved.tools)
            self._entries[conversation_id] = (mtime, runs_with, [digest(m.role, m.content) for m in saved.messages])

    def best(self, config, system_prompt, messages, tools=None, exclude=()):
        """(id, messages repeated) of the saved conversation under these settings and tools of which the
        request's `messages` repeat the most first messages (at least one; ties: the newest), or None."""
        wanted = [digest(m["role"], m["content"]) for m in messages]
        with self._lock:
            self.refresh()
            found = None
            for conversation_id, (mtime, runs_with, digests) in self._entries.items():
                if conversation_id in exclude or runs_with != (system_prompt, config, tools or None):
                    continue
                same = 0
                for old, new in zip(digests, wanted):
                    if old != new:
                        break
                    same += 1
                if same and (found is None or (same, mtime) > found[1:]):
                    found = (conversation_id, same, mtime)
        return found[:2] if found else None


def digest(role, content):
    return hashlib.sha1(f"{role}\0{content}".encode("utf-8", "surrogatepass")).digest()


class SessionPool:
    """make_session(kind, cache, system_prompt) -> a new ChatSession (kind "chat") or TextSession ("text");
    max_kv_bytes bounds the KV memory of the idle sessions kept (a session in use is never
    dropped, so one long conversation may hold more than the bound on its own). data_dir and
    open_saved(conversation_id) -> ChatSession (opened lazily): where dropped conversations come
    back from (None: they do not)."""

    def __init__(self, make_session, max_kv_bytes, data_dir=None, open_saved=None):
        self.make_session = make_session
        self.max_kv_bytes = max_kv_bytes
        self.open_saved = open_saved
        self.saved = SavedIndex(data_dir) if data_dir is not None and open_saved is not None else None
        self._sessions = []  # least recently used first
        self._lent = set()  # ids of sessions a request holds now
        self._clients = {}  # id(session) -> the client that last used it ("SillyTavern"), for the page's list
        self._released = threading.Condition()  # guards the two lists; notified when a session is given back

    def __len__(self):
        return len(self._sessions)

    def live(self):
        """(session, lent) for every live session, least recently used first."""
        with self._released:
            return [(s, id(s) in self._lent) for s in self._sessions]

    def watchable(self):
        """(session, client) for every live session, most recently used first: what the page lists
        and can watch. Reading a session this way takes no lock of it and changes nothing."""
        with self._released:
            return [(s, self._clients.get(id(s))) for s in reversed(self._sessions)]

    def acquire(self, kind, cache, system_prompt, messages, client=None, tools=None):
        """Lend the idle session of this kind and cache setting that shares the most tokens with
        the request (a new one when none shares any); when a lent one shares more (a swipe sent
        right after a stop), wait up to LENT_WAIT_S for it. Returns (session, forked): forked is
        True when a lent session's history is rewritten before its last exchange (a new
        conversation that starts like an old one, an old message edited): it is then saved under
        a new id, so the conversation it held stays in the saved list. client: who asks (for the
        page's list of live conversations). tools: the function tools the template shows."""
        config = cache_config(cache)
        deadline = time.monotonic() + LENT_WAIT_S
        with self._released:
            while True:
                best, best_shared, lent_shared = None, 0, 0
                for session in self._sessions:
                    if type(session) is not _KINDS[kind] or session.cache_config != config:
                        continue
                    shared = shared_tokens(session, system_prompt, messages, tools)
                    if id(session) in self._lent:
                        lent_shared = max(lent_shared, shared)
                    elif shared > best_shared or (best is not None and shared == best_shared > 0):
                        best, best_shared = session, shared  # ties: the most recently used
                left = deadline - time.monotonic()
                if lent_shared <= best_shared or left <= 0:
                    break
                self._released.wait(left)
            forked = False
            if kind == "chat":
                best = self._from_disk(best, config, system_prompt, messages, tools) or best
            if best is None:
                best = self.make_session(kind, config, system_prompt)
            else:
                if best in self._sessions:
                    self._sessions.remove(best)
                kept = messages_repeated(best, system_prompt, messages)
                forked = kind == "chat" and kept < len(best.history) - 2  # more than a regenerate or an edit of the last exchange
            self._sessions.append(best)
            self._lent.add(id(best))
            self._clients[id(best)] = client
        if forked:
            best.conversation.become_fork()  # saved under a new id: the old file keeps the old story
        return best, forked

    def _from_disk(self, live, config, system_prompt, messages, tools):
        """The saved conversation the request repeats more of than of `live` (the best live
        session, or None), reopened; None when there is none (or it cannot be opened)."""
        if self.saved is None or saved_kv.BUDGET.total_mib == 0:  # no saved caches: a reopen would replay it all
            return None
        live_repeats = messages_repeated(live, system_prompt, messages) if live is not None else 0
        if live_repeats >= len(messages) - 1:  # the live one holds all the history the request resends
            return None
        found = self.saved.best(config, system_prompt, messages, tools, exclude={s.id for s in self._sessions})
        if found is None or found[1] <= live_repeats:
            return None
        try:
            return self.open_saved(found[0])
        except ValueError:  # removed or damaged since it was listed
            return None

    def release(self, session):
        with self._released:
            self._lent.discard(id(session))
            self._drop_over_bound()
            self._released.notify_all()

    def kv_bytes(self):
        with self._released:
            return sum(session_kv_bytes(s) for s in self._sessions)

    def _drop_over_bound(self):
        total = sum(session_kv_bytes(s) for s in self._sessions)
        for session in list(self._sessions):  # least recently used first
            if total <= self.max_kv_bytes:
                break
            if id(session) in self._lent:
                continue
            total -= session_kv_bytes(session)
            self._sessions.remove(session)
            self._clients.pop(id(session), None)
            session.close()  # frees the cache now; the transcript stays saved


def session_kv_bytes(session):
    return KV_COPIES * session.cache.kv_bytes()


def messages_repeated(session, system_prompt, messages):
    """How many of `session`'s messages `messages` starts with (none if the system prompts differ)."""
    if session.system_prompt != system_prompt:
        return 0
    same = 0
    for old, new in zip(session.history, messages):
        if (old["role"], old["content"]) != (new["role"], new["content"]):
            break
        same += 1
    return same


_KINDS = {"chat": ChatSession, "text": TextSession}
