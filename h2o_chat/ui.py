"""The Gradio app: one ChatSession per browser tab over a shared model, and the live panel.

Callbacks only move strings between widgets and a ChatSession; `panel.render` turns the
session into what the panel shows. Errors a user can cause (ValueError) become a warning toast
and leave the conversation as it was.
"""

import inspect
import json
import tempfile
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from . import panel, store
from .policy import POLICIES, POSITIONS, SCORES
from .session import ChatSession

PANEL_EVERY_S = 0.5  # panel refresh while streaming: rendering it costs far less than 10% of this
CSS = """
.token-map { font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.7; white-space: pre-wrap;
             word-break: break-word; max-height: 420px; overflow-y: auto; }
.tok { border-radius: 3px; padding: 0 1px; }
.st-sink { outline: 2px solid #CC79A7; } .st-pinned { border-bottom: 2px dashed #009E73; }
.st-recent { border-bottom: 2px solid #0072B2; } .st-evicted { color: #888; text-decoration: line-through; }
.fold { color: #666; font-style: italic; }
.map-caption { font-size: 12px; color: #555; margin: 0 0 4px 0; }
"""


def build(model, tokenizer, cache_defaults, data_dir, concurrency=1, chat_defaults=None):
    """The app. cache_defaults: CacheConfig fields for new sessions; chat_defaults: other
    ChatSession arguments (sampling, system prompt)."""
    n_layers = model.config.num_hidden_layers
    n_heads = model.config.num_key_value_heads

    def new_session():
        return ChatSession(model, tokenizer, cache=dict(cache_defaults), data_dir=data_dir, **(chat_defaults or {}))

    def chat_view(session):
        # typed text parts: Gradio runs a plain string through inspect.cleandoc, which would show
        # pasted code dedented, tabs as spaces and edge blank lines dropped (and copy them so)
        return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                for m in session.history] if session else []

    def panel_view(session, selection):
        """selection: this tab's {"layer", "head"}, a dict the selectors mutate, so a refresh in
        the middle of a streaming reply shows what the user picked after pressing Send."""
        if session is None or not len(session.ledger):
            empty = pd.DataFrame({"tokens_seen": [], "series": [], "kv_MiB": [], "slots": []})
            return "", "", empty, empty, pd.DataFrame()
        layer, head = selection["layer"], selection["head"]
        layer = None if layer in (None, "all") else int(layer)
        head = None if head in (None, "all") or layer is None else int(head)
        view = panel.render(session, layer, head)
        memory = pd.DataFrame(view["memory"] or {"tokens_seen": [], "series": [], "kv_MiB": [], "slots": []})
        return view["token_map"], view["stats"], memory, memory, pd.DataFrame(view["heavy"])

    def send(text, session, selection, layer, head):
        session = session or new_session()
        selection.update(layer=layer, head=head)
        try:
            stream = session.send(text)
        except ValueError as e:
            gr.Warning(str(e))
            yield (text, session, chat_view(session), *panel_view(session, selection))
            return
        last = 0.0
        for _ in warn_on_error(stream):
            now = time.perf_counter()
            if now - last >= PANEL_EVERY_S:
                last = now
                yield ("", session, chat_view(session), *panel_view(session, selection))
            else:
                yield ("", session, chat_view(session), *[gr.skip()] * 5)
        yield ("", session, chat_view(session), *panel_view(session, selection))

    def run_stream(action):
        def handler(session, selection, layer, head):
            selection.update(layer=layer, head=head)
            if session is None:
                gr.Warning("Nothing to do yet: send a message first.")
                yield (session, [], *panel_view(session, selection))
                return
            try:
                stream = action(session)
            except ValueError as e:
                gr.Warning(str(e))
                stream = ()
            last = time.perf_counter()
            for _ in warn_on_error(stream):
                if time.perf_counter() - last >= PANEL_EVERY_S:
                    last = time.perf_counter()
                    yield (session, chat_view(session), *panel_view(session, selection))
                else:
                    yield (session, chat_view(session), *[gr.skip()] * 5)
            yield (session, chat_view(session), *panel_view(session, selection))
        return handler

    def run_now(action):
        def handler(session, selection, *args):
            *args, layer, head = args
            selection.update(layer=layer, head=head)
            target = session or new_session()
            try:
                # keep the new session an action configured (settings applied before the first message)
                session = action(target, *args) or target
            except ValueError as e:
                gr.Warning(str(e))
            return (session, chat_view(session), *panel_view(session, selection))
        # Gradio names API parameters after the handler's signature: give it the action's names
        # (/edit takes turn, text, layer, head) instead of param_2, param_3, ...
        names = ["session", "selection", *list(inspect.signature(action).parameters)[1:], "layer", "head"]
        handler.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
        return handler

    def select(session, selection, layer, head):
        selection.update(layer=layer, head=head)  # a reply streaming now picks this up at its next refresh
        return panel_view(session, selection)

    def stop(session):
        if session is not None:
            session.stop()

    def close(session):
        if session is not None:
            session.close()

    def warn_on_error(stream):
        """A reply that fails midway (GenerationError: out of memory) ends with a warning; what it
        streamed stays in the chat."""
        try:
            yield from stream
        except ValueError as e:
            gr.Warning(str(e))

    def number(label, value, kind=int):
        """A number field's value: an empty field or text is the user's to fix, not a crash."""
        try:
            return kind(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{label} must be a number, got {value!r}") from None

    def apply_cache(session, selection, policy, budget, n_recent, n_sink, score, positions, layer, head,
                    progress=gr.Progress()):
        selection.update(layer=layer, head=head)
        session = session or new_session()
        session.on_progress = lambda done, total: progress(done / max(total, 1), desc="Replaying the chat")
        try:
            session.configure(cache=dict(policy=policy, budget=number("Budget", budget),
                                         n_recent=number("Recent window", n_recent) or None,
                                         n_sink=number("Sinks", n_sink), score=score, positions=positions))
        except ValueError as e:
            gr.Warning(str(e))
        finally:
            session.on_progress = None
        return (session, chat_view(session), *panel_view(session, selection))

    def apply_sampling(session, system_prompt, temperature, top_p, max_new_tokens):
        session.configure(temperature=number("Temperature", temperature, float), top_p=number("Top-p", top_p, float),
                          max_new_tokens=number("Max new tokens", max_new_tokens),
                          **({"system_prompt": system_prompt} if (system_prompt or None) != session.system_prompt else {}))

    def edit(session, turn, text):
        session.edit(int(turn), text)

    def pin(session, turn):
        session.pin(int(turn), pinned=True)

    def unpin(session, turn):
        session.pin(int(turn), pinned=False)

    def new_chat(session):
        return new_session()

    def restore(session, session_id):
        if not session_id:
            raise ValueError("choose a saved session first")
        try:
            return ChatSession.restore(model, tokenizer, session_id, data_dir)
        except store.SessionFileError as e:
            raise ValueError(str(e)) from None

    def saved_ids():
        return gr.update(choices=store.list_ids(data_dir) if data_dir else [])

    def export(session):
        if session is None:
            return None, None
        folder = Path(tempfile.mkdtemp(prefix="h2o-chat-export-"))
        md, js = folder / f"{session.id}.md", folder / f"{session.id}.json"
        md.write_text(session.to_markdown(), encoding="utf-8")
        js.write_text(json.dumps(session.record(), ensure_ascii=False, indent=1), encoding="utf-8")
        return str(md), str(js)

    with gr.Blocks(title="h2o-chat", analytics_enabled=False) as demo:
        session = gr.State(None, delete_callback=close)  # one per tab; see tab_closed
        selection = gr.State({"layer": "all", "head": "all"})  # the panel's layer and head, per tab
        with gr.Row():
            with gr.Column(scale=3, min_width=320):
                chatbot = gr.Chatbot(label="h2o-chat", height=460, buttons=["copy"])
                text = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, lines=2,
                                  max_lines=10, elem_id="message")
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate")
                    cont_btn = gr.Button("Continue")
                    undo_btn = gr.Button("Undo")
                    new_btn = gr.Button("New chat")
                with gr.Accordion("Generation", open=False):
                    system_prompt = gr.Textbox(label="System prompt", lines=2)
                    with gr.Row():
                        temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p")
                        max_new = gr.Slider(16, 2048, value=256, step=16, label="Max new tokens")
                    sampling_btn = gr.Button("Apply")
                with gr.Accordion("Cache (changing it replays the chat)", open=False):
                    with gr.Row():
                        policy = gr.Dropdown(list(POLICIES), value=cache_defaults["policy"], label="Policy")
                        budget = gr.Number(value=cache_defaults["budget"], label="Budget (slots)", precision=0)
                        n_recent = gr.Number(value=cache_defaults.get("n_recent") or 0, precision=0,
                                             label="Recent window (0 = half)")
                        n_sink = gr.Number(value=cache_defaults["n_sink"], label="Sinks", precision=0)
                        score = gr.Dropdown(list(SCORES), value=cache_defaults["score"], label="Score")
                        positions = gr.Dropdown(list(POSITIONS), value=cache_defaults["positions"], label="Positions")
                    cache_btn = gr.Button("Apply and replay")
                with gr.Accordion("Edit or pin a message", open=False):
                    with gr.Row():
                        turn = gr.Number(value=0, precision=0, label="Message number (0 = first)")
                        pin_btn = gr.Button("Pin (never evict)")
                        unpin_btn = gr.Button("Unpin")
                    edit_text = gr.Textbox(label="New text", lines=2)
                    edit_btn = gr.Button("Replace the message text")
                with gr.Accordion("Saved sessions and export", open=False):
                    with gr.Row():
                        saved = gr.Dropdown([], label="Saved sessions", allow_custom_value=False)
                        refresh_btn = gr.Button("Refresh")
                        restore_btn = gr.Button("Restore")
                    with gr.Row():
                        export_btn = gr.Button("Export")
                        export_md = gr.File(label="Markdown")
                        export_json = gr.File(label="JSON")
            with gr.Column(scale=2, min_width=320):
                gr.HTML(panel.legend_html())
                stats = gr.Markdown(elem_id="stats")
                with gr.Row():
                    layer = gr.Dropdown(["all"] + [str(i) for i in range(n_layers)], value="all", label="Layer",
                                        elem_id="layer")
                    head = gr.Dropdown(["all"] + [str(i) for i in range(n_heads)], value="all", label="KV head",
                                       elem_id="head")
                token_map = gr.HTML(elem_id="token-map")
                memory = gr.LinePlot(x="tokens_seen", y="kv_MiB", color="series", label="KV memory (MiB)",
                                     height=220)
                slots = gr.LinePlot(x="tokens_seen", y="slots", color="series", label="Slots per head",
                                    height=220)
                heavy = gr.Dataframe(label="Top heavy hitters", max_height=260)

        panel_out = [token_map, stats, memory, slots, heavy]
        limit = dict(concurrency_limit=concurrency, concurrency_id="generate")
        view = [selection, layer, head]  # every event updates this tab's panel selection first
        send_args = dict(fn=send, inputs=[text, session, *view], outputs=[text, session, chatbot, *panel_out])
        text.submit(**send_args, **limit, api_name="send")
        send_btn.click(**send_args, **limit, api_visibility="private")
        stop_btn.click(stop, inputs=session, queue=False, api_name="stop")
        stream_io = dict(inputs=[session, *view], outputs=[session, chatbot, *panel_out], **limit)
        regen_btn.click(run_stream(lambda s: s.regenerate()), **stream_io, api_name="regenerate")
        cont_btn.click(run_stream(lambda s: s.continue_reply()), **stream_io, api_name="continue")
        now = dict(outputs=[session, chatbot, *panel_out], **limit)
        undo_btn.click(run_now(lambda s: s.undo()), inputs=[session, *view], **now, api_name="undo")
        new_btn.click(run_now(new_chat), inputs=[session, *view], **now, api_name="new_chat")
        cache_btn.click(apply_cache, inputs=[session, selection, policy, budget, n_recent, n_sink, score, positions,
                                             layer, head], **now, api_name="apply_cache")
        sampling_btn.click(run_now(apply_sampling), inputs=[session, selection, system_prompt, temperature, top_p,
                                                            max_new, layer, head], **now, api_name="sampling")
        edit_btn.click(run_now(edit), inputs=[session, selection, turn, edit_text, layer, head], **now, api_name="edit")
        pin_btn.click(run_now(pin), inputs=[session, selection, turn, layer, head], **now, api_name="pin")
        unpin_btn.click(run_now(unpin), inputs=[session, selection, turn, layer, head], **now, api_name="unpin")
        restore_btn.click(run_now(restore), inputs=[session, selection, saved, layer, head], **now, api_name="restore")
        refresh_btn.click(saved_ids, outputs=saved, api_name="saved_sessions")
        export_btn.click(export, inputs=session, outputs=[export_md, export_json], api_name="export")
        for selector in (layer, head):
            selector.change(select, inputs=[session, *view], outputs=panel_out, api_name="select")
        demo.load(saved_ids, outputs=saved)

        def tab_closed(request: gr.Request):
            """The tab's heartbeat ended (closed, reloaded or asleep). Gradio would keep its state an
            hour and let a reply run to its end, holding the generation slot: stop the reply and
            free the cache now. The transcript stays (and is saved): a tab that was only asleep
            replays it at its next message."""
            tab = demo.state_holder.session_data.get(request.session_hash)
            close(tab.state_data.get(session._id) if tab else None)

        demo.unload(tab_closed)
    return demo
