"""The page's live conversations: one ChatSession per conversation id, shared by every tab that
shows it, so a reload or a second tab attaches to the session the server already holds (no
load, no replay).

    LiveSessions(idle_s=IDLE_S, clock=time.monotonic)
    .attach(tab, conversation_id, open_it) -> session   the one held, else open_it() (App.open), then held
    .add(tab, session)                                   a new chat, held and shown by `tab`
    .held(tab, session, open_it) -> session              what an action acts on: the one held for its id
    .show(tab, session)                                  `tab` shows `session` (None: nothing of ours, a watched /v1 one)
    .detach(tab, session=None)                           the tab is gone (closed, reloaded)
    .forget(conversation_id)                             deleted: stopped, never saved again, let go
    .sweep()                                             drop what is idle now (a timer does it too)
    .get(conversation_id) -> session or None, .tabs(conversation_id) -> how many tabs show it

A tab is a Gradio session hash; a tab that no load ran for (a gradio_client script) is None and
shows nothing. A session that no tab shows and that nobody touched for `idle_s` (a tab leaving
it touches it) is dropped: its cache is freed (`close`) and it is let go; the conversation stays
saved, and the next tab that opens it goes through `open_it` again (App.open). One that has
messages and is not saved (no data folder, or a disk that refused the last save) is kept:
dropping it would lose the chat. The last tab showing a session going away stops its reply (a
closed tab's reply is nobody's), as one tab's session did before sessions were shared.
"""

import threading
import time

IDLE_S = 15 * 60  # how long a conversation no tab shows stays in memory: a reload or a return within it is instant


class LiveSessions:
    def __init__(self, idle_s=IDLE_S, clock=time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self._lock = threading.Lock()
        self._sessions = {}  # conversation id -> its ChatSession
        self._touched = {}  # conversation id -> clock() when a tab last attached to it or acted on it
        self._tabs = {}  # tab -> the conversation id it shows
        self._deleted = set()  # ids deleted while live: a tab still showing one gets a new chat
        self._timer = None

    def __len__(self):
        return len(self._sessions)

    def get(self, conversation_id):
        with self._lock:
            return self._sessions.get(conversation_id)

    def tabs(self, conversation_id):
        """How many tabs show the conversation now."""
        with self._lock:
            return sum(1 for shown in self._tabs.values() if shown == conversation_id)

    def attach(self, tab, conversation_id, open_it):
        """The session of `conversation_id` for `tab`: the one held (at once), else `open_it()`
        (App.open: it may take a while, and raises ValueError when it cannot), which is then held.
        Two tabs opening one conversation at the same moment both get the first one held."""
        with self._lock:
            found = self._sessions.get(conversation_id)
            if found is not None:
                self._show(tab, found)
                return found
        opened = open_it()  # outside the lock: a replay must not hold up every other tab
        with self._lock:
            found = self._sessions.get(opened.id)
            if found is not None and found is not opened:  # another tab opened it meanwhile: one per conversation
                opened.close()
                opened = found
            self._sessions[opened.id] = opened
            self._deleted.discard(opened.id)
            self._show(tab, opened)
        self.sweep()
        return opened

    def add(self, tab, session):
        """A new session (a new chat), held and shown by `tab`."""
        with self._lock:
            self._sessions[session.id] = session
            self._show(tab, session)
        self.sweep()
        return session

    def held(self, tab, session, open_it):
        """The session an action of `tab` acts on, for the one the tab holds: the live one of its
        conversation. One dropped meanwhile (a tab asleep past the idle time) comes back through
        `open_it(conversation_id)` when it is saved, else as itself; one deleted meanwhile gives a
        new session from `open_it(None)`."""
        with self._lock:
            self._rekey(session)
            found = self._sessions.get(session.id)
            if found is not None:
                self._show(tab, found)
                return found
            deleted = session.id in self._deleted
        if deleted:
            fresh = open_it(None)
            fresh.notices.append("That conversation was deleted (in another tab): this is a new chat.")
            return self.add(tab, fresh)
        return self.attach(tab, session.id, lambda: open_it(session.id) if session.messages else session)

    def show(self, tab, session):
        """`tab` shows `session` now (None: none of ours, a watched /v1 conversation), and acted on it."""
        with self._lock:
            if session is None:
                left = self._tabs.pop(tab, None)
                if left is not None:
                    self._touched[left] = self.clock()
            else:
                self._rekey(session)
                self._show(tab, session)
        self._schedule()

    def detach(self, tab, session=None):
        """The tab is gone: what it showed (`session`, else the one it was shown as showing) is
        dropped once idle, and its reply stops when no other tab shows it."""
        with self._lock:
            shown = self._sessions.get(self._tabs.pop(tab, None))
            left = session if session is not None else shown
            if left is not None:
                if left.id in self._sessions:
                    self._touched[left.id] = self.clock()
                if left.id in self._tabs.values():
                    left = None
        if left is not None:
            left.stop()
        self.sweep()

    def forget(self, conversation_id):
        """A deleted conversation: its reply is stopped, it is never saved again, and it is let go
        (tabs still showing it get a new chat at their next action)."""
        with self._lock:
            session = self._sessions.pop(conversation_id, None)
            self._touched.pop(conversation_id, None)
            self._deleted.add(conversation_id)
        if session is not None:
            session.data_dir = None
            session.close()

    def sweep(self):
        """Drop every session no tab shows, idle for idle_s, and empty or saved; returns them."""
        now = self.clock()
        with self._lock:
            shown = set(self._tabs.values())
            dropped = [i for i, s in self._sessions.items() if i not in shown and not s.busy and
                       now - self._touched.get(i, now) >= self.idle_s and self._droppable(s)]
            for i in dropped:
                self._touched.pop(i, None)
            dropped = [self._sessions.pop(i) for i in dropped]
        for s in dropped:
            s.close()
        self._schedule()
        return dropped

    # --- internals (called with the lock held, except _schedule) --------------------------------
    def _show(self, tab, session):
        now = self.clock()
        if tab is not None:
            left = self._tabs.get(tab)
            if left is not None and left != session.id:
                self._touched[left] = now  # the tab leaves it: idle from now
            self._tabs[tab] = session.id
        self._touched[session.id] = now

    def _rekey(self, session):
        """A session whose id changed (its save became a fork) is held under its new id."""
        for old, held in list(self._sessions.items()):
            if held is session and old != session.id:
                del self._sessions[old]
                self._sessions[session.id] = session
                self._touched[session.id] = self._touched.pop(old, self.clock())
                self._tabs = {t: session.id if i == old else i for t, i in self._tabs.items()}

    @staticmethod
    def _droppable(session):
        """Empty, or saved as it is: nothing is lost when it goes."""
        return not session.messages or (session.data_dir is not None and session.save_error is None)

    def _schedule(self):
        """One timer, for the earliest moment a session no tab shows becomes idle (one overdue is
        writing a reply that no tab shows, a script's: looked at again every few seconds)."""
        with self._lock:
            shown = set(self._tabs.values())
            due = [self._touched.get(i, 0) + self.idle_s for i, s in self._sessions.items()
                   if i not in shown and self._droppable(s)]
            if self._timer is not None or not due:
                return
            wait = min(due) - self.clock()
            self._timer = threading.Timer(wait + 0.05 if wait > 0 else min(self.idle_s, 5.0), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self):
        with self._lock:
            self._timer = None
        self.sweep()
