"""Settings, saved conversations and export: the fields always show the settings the tab's
conversation runs on (`values(session)` fills them on New chat, Restore, reload and after every
Apply, refused or not), so Apply only ever changes what the user changed.
"""

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from ..chat.conversation import Sampling
from ..chat.session import ChatSession
from .state import number, warn


@dataclass
class Settings:
    system_prompt: gr.Textbox
    temperature: gr.Slider
    top_p: gr.Slider
    max_new: gr.Number
    sampling_btn: gr.Button
    policy: gr.Dropdown
    budget: gr.Number
    n_recent: gr.Number
    n_sink: gr.Number
    score: gr.Dropdown
    positions: gr.Dropdown
    cache_btn: gr.Button
    saved: gr.Dropdown
    restore_btn: gr.Button
    export_btn: gr.Button
    export_md: gr.File
    export_json: gr.File

    def fields(self):
        """Every field `values` fills, in its order."""
        return [self.system_prompt, self.temperature, self.top_p, self.max_new, self.policy, self.budget,
                self.n_recent, self.n_sink, self.score, self.positions]

    def cache_fields(self):
        return [self.policy, self.budget, self.n_recent, self.n_sink, self.score, self.positions]

    def sampling_fields(self):
        return [self.system_prompt, self.temperature, self.top_p, self.max_new]


def build():
    # what the fields show until the page's load fills them from the tab's session: Sampling's defaults
    defaults = Sampling()
    with gr.Accordion("Generation", open=False):
        system_prompt = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
        with gr.Row():
            temperature = gr.Slider(0, 2, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)",
                                    elem_id="temperature")
            top_p = gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="Top-p", elem_id="top-p")
            max_new = gr.Number(value=defaults.max_new_tokens, precision=0, label="Max new tokens", elem_id="max-new")
        sampling_btn = gr.Button("Apply", elem_id="apply-sampling")
    with gr.Accordion("Cache (changing it replays the chat)", open=False):
        with gr.Row():
            policy = gr.Dropdown(list(ChatSession.choices["policy"]), label="Policy", elem_id="policy")
            budget = gr.Number(label="Budget (slots)", precision=0, elem_id="budget")
            n_recent = gr.Number(precision=0, label="Recent window (0 = half)", elem_id="n-recent")
            n_sink = gr.Number(label="Sinks", precision=0, elem_id="n-sink")
            score = gr.Dropdown(list(ChatSession.choices["score"]), label="Score", elem_id="score")
            positions = gr.Dropdown(list(ChatSession.choices["positions"]), label="Positions", elem_id="positions")
        cache_btn = gr.Button("Apply and replay", elem_id="apply-cache")
    with gr.Accordion("Saved conversations and export", open=False):
        with gr.Row():
            saved = gr.Dropdown([], label="Saved conversations (newest first)", allow_custom_value=False,
                                elem_id="saved", scale=3)
            restore_btn = gr.Button("Restore", elem_id="restore", scale=1)
        with gr.Row():
            export_btn = gr.Button("Export")
            export_md = gr.File(label="Markdown")
            export_json = gr.File(label="JSON")
    return Settings(system_prompt, temperature, top_p, max_new, sampling_btn, policy, budget, n_recent, n_sink,
                    score, positions, cache_btn, saved, restore_btn, export_btn, export_md, export_json)


def values(session):
    """The fields' values, read from the session (the one owner of its settings)."""
    c, s = session.cache_config, session.sampling
    return [session.system_prompt or "", s.temperature, s.top_p, s.max_new_tokens, c.policy, c.budget,
            c.n_recent or 0, c.n_sink, c.score, c.positions]


def cache_settings(policy, budget, n_recent, n_sink, score, positions):
    """The cache fields as CacheConfig fields; an empty or odd number raises ValueError."""
    return dict(policy=policy, budget=number("Budget", budget), n_recent=number("Recent window", n_recent) or None,
                n_sink=number("Sinks", n_sink), score=score, positions=positions)


def sampling_settings(session, system_prompt, temperature, top_p, max_new):
    """The generation fields as `configure` arguments: the system prompt only when it changed
    (a change replays the chat)."""
    changes = dict(temperature=number("Temperature", temperature, float), top_p=number("Top-p", top_p, float),
                   max_new_tokens=number("Max new tokens", max_new))
    if (system_prompt or None) != session.system_prompt:
        changes["system_prompt"] = system_prompt
    return changes


def export(session):
    if session is None or not session.messages:
        warn("Nothing to export yet: send a message first.")
        return None, None
    folder = Path(tempfile.mkdtemp(prefix="h2o-chat-export-"))
    md, js = folder / f"{session.id}.md", folder / f"{session.id}.json"
    md.write_text(session.to_markdown(), encoding="utf-8")
    js.write_text(json.dumps(session.record(), ensure_ascii=False, indent=1), encoding="utf-8")
    return str(md), str(js)
