"""Settings, saved conversations (restore, delete) and export: the fields always show the settings the tab's
conversation runs on (`values(settings, session)` fills them on New chat, Restore, reload and
after every Apply, refused or not), so Apply only ever changes what the user changed.

Each field is made from its setting's one declaration (cache.config.setting: label, help,
choices); the bounds are checked once, by the dataclass, when Apply builds it. A field means what
its setting means in the library, the command line and the API: the recent window's 0 is no
recent window, and the field left blank is its default, None (auto: half of what the sinks leave
for h2o, all of it for sink and window).
"""

import json
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import gradio as gr

from ..cache.config import APP_FIELDS, CacheConfig
from ..chat.conversation import Sampling
from .state import number, warn

SAMPLING_FIELDS = ("temperature", "top_p", "max_new_tokens")  # the page's; the API takes every Sampling field
# Sliders are the page's choice for these two: they keep a value in the range a person wants
# (the dataclass allows temperatures up to 5; the page offers up to 2).
SLIDERS = {"temperature": dict(minimum=0, maximum=2, step=0.05), "top_p": dict(minimum=0.05, maximum=1, step=0.05)}
# Fields that may be left blank: their setting's None (its default, worked out from the others).
# 0 means what it means everywhere else (no recent window).
BLANK_IS_AUTO = {"n_recent"}


@dataclass
class Fields:
    """The page's settings fields and buttons (not chat.conversation.Settings, the settings themselves)."""
    system_prompt: gr.Textbox
    pin_system_prompt: gr.Checkbox
    sampling: dict  # Sampling field name -> its component, in SAMPLING_FIELDS' order
    cache: dict  # CacheConfig field name -> its component, in APP_FIELDS' order
    sampling_btn: gr.Button
    cache_btn: gr.Button
    saved: gr.Dropdown
    restore_btn: gr.Button
    delete_btn: gr.Button
    confirm_row: gr.Column  # Delete's second step: what it would delete, and Delete / Cancel
    confirm_text: gr.Markdown
    confirm_btn: gr.Button
    cancel_btn: gr.Button
    export_btn: gr.Button
    export_md: gr.File
    export_json: gr.File

    def fields(self):
        """Every field `values` fills, in the order the conversation-level API routes answer with them."""
        return [self.system_prompt, self.pin_system_prompt, *self.sampling.values(), *self.cache.values()]


def field_for(setting, value=None):
    """The page's field for one settings dataclass field: a dropdown of its choices, a slider
    (SLIDERS) or a number box, labelled and explained by its declaration."""
    meta, elem_id = setting.metadata, setting.name.replace("_", "-")
    common = dict(label=meta["label"], info=meta["help"], elem_id=elem_id)
    if isinstance(setting.default, bool):
        return gr.Checkbox(value=value, **common)
    if meta["choices"]:
        return gr.Dropdown(list(meta["choices"]), value=value, **common)
    if setting.name in SLIDERS:
        return gr.Slider(value=value, **SLIDERS[setting.name], **common)
    # no minimum/maximum here: Gradio's own check would answer an odd value before the dataclass's sentence
    return gr.Number(value=value, precision=0 if meta["integer"] or setting.name in ("budget", "n_recent") else None,
                     placeholder="auto" if setting.name in BLANK_IS_AUTO else None, **common)


def build():
    # what the fields show until the page's load fills them from the tab's session: the declared defaults
    sampling_settings = {f.name: f for f in fields(Sampling)}
    cache_settings = {f.name: f for f in fields(CacheConfig)}
    with gr.Accordion("Generation", open=False):
        system_prompt = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
        pin_system_prompt = gr.Checkbox(label="Pin the system prompt (never evict it; without one, the model's "
                                              "default)", elem_id="pin-system-prompt")
        with gr.Row():
            sampling = {name: field_for(sampling_settings[name], sampling_settings[name].default)
                        for name in SAMPLING_FIELDS}
        sampling_btn = gr.Button("Apply", elem_id="apply-sampling")
    with gr.Accordion("Cache (changing it replays the chat)", open=False):
        with gr.Row():
            cache = {name: field_for(cache_settings[name]) for name in APP_FIELDS}
        cache_btn = gr.Button("Apply and replay", elem_id="apply-cache")
    with gr.Accordion("Saved conversations and export", open=False):
        with gr.Row():
            saved = gr.Dropdown([], label="Saved conversations (newest first)", allow_custom_value=False,
                                elem_id="saved", scale=3)
            restore_btn = gr.Button("Restore", elem_id="restore", scale=1, min_width=90)
            delete_btn = gr.Button("Delete", elem_id="delete", scale=1, min_width=90)
        with gr.Column(visible=False, elem_id="confirm-delete") as confirm_row:
            confirm_text = gr.Markdown()
            with gr.Row():
                confirm_btn = gr.Button("Delete for good", variant="stop", elem_id="confirm-delete-btn", min_width=140)
                cancel_btn = gr.Button("Cancel", elem_id="cancel-delete", min_width=90)
        with gr.Row():
            export_btn = gr.Button("Export")
            export_md = gr.File(label="Markdown")
            export_json = gr.File(label="JSON")
    return Fields(system_prompt, pin_system_prompt, sampling, cache, sampling_btn, cache_btn, saved, restore_btn,
                    delete_btn, confirm_row, confirm_text, confirm_btn, cancel_btn, export_btn, export_md, export_json)


def values(s, session):
    """The fields' update, {component: value}, read from the session (the one owner of its settings).
    A recent window of None (auto) shows as a blank field, 0 as 0."""
    shown = {s.system_prompt: session.system_prompt or "", s.pin_system_prompt: session.settings.system_prompt_pinned}
    shown |= {field: getattr(session.sampling, name) for name, field in s.sampling.items()}
    shown |= {field: getattr(session.cache_config, name) for name, field in s.cache.items()}
    return shown


def short_label(cls, name):
    """A field's label without its note ("Budget (slots)" -> "Budget"), for a sentence about it."""
    return next(f for f in fields(cls) if f.name == name).metadata["label"].split(" (")[0]


def cache_settings(typed):
    """The Cache fields' values by name -> CacheConfig fields; an odd number, or an empty field that
    may not be blank, raises ValueError (the dataclass checks the rest). A blank recent window is
    None (auto); 0 is none, as in CacheConfig."""
    settings = dict(typed)
    for name in ("budget", "n_recent", "n_sink"):
        blank = typed[name] is None or (isinstance(typed[name], str) and not typed[name].strip())
        settings[name] = None if blank and name in BLANK_IS_AUTO else number(short_label(CacheConfig, name), typed[name])
    return settings


def sampling_settings(session, system_prompt, typed):
    """The Generation fields' values by name -> `configure` arguments: the system prompt only when
    it changed (a change replays the chat)."""
    changes = {name: number(short_label(Sampling, name), value, int if name == "max_new_tokens" else float)
               for name, value in typed.items()}
    if (system_prompt or None) != session.system_prompt:
        changes["system_prompt"] = system_prompt
    return changes


def applied_cache(session):
    """Apply's confirmation: the cache the chat now runs on."""
    c, stats = session.cache_config, session.stats
    recent = c.n_recent if c.n_recent is not None else "auto (half the rest)" if c.policy == "h2o" else "auto (the rest)"
    return (f"Cache applied: {c.policy}, budget {c.budget}, recent window {recent}, {c.n_sink} sinks, score {c.score}, "
            f"{c.positions} positions" + (", template tokens kept" if c.keep_template else "") + (f"; the chat was replayed ({stats['tokens_seen']:,} tokens)."
                                          if stats["tokens_seen"] else "."))


def applied_sampling(session):
    """Apply's confirmation: how replies are drawn from now on."""
    s = session.sampling
    system = "a system prompt" if session.system_prompt else "no system prompt"
    return (f"Generation applied: temperature {s.temperature:g}, top-p {s.top_p:g}, at most {s.max_new_tokens:,} "
            f"new tokens, {system}.")


def export(session):
    if session is None or not session.messages:
        warn("Nothing to export yet: send a message first.")
        return None, None
    folder = Path(tempfile.mkdtemp(prefix="h2o-chat-export-"))
    md, js = folder / f"{session.id}.md", folder / f"{session.id}.json"
    md.write_text(session.to_markdown(), encoding="utf-8")
    js.write_text(json.dumps(session.record(), ensure_ascii=False, indent=1), encoding="utf-8")
    return str(md), str(js)
