"""The Gradio page: the chat, its settings and the live panel, over one model; every tab on a
conversation shows its one live ChatSession (App.live).

The pieces, each readable alone: chat.py (the chat column), settings.py (settings, saved
conversations, export), panel.py (the cache panel, drawn by draw.py); state.py holds what they
share. This module lays them out and says what each event updates (`Tab`). Errors a user can
cause (ValueError) become a warning toast and change nothing.
"""

from importlib import resources
from pathlib import Path

import gradio as gr

from ..chat.conversation import cache_config
from ..chat.template import SYSTEM
from ..models.compile import Compilation
from . import chat as ui_chat
from . import panel as ui_panel
from . import settings as ui_settings
from .state import (
    BROWSER_KEY,
    LIST_EVERY_S,
    VIEW_KEY,
    WATCH_EVERY_S,
    App,
    Watched,
    chat_view,
    drawn,
    new_view,
    replaying,
    tell,
    warn,
)

# The page's CSS and script live in the checkout's top-level assets/ (the project's layout). An
# installed package carries them as h2o_chat/assets/ (pyproject.toml maps that package onto
# assets/ and ships only its *.css and *.js), so both places are looked in, the installed one first.
CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"


def read_asset(name):
    """The text of the app asset `name` (app.css, app.js): the installed package's copy, else the
    checkout's. FileNotFoundError names both places when neither has it."""
    installed = resources.files("h2o_chat") / "assets" / name
    if installed.is_file():
        return installed.read_text(encoding="utf-8")
    checkout = CHECKOUT_ASSETS / name
    if not checkout.is_file():
        raise FileNotFoundError(f"app asset {name!r} is neither in the installed package ({installed}) nor in "
                                f"the checkout ({checkout})")
    return checkout.read_text(encoding="utf-8")


CSS = read_asset("app.css")
HEAD = f"<script>{read_asset('app.js')}</script>"


class Tab:
    """What a tab shows. Every event returns a Gradio update, {component: value}; these lists name
    what each kind of event may update: `streamed_outputs` (chat, saved list, panel) after any chat
    action, `live_outputs` while a reply streams into the page (the panel's live part), and
    `everything_outputs` (plus every settings field) when the conversation itself changes (new
    chat, restore, reload, Apply). A component left out of an update stays as it is.

    Each drawing is remembered in the tab's view state ("shown"): an action on a message from a
    tab whose drawing is older than the conversation (another tab on it changed it) is refused
    (`stale`)."""

    def __init__(self, app, session, conversation_id, state, chat, settings, panel):
        self.app, self.session, self.conversation_id, self.state = app, session, conversation_id, state
        self.chat, self.settings, self.panel = chat, settings, panel

    def streamed_outputs(self):
        return [self.session, self.conversation_id, self.chat.chatbot, self.chat.marks, self.settings.saved,
                *self.panel.shown]

    def live_outputs(self):
        return [self.session, self.conversation_id, self.chat.chatbot, self.chat.marks, self.settings.saved,
                *self.panel.live]

    def everything_outputs(self):
        return self.streamed_outputs() + self.settings.fields()

    def streamed(self, session, state, live=None, panel=True, saved=True):
        """The update after a chat action; panel=False leaves the panel, saved=False the saved list."""
        shown = {self.session: session, self.chat.chatbot: chat_view(session), self.chat.marks: ui_chat.marks_html(session)}
        state["shown"], state["pinned"] = drawn(session), ui_chat.pinned_messages(session)  # what the tab shows
        if session is not None and session.messages and not isinstance(session, Watched):
            shown[self.conversation_id] = session.id  # what the browser reopens (never a watched /v1 one)
        if saved:
            tell(session)
            shown[self.settings.saved] = self.saved_list(state)
        if panel:
            shown |= ui_panel.update(self.panel, session, state, live)
        return shown

    def saved_list(self, state):
        """The saved list's update; the tab remembers which live /v1 conversations it listed."""
        state["listed"] = self.app.live_choices()
        return gr.Dropdown(choices=self.app.saved(), info=self.app.disk_usage())

    def held(self, session, state, progress=None):
        """The session an action of this tab acts on (App.held)."""
        return self.app.held(state.get("tab"), session, progress)

    def stale(self, session, state):
        """True when the tab last drew `session` otherwise than it is now."""
        return state.get("shown") not in (None, drawn(session))

    def live(self, update):
        """An update cut to what a reply streaming into the page shows."""
        return {component: value for component, value in update.items() if component in set(self.live_outputs())}

    def charts(self, session, state):
        update = ui_panel.update(self.panel, session, state, maps=False)
        return {component: update[component] for component in self.panel.charts}

    def charts_after(self, event):
        """Draw the charts again once `event` ends. Every page event that shows the charts is
        followed by this: Gradio 6's LinePlot, given a new value, hands its plot the data of the
        value before (two of its effects run in that order), so a chart shows a value only once
        another arrives. The same value again, right after, makes it show."""
        return event.then(self.charts, inputs=[self.session, self.state], outputs=self.panel.charts, queue=False,
                          api_visibility="private", show_progress="hidden")  # no loading veil: the old drawing stays until then

    def everything(self, session, state):
        state["watching"] = session if isinstance(session, Watched) else None  # what the watch's timer may draw
        return self.streamed(session, state) | ui_settings.values(self.settings, session)


def build(model, tokenizer, cache_defaults, data_dir, concurrency=1, chat_defaults=None, batcher=None,
          watchable=None, compile=Compilation.compile):
    """The app. cache_defaults: CacheConfig fields for new sessions; chat_defaults: other
    ChatSession arguments (sampling, system prompt); watchable: () -> [(session, client)], the
    conversations the /v1 API holds live (SessionPool.watchable), listed and watchable in the page;
    compile: the sessions' compiled decode step (models.compile.Compilation).
    The returned Blocks carries the App as `demo.h2o_app` (its live sessions: `.live`)."""
    app = App(model, tokenizer, dict(cache_defaults), data_dir, dict(chat_defaults or {}), concurrency, batcher,
              watchable, compile=compile)
    with gr.Blocks(title="h2o-chat", analytics_enabled=False) as demo:
        session = gr.State(None)  # the session the tab shows; App.live holds it (and frees it), not the tab
        state = gr.State(new_view())  # the panel's layer and head, what the tab drew, per tab
        conversation_id = gr.BrowserState(None, storage_key=BROWSER_KEY, secret=app.browser_secret())
        view = gr.BrowserState(None, storage_key=VIEW_KEY)  # the layer and head picked last, for a reload
        with gr.Row():
            with gr.Column(scale=3, min_width=320):
                chat = ui_chat.build()
                settings = ui_settings.build()
            with gr.Column(scale=2, min_width=320):
                panel = ui_panel.build(app.n_layers, app.n_heads, cache_config(dict(cache_defaults)).policy)
        tab = Tab(app, session, conversation_id, state, chat, settings, panel)
        ui_chat.wire(app, tab, chat, session, conversation_id, state)
        ui_panel.wire(panel, session, state, app.n_layers, app.n_heads, tab.charts_after, view)
        watching = wire_watch(app, tab, session, state)
        load = wire_conversation(app, tab, session, conversation_id, state, watching)
        watching(tab.charts_after(demo.load(load, inputs=[conversation_id, state, view],
                                            outputs=[*tab.everything_outputs(), panel.layer, panel.head],
                                            api_visibility="private", show_progress_on=chat.chatbot)))
        wire_saved_list(app, tab, state)
        wire_api(app, tab, session, state)

        def tab_closed(request: gr.Request):
            """The tab's heartbeat ended (closed, reloaded or asleep): it shows nothing now, and a
            reply of its conversation stops unless another tab shows it. The session stays live
            for a while (a reload or another tab attaches to it at once); App.live drops it, and
            frees its cache, once no tab has shown it for its idle time. (A script's tab, which no
            page load announced, is known by the session in its state.)"""
            held = demo.state_holder.session_data.get(request.session_hash)
            app.live.detach(request.session_hash, held.state_data.get(session._id) if held else None)

        demo.unload(tab_closed)
    demo.h2o_app = app  # not `app`: launch() sets that to its FastAPI app
    return demo


def wire_watch(app, tab, session, state):
    """Watching a /v1 conversation (a Watched in the tab's session): a timer redraws the chat and
    the whole panel while it is watched, and only when something changed. Returns `watching(event)`:
    after `event`, the timer runs if and only if the tab is left watching, and the chat column's
    controls are enabled or not (ui_chat.controls) for what the tab shows."""
    timer = gr.Timer(WATCH_EVERY_S, active=False)
    c = tab.chat

    def tick(current, state):
        if not isinstance(current, Watched) or state.get("watching") is not current:
            return {timer: gr.Timer(active=False)}
        if not app.still_live(current):
            warn("That /v1 conversation is no longer live (the API let it go to free memory); it is saved: "
                 "Restore opens it.")
            own = tab.held(current.own, state)
            return {**tab.everything(own, state), **ui_chat.controls(c, own, chat_view(own)),
                    timer: gr.Timer(active=False)}
        if not current.changed():
            return {timer: gr.skip()}  # nothing new: nothing sent
        drawn = tab.streamed(current, state, live=current.live_figures(), saved=False)
        if state.get("watching") is not current:  # the tab moved on (New chat, Restore) while this was drawn
            return {timer: gr.skip()}
        # not the session itself: a tick landing after New chat must not put the watched one back
        return {component: value for component, value in drawn.items() if component is not tab.session}

    def charts(current, state):
        """The charts again after a tick that drew (see Tab.charts_after): else nothing is sent."""
        if isinstance(current, Watched) and current.charts_due():
            return tab.charts(current, state)
        return {chart: gr.skip() for chart in tab.panel.charts}

    controlled = ui_chat.controlled(c)
    timer.tick(tick, inputs=[session, state], outputs=[*tab.everything_outputs(), *controlled[1:], timer],
               api_visibility="private", show_progress="hidden", concurrency_limit=None).then(
        charts, inputs=[session, state], outputs=tab.panel.charts, queue=False, api_visibility="private",
        show_progress="hidden")

    def follow(current):
        """The timer runs while the tab watches; the chat column's controls follow what it shows."""
        return {timer: gr.Timer(active=isinstance(current, Watched)), **ui_chat.controls(c, current)}

    def watching(event):
        return event.then(follow, inputs=session, outputs=[timer, *controlled], queue=False,
                          api_visibility="private", show_progress="hidden")
    return watching


def wire_conversation(app, tab, session, conversation_id, state, watching):
    """Load (reload, restarted server), New chat, Restore, Delete and the two Apply buttons: each
    fills every field from the conversation it leaves the tab on. Load and Restore attach the
    tab to the conversation's live session (App.attach: no replay when the server holds it).
    Restore of a live /v1 conversation watches it (read-only); New chat, Restore of a saved one
    and a reload go back to writing. Replays show one progress bar, over the chat."""
    s, c = tab.settings, tab.chat
    limit = dict(concurrency_limit=app.concurrency, concurrency_id="generate")
    everything = tab.everything_outputs()
    one_bar = dict(show_progress_on=c.chatbot)  # a replay's progress bar, once, where the chat will be

    def load(conversation_id, state, view, request: gr.Request, progress=gr.Progress()):
        state["tab"] = request.session_hash  # who App.live counts as showing the conversation
        state.update(ui_panel.remembered_view(view, app.n_layers, app.n_heads))  # the view picked before the reload
        try:
            shown = app.attach(state["tab"], conversation_id, progress)
        except ValueError as e:
            warn(e)
            shown = app.attach(state["tab"], None)
        return tab.everything(shown, state) | ui_panel.pickers(tab.panel, state)

    def new_chat(old, state):
        return tab.everything(app.attach(state.get("tab"), None), state)

    def restore(old, state, chosen, progress=gr.Progress()):
        if not chosen:
            warn("Choose a saved conversation first.")
            return tab.streamed(old, state)
        if old is not None and old.id == chosen:
            warn("That conversation is the one open now.")
            return tab.everything(old, state)
        watched = app.watch(chosen, old.own if isinstance(old, Watched) else old)
        if watched is not None:  # the tab's own session waits in it (App.live may let it go meanwhile)
            app.live.show(state.get("tab"), None)
            return tab.everything(watched, state)
        try:
            restored = app.attach(state.get("tab"), chosen, progress)
        except ValueError as e:
            warn(e)
            return tab.everything(tab.held(old, state), state)
        return tab.everything(restored, state)

    def apply_cache(current, state, progress=gr.Progress(), *typed):  # Gradio finds progress among the positionals
        current = tab.held(current, state, progress)
        try:
            ui_chat.caught_up(current, progress)  # settings apply to the conversation as saved
            with replaying(current, progress):
                current.configure(cache=ui_settings.cache_settings(dict(zip(s.cache, typed))))
        except ValueError as e:
            return refused(f"Cache not applied: {e}", current, state)
        gr.Info(ui_settings.applied_cache(current))
        return tab.everything(current, state)

    def apply_sampling(current, state, system_prompt, *typed):
        current = tab.held(current, state)
        try:
            ui_chat.caught_up(current)
            current.configure(**ui_settings.sampling_settings(current, system_prompt, dict(zip(s.sampling, typed))))
        except ValueError as e:
            return refused(f"Generation not applied: {e}", current, state)
        gr.Info(ui_settings.applied_sampling(current))
        return tab.everything(current, state)

    def refused(error, current, state):
        """An Apply refused: the sentence, saying which Apply (a toast beside an earlier one is
        plainly the new answer), and the fields left as typed (so nothing typed is lost)."""
        warn(error)
        return tab.streamed(current, state)

    watching(tab.charts_after(c.new_btn.click(new_chat, inputs=[session, state], outputs=everything, **limit,
                                              api_name="new_chat")))
    watching(tab.charts_after(s.restore_btn.click(restore, inputs=[session, state, s.saved], outputs=everything,
                                                  **limit, api_name="restore", **one_bar)))
    tab.charts_after(s.cache_btn.click(apply_cache, inputs=[session, state, *s.cache.values()], outputs=everything,
                                       **limit, api_name="apply_cache", **one_bar))
    tab.charts_after(s.sampling_btn.click(apply_sampling, inputs=[session, state, s.system_prompt, *s.sampling.values()],
                                          outputs=everything, **limit, api_name="sampling", **one_bar))

    def pin_system_prompt(current, state, pinned, progress=gr.Progress()):
        current = tab.held(current, state, progress)
        try:
            ui_chat.caught_up(current, progress)
            with replaying(current, progress, "Bringing the system prompt back into every head"):
                current.pin(SYSTEM, bool(pinned))
        except ValueError as e:
            warn(e)
        return {**tab.streamed(current, state), s.pin_system_prompt: current.settings.system_prompt_pinned}

    # applied at once, as a message's Pin is; .input: the user's click, not the page filling it in
    tab.charts_after(s.pin_system_prompt.input(pin_system_prompt, inputs=[session, state, s.pin_system_prompt],
                                               outputs=[*tab.streamed_outputs(), s.pin_system_prompt], **limit,
                                               api_visibility="private", **one_bar))
    s.export_btn.click(ui_settings.export, inputs=session, outputs=[s.export_md, s.export_json], api_name="export")
    watching(tab.charts_after(wire_delete(app, tab, session, conversation_id, state)))
    return load


def wire_delete(app, tab, session, conversation_id, state):
    """Delete, in two steps: the button names what it would delete (the conversation picked in
    the list, else the open one) and asks; the confirmation deletes its files (store.delete) and
    lets its live session go. A tab left on a deleted conversation goes to a new chat. Returns
    the confirmation's event."""
    s = tab.settings
    target = gr.State(None)  # the id the confirmation is about

    def ask(current, chosen):
        wanted = chosen or (current.id if current is not None and not isinstance(current, Watched) else None)
        if not wanted or not (app.is_saved(wanted) or app.live.get(wanted) is not None):
            warn("Nothing to delete: pick a saved conversation in the list (or open one) first.")
            return {s.confirm_row: gr.Column(visible=False), target: None}
        title = next((label for label, i in app.saved() if i == wanted), wanted)
        return {s.confirm_row: gr.Column(visible=True), target: wanted,
                s.confirm_text: f"Delete **{title}** for good? Its saved file and caches go; this cannot be undone."}

    def delete(current, state, wanted):
        try:
            app.delete(wanted)
        except ValueError as e:
            warn(e)
            return {**tab.streamed(current, state), s.confirm_row: gr.Column(visible=False)}
        gr.Info("Deleted.")
        done = {s.confirm_row: gr.Column(visible=False), s.saved: gr.Dropdown(choices=app.saved(), value=None,
                                                                          info=app.disk_usage())}
        if current is None or getattr(current, "id", None) == wanted:  # the tab goes to a new chat
            return {**tab.everything(app.attach(state.get("tab"), None), state), conversation_id: None, **done}
        return {**tab.streamed(current, state), **done}

    s.delete_btn.click(ask, inputs=[session, s.saved], outputs=[s.confirm_row, s.confirm_text, target], queue=False,
                       api_visibility="private")
    s.cancel_btn.click(lambda: gr.Column(visible=False), outputs=s.confirm_row, queue=False, api_visibility="private")
    return s.confirm_btn.click(delete, inputs=[session, state, target],
                               outputs=[*tab.everything_outputs(), s.confirm_row], api_name="delete")


def wire_saved_list(app, tab, state):
    """The saved list follows the /v1 API's live conversations on its own: a timer looks at them
    every LIST_EVERY_S and sends the list only when they changed (a new live story, one let
    go); opening the list reads it too."""
    timer = gr.Timer(LIST_EVERY_S)
    saved = tab.settings.saved

    def tick(state):
        return tab.saved_list(state) if app.live_choices() != state.get("listed") else gr.skip()

    timer.tick(tick, inputs=state, outputs=saved, api_visibility="private", show_progress="hidden",
               concurrency_limit=None)
    saved.focus(tab.saved_list, inputs=state, outputs=saved, queue=False, api_visibility="private")


def wire_api(app, tab, session, state):
    """Routes for scripts (gradio_client) that the page reaches through the Chatbot's own
    controls: the whole send, regenerate, continue, undo, edit and pin by message number, the saved
    list. Each answers with every output, the charts included (the page's streams leave them to the end)."""
    with gr.Group(visible=False):
        text_box, turn, pinned = gr.Textbox(), gr.Number(precision=0), gr.Checkbox()
        send_btn, edit_btn, pin_btn, regen_btn, cont_btn, undo_btn, list_btn = (gr.Button() for _ in range(7))
    limit = dict(concurrency_limit=app.concurrency, concurrency_id="generate")

    def send(text, session, state):
        yield from ui_chat.send_whole(app, tab, text, session, state, box=text_box)

    def edit(session, state, turn, text):
        return ui_chat.edit(tab, session, state, turn, text)

    def pin(session, state, turn, pinned, progress=gr.Progress()):
        return ui_chat.pin(tab, session, state, turn, pinned, progress)

    send_btn.click(send, inputs=[text_box, session, state], outputs=[text_box, *tab.streamed_outputs()], **limit,
                   api_name="send")
    edit_btn.click(edit, inputs=[session, state, turn, text_box], outputs=tab.streamed_outputs(), **limit,
                   api_name="edit")

    def regenerate(session, state):
        yield from ui_chat.run_stream(tab, session, state, lambda s: s.regenerate())

    def continue_reply(session, state):
        yield from ui_chat.run_stream(tab, session, state, lambda s: s.continue_reply())

    def undo(session, state):
        return ui_chat.act(tab, session, state, lambda s: s.undo())

    list_btn.click(lambda: gr.Dropdown(choices=app.saved()), outputs=tab.settings.saved, api_name="saved_sessions")
    regen_btn.click(regenerate, inputs=[session, state], outputs=tab.streamed_outputs(), **limit, api_name="regenerate")
    cont_btn.click(continue_reply, inputs=[session, state], outputs=tab.streamed_outputs(), **limit,
                   api_name="continue")
    undo_btn.click(undo, inputs=[session, state], outputs=tab.streamed_outputs(), **limit, api_name="undo")
    pin_btn.click(pin, inputs=[session, state, turn, pinned], outputs=tab.streamed_outputs(), **limit, api_name="pin")
