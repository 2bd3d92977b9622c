"""The chat column: the Chatbot with its own per-message actions (edit, retry, undo, copy and a
pin flag whose menu offers Pin or Unpin, as the message is), the message box (Enter sends,
Shift+Enter makes a new line), Stop, Continue and New chat, and the callbacks that stream a
reply into the tab.

Sending is two steps: in the browser, Enter moves the text out of the box at once (no server
round trip, so nothing typed after Enter is lost), then `reply` streams on the server and
never touches the box again, except to put back a message the session refuses (with a warning).

Tabs on one conversation share its one session (App.live). A message sent while that session
writes a reply (from this tab or another) is refused with a sentence and goes back into the box;
an action on a message (edit, retry, undo, pin) from a tab whose drawing is older than the
conversation (another tab changed it since) is refused too, and the tab shows it as it is now.
"""

import threading
import time
from dataclasses import dataclass

import gradio as gr

from .state import CHAT_EVERY_S, PANEL_EVERY_S, Watched, chat_view, prefill_notice, replaying, warn

PIN, UNPIN = "Pin (never evict)", "Unpin"
LABEL = "h2o-chat"
PLACEHOLDER = "Message (Enter sends, Shift+Enter: new line)"
READ_ONLY = "Read-only: New chat or Restore to write"
BUSY = ("A reply is being written in this conversation (here or in another tab): your message is back in the "
        "box. Send it once that reply has ended, or Stop it.")
# runs in the browser on Enter / Send: (message to send, what stays in the box). The text is the
# box as it was when Enter went down (assets/app.js); keys typed since then stay in the box. Until
# the chat shows one more user message, the text is also kept in the tab's sessionStorage: a send
# the server never took (it was restarting, and Gradio reloads the page) comes back into the box.
SEND_JS = """(text) => {
  const box = document.querySelector('#message textarea');
  const sent = box && box.dataset.sent !== undefined ? box.dataset.sent : text;
  if (box) delete box.dataset.sent;
  const users = document.querySelectorAll('#chat .user-row').length;
  if (sent && sent.trim()) sessionStorage.setItem('h2o-unsent', JSON.stringify({text: sent, users}));
  const now = box ? box.value : '';
  return [sent, now.startsWith(sent) ? now.slice(sent.length) : ''];
}"""


@dataclass
class Chat:
    chatbot: gr.Chatbot
    marks: gr.HTML  # what the page's script marks on the messages (assets/app.js): which are pinned
    text: gr.Textbox
    send_btn: gr.Button
    stop_btn: gr.Button
    cont_btn: gr.Button
    new_btn: gr.Button


def build():
    chatbot = gr.Chatbot(label=LABEL, height=520, buttons=["copy"], editable="all", elem_id="chat",
                         feedback_options=(PIN, UNPIN), like_user_message=True, autoscroll=True)
    marks = gr.HTML(marks_html(None), elem_id="chat-marks", padding=False)
    text = gr.Textbox(placeholder=PLACEHOLDER, show_label=False, lines=1, max_lines=10, elem_id="message",
                      autofocus=True)
    with gr.Row():
        send_btn = gr.Button("Send", variant="primary", elem_id="send", min_width=80)
        stop_btn = gr.Button("Stop", elem_id="stop", min_width=80)
        cont_btn = gr.Button("Continue", elem_id="continue", min_width=80)
        new_btn = gr.Button("New chat", elem_id="new-chat", min_width=80)
    return Chat(chatbot, marks, text, send_btn, stop_btn, cont_btn, new_btn)


def label(session):
    """The chat's label: the app's name, or, for a watched /v1 conversation, whose it is and that it is read-only."""
    if isinstance(session, Watched):
        return f"Watching /v1 · {session.client or 'an API client'} · read-only"
    return LABEL


def marks_html(session):
    """The messages' state for the page's script (assets/app.js), which marks each pinned message
    and names its flag and menu after it: the indices of the pinned messages."""
    pinned = pinned_messages(session)
    return f'<div class="chat-marks" data-pinned="{" ".join(map(str, pinned))}"></div>'


def pinned_messages(session):
    """The indices of the pinned messages (what marks_html shows)."""
    return [i for i, m in enumerate(session.messages) if m.pinned] if session is not None else []


def controls(c, session, chat=None):
    """What the chat column lets a user do with `session`, {component: update}: everything, or,
    for a watched /v1 conversation (read-only), nothing that would write: its box, Send, Stop,
    Continue, and each message's edit, retry, undo and pin flag are disabled (the chat's
    `read-only` class hides the last three: the Chatbot has no switch for them). chat: the
    Chatbot's value too (else it keeps its own)."""
    watched = isinstance(session, Watched)
    value = {} if chat is None else {"value": chat}
    return {c.chatbot: gr.Chatbot(label=label(session), editable=None if watched else "all",
                                  elem_classes=["read-only"] if watched else [], **value),
            c.text: gr.Textbox(interactive=not watched, placeholder=READ_ONLY if watched else PLACEHOLDER),
            **{button: gr.Button(interactive=not watched) for button in controlled(c)[2:]}}


def controlled(c):
    """The components `controls` updates, in its order (named here: a gr.Chatbot() made while the
    page is built would be a new one on the page)."""
    return [c.chatbot, c.text, c.send_btn, c.stop_btn, c.cont_btn]


def message_text(value):
    """The text of an edited message as the Chatbot sends it (a string or typed parts)."""
    if isinstance(value, dict):
        value = value.get("content", value.get("text"))
    if isinstance(value, list):
        value = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
    return value


class OnePerClick:
    """Gradio 6.31's Chatbot sends the like event of an extra feedback option (Pin / Unpin) twice
    per click: the option's click handler calls `handle_action` inside its toggle and again right
    after it (the frontend's Index-*.js: `d(C(n)), t.handle_action(...)`), and the event's trigger
    mode cannot stop the second because the first is not yet registered as pending. Both copies
    ran at once on the tab's conversation (a "changed elsewhere" warning, a "(copy)" fork, every
    warning twice). The copy is the same tab, message and choice as the event just before it,
    within milliseconds: `first` lets one through."""

    WINDOW_S = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        self._last = {}  # tab (its session hash) -> (what it asked, when)

    def first(self, tab, what):
        now = time.monotonic()
        with self._lock:
            last = self._last.get(tab)
            self._last = {t: v for t, v in self._last.items() if now - v[1] < self.WINDOW_S}
            self._last[tab] = (what, now)
            return last is None or last[0] != what or now - last[1] >= self.WINDOW_S


def pin_wanted(liked, turn=None, shown_pinned=()):
    """What a click on a message's flag menu asks: pin (True) or unpin (False). The option clicked
    says it; None means the Chatbot remembered that same option as this message's last click
    (a refused pin asked again) and took the click back: then it is the one option the menu
    showed, the other state than the tab drew (`shown_pinned`, Tab.streamed). Never a flip of
    the state now: Gradio sends a click twice, and the copy must ask the same."""
    if liked in (True, False, PIN, UNPIN):
        return liked in (True, PIN)
    return turn not in shown_pinned


def stream_into(tab, session, state, stream, saved):
    """Yield the tab's updates while `stream` (text pieces) runs: the chat at the first piece and
    then at most every CHAT_EVERY_S, the panel at most every PANEL_EVERY_S with this reply's live
    TTFT and speed, and everything once the stream ends."""
    started, first_at, n_first = time.perf_counter(), None, 0
    shown = chat_shown = time.perf_counter()
    yield tab.streamed(session, state, live=(None, None), saved=False)  # "waiting for the first token"
    try:
        for _ in stream:
            now = time.perf_counter()
            if first_at is None:
                first_at, n_first = now, len(session.ledger)
            elif now - chat_shown < CHAT_EVERY_S:
                continue  # the next update carries this piece
            chat_shown = now
            if now - shown >= PANEL_EVERY_S:
                shown = now
                speed = (len(session.ledger) - n_first) / (now - first_at) if now > first_at else None
                yield tab.streamed(session, state, live=(first_at - started, speed), saved=False)
            else:
                yield tab.streamed(session, state, panel=False, saved=False)
    except ValueError as e:  # GenerationError (out of memory): what streamed stays in the chat
        warn(e)
    yield tab.streamed(session, state, saved=saved)


# --- callbacks (app: state.App, tab: page.Tab) --------------------------------------------------
CHANGED_ELSEWHERE = ("This conversation was changed in another tab; here it is as saved now. Do it again if you "
                     "still want to.")


def caught_up(session, progress=None):
    """Another process (a second server on the same data folder) may have saved this conversation
    since: a session older than the saved copy takes it first (only what differs is fed). True
    when it did. (Tabs of this server share one session: they need nothing of this.)"""
    if session is None:
        return False
    with replaying(session, progress, "Catching up with the saved conversation"):
        return session.catch_up()


def ensure_session(app, tab, session, conversation_id, state, progress=None):
    """The session a message goes to: the live one of the conversation the tab shows, caught up
    with what another process saved; a tab whose server restarted has none: the conversation
    the browser remembers (the live one, or opened), else a new chat."""
    if session is None:
        return app.attach(state.get("tab"), conversation_id, progress)
    session = tab.held(session, state, progress)
    caught_up(session, progress)
    return session


def measured(app, session):
    """Record the prefill speed a finished reply showed (its prompt tokens computed, and the time
    to its first token): what the next long message's estimate is made from."""
    turn = session.last_turn if not isinstance(session, Watched) else None
    if turn is not None and turn.first_at is not None:
        app.prefill.record(turn.prompt_computed, turn.ttft_s)


def reply(app, tab, message, session, conversation_id, state, progress=None):
    """Step 2 of a send: yield the tab's updates while the reply to `message` streams. The message
    box is left alone, except that a message the session refuses (empty, too long, out of memory
    while reading it, a reply already being written) goes back into it (the last update then
    carries the box). A message whose prefill takes a while here says so first (prefill_notice)."""
    box = tab.chat.text
    try:
        session = ensure_session(app, tab, session, conversation_id, state, progress)
        if session.busy:  # the session would refuse it too; this says why, for a user of two tabs
            raise ValueError(BUSY)
        n_before = len(session.messages)
        stream = session.send(message)
    except ValueError as e:
        warn(e)
        yield {box: message, **tab.streamed(session, state)}
        return
    updates = stream_into(tab, session, state, stream, saved=True)
    # at once: the message in the chat, "waiting for the first token" (the session takes the
    # message when its prefill starts, and shows it with the reply's first piece)
    yield {**next(updates), tab.chat.chatbot: chat_view(session, sending=message)}
    notice = prefill_notice(app, message)
    if notice:
        gr.Info(notice)
    last = None  # each update is held until the next: the last one carries the box if it is taken back
    for update in updates:
        if last is not None:
            yield last
        last = update
    measured(app, session)
    taken_back = len(session.messages) == n_before  # the session could not even read it
    yield {box: message, **last} if taken_back else last


def send_whole(app, tab, text, session, state, box):
    """Both steps in one call, for scripts (the /send route, whose own text field is `box`): the box
    is emptied once the message is taken, and keeps a refused one."""
    for update in reply(app, tab, text, session, None, state):
        refused = tab.chat.text in update
        message = update.pop(tab.chat.text, None)
        yield {**update, box: message if refused else ""}


def changed_elsewhere(tab, session, state, progress=None):
    """The session to act on, and whether the tab's drawing of it is older than it (another tab, or
    another process, changed the conversation since): the message acted on may not be the one
    the tab showed, so the action is refused and the tab shows the conversation as it is now."""
    session = tab.held(session, state, progress)
    if isinstance(session, Watched) or session.busy:
        return session, False  # its own refusal says what to do: read-only, or a reply being written
    return session, caught_up(session, progress) or tab.stale(session, state)


def act(tab, session, state, action, progress=None):
    """Run a non-streaming action on the session; a ValueError is a warning that changes nothing."""
    if session is None or (not session.messages):
        warn("Nothing to do yet: send a message first.")
        return tab.streamed(session, state, saved=False)
    try:
        session, changed = changed_elsewhere(tab, session, state, progress)
        if changed:
            warn(CHANGED_ELSEWHERE)
            return tab.streamed(session, state)
        action(session)
    except ValueError as e:
        warn(e)
        return tab.streamed(session, state, saved=False)
    return tab.streamed(session, state)


def run_stream(tab, session, state, start):
    """Stream what `start(session)` returns (regenerate, continue)."""
    if session is None or not session.messages:
        warn("Nothing to do yet: send a message first.")
        yield tab.streamed(session, state, saved=False)
        return
    try:
        session, changed = changed_elsewhere(tab, session, state)
        if changed:  # the last reply is maybe not the one the tab showed
            warn(CHANGED_ELSEWHERE)
            yield tab.streamed(session, state)
            return
        stream = start(session)
    except ValueError as e:
        warn(e)
        yield tab.streamed(session, state, saved=False)
        return
    yield from stream_into(tab, session, state, stream, saved=True)
    measured(tab.app, session)


def edit(tab, session, state, turn, text):
    text = message_text(text)
    return act(tab, session, state, lambda s: s.edit(_turn(turn), text))


def pin(tab, session, state, turn, pinned, progress=None):
    """Pin (or, pinned False, unpin) message `turn`. A message pinned after some of its tokens
    were evicted is fed again before the pin is set: `progress` shows that replay."""
    def pin_it(s):
        with replaying(s, progress, "Bringing the pinned message back into every head"):
            s.pin(_turn(turn), pinned=pin_wanted(pinned))
    return act(tab, session, state, pin_it, progress)


def _turn(turn):
    """A message index from the Chatbot (an int) or a script (anything): checked, not trusted."""
    if isinstance(turn, (list, tuple)) and turn:
        turn = turn[0]
    if isinstance(turn, bool) or not isinstance(turn, (int, float)) or turn != int(turn):
        raise ValueError(f"a message number must be a whole number, got {turn!r}")
    return int(turn)


def wire(app, tab, c, session, conversation_id, state):
    """Connect the chat column's events. Every streaming event shares one concurrency slot pool;
    one that streams into the page updates its live view, then draws the charts once it ends."""
    limit = dict(concurrency_limit=app.concurrency, concurrency_id="generate")
    pending = gr.Textbox(visible=False)  # the message on its way, out of the box

    def step2(message, typed, session, conversation_id, state, progress=gr.Progress()):
        for update in reply(app, tab, message, session, conversation_id, state, progress):
            shown = tab.live(update)
            if c.text in update:  # refused: back in the box, before what was typed since
                shown[c.text] = f"{update[c.text] or ''}{typed or ''}"
            yield shown

    for trigger in (c.text.submit, c.send_btn.click):
        streamed = trigger(None, inputs=c.text, outputs=[pending, c.text], js=SEND_JS, queue=False,
                           api_visibility="private").then(
            step2, inputs=[pending, c.text, session, conversation_id, state],
            outputs=[c.text, *tab.live_outputs()], **limit, api_visibility="private", show_progress="hidden")
        tab.charts_after(tab.charts_after(streamed))  # drawn once the reply ends, and again (see charts_after)
    c.stop_btn.click(lambda s: s.stop() if s is not None else None, inputs=session, queue=False, api_name="stop")

    def retried(session, state, data: gr.RetryData):
        for out in run_stream(tab, session, state, lambda s: s.regenerate()):
            yield tab.live(out)

    def continued(session, state):
        for out in run_stream(tab, session, state, lambda s: s.continue_reply()):
            yield tab.live(out)

    def undone(session, state, typed, data: gr.UndoData):
        """Undo takes the last exchange back, and its message goes back into the box (before
        anything typed there since), to edit and send again."""
        before = list(session.messages) if session is not None else []
        shown = act(tab, session, state, lambda s: s.undo())
        after = shown[tab.session].messages if shown.get(tab.session) is not None else before
        taken = [m.content for m in before[len(after):] if m.role == "user"]
        if taken:
            shown[c.text] = taken[-1] + (f"\n\n{typed}" if typed and typed.strip() else "")
        return shown

    def edited(session, state, typed, data: gr.EditData):
        """An edit refused (too long, no longer fitting its pin) leaves the message as it was: the
        text typed in the edit goes to the box, so nothing typed is lost."""
        shown = edit(tab, session, state, data.index, data.value)
        text = message_text(data.value)
        messages = shown[tab.session].messages if shown.get(tab.session) is not None else []
        index = data.index[0] if isinstance(data.index, (list, tuple)) else data.index
        kept = isinstance(index, int) and 0 <= index < len(messages) and messages[index].content == text
        if isinstance(text, str) and text.strip() and not kept:
            shown[c.text] = text + (f"\n\n{typed}" if typed and typed.strip() else "")
        return shown

    one_per_click = OnePerClick()

    def liked(session, state, data: gr.LikeData, request: gr.Request, progress=gr.Progress()):
        if not one_per_click.first(request.session_hash, (str(data.index), str(data.liked))):
            return {tab.session: gr.skip()}  # the same click's second copy (see OnePerClick): nothing changes
        index = data.index[0] if isinstance(data.index, (list, tuple)) else data.index
        return pin(tab, session, state, data.index, pin_wanted(data.liked, index, state.get("pinned", ())), progress)

    streams = dict(inputs=[session, state], outputs=tab.live_outputs(), **limit, api_visibility="private")
    tab.charts_after(tab.charts_after(c.chatbot.retry(retried, **streams)))
    tab.charts_after(tab.charts_after(c.cont_btn.click(continued, **streams)))
    # a replay's progress bar (a pin brings evicted tokens back), or Gradio's "pending", once, over the chat
    one_bar = dict(show_progress_on=c.chatbot)
    io = dict(inputs=[session, state], outputs=tab.streamed_outputs(), **limit, api_visibility="private", **one_bar)
    tab.charts_after(c.chatbot.undo(undone, inputs=[session, state, c.text], outputs=[*tab.streamed_outputs(), c.text],
                                    **limit, api_visibility="private", **one_bar))
    tab.charts_after(c.chatbot.edit(edited, inputs=[session, state, c.text], outputs=[*tab.streamed_outputs(), c.text],
                                    **limit, api_visibility="private", **one_bar))
    tab.charts_after(c.chatbot.like(liked, **io))
