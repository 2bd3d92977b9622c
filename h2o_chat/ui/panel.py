"""The live cache panel: legend, stats, the layer/head pickers, the token map next to the
layers x positions retention map, two charts and the heavy-hitter table.

`outputs(panel)` lists what every chat action refreshes; `view(session, state)` computes those
values from the session and the tab's view state (the pickers mutate that state, so a pick made
while a reply streams shows at its next refresh).
"""

from dataclasses import dataclass

import gradio as gr
import pandas as pd

from ..cache.config import CacheConfig
from . import draw as render
from .state import pinned_turns, warn

CHART_COLUMNS = ["tokens seen", "cache", "KV MiB", "slots per head"]
COLOR_MAP = {render.SERIES[0]: "#0072B2", render.SERIES[1]: "#E69F00"}
ORIGIN = [{"tokens seen": 0, "cache": name, "KV MiB": 0.0, "slots per head": 0} for name in render.SERIES]


@dataclass
class Panel:
    legend: gr.HTML
    stats: gr.Markdown
    layer: gr.Dropdown
    head: gr.Dropdown
    token_map: gr.HTML
    retention_map: gr.HTML
    memory: gr.LinePlot
    slots: gr.LinePlot
    heavy: gr.Dataframe


def build(n_layers, n_heads, policy):
    legend = gr.HTML(render.legend_html(policy), elem_id="legend")
    stats = gr.Markdown(elem_id="stats")
    with gr.Row():
        layer = gr.Dropdown(["all"] + [str(i) for i in range(n_layers)], value="all", label="Layer", elem_id="layer")
        head = gr.Dropdown(["all"] + [str(i) for i in range(n_heads)], value="all", label="KV head", elem_id="head")
    with gr.Row(equal_height=False):
        token_map = gr.HTML(elem_id="token-map", min_height=120)
    retention_map = gr.HTML(elem_id="retention-map")
    # the value starts with both series (at the origin): the legend's entries are made from the
    # first value's series, and an empty first value left the legend with its title alone
    start = pd.DataFrame(render.memory_rows([]) or ORIGIN, columns=CHART_COLUMNS)
    chart = dict(value=start, x="tokens seen", color="cache", color_map=COLOR_MAP, colors_in_legend=list(render.SERIES),
                 x_title="tokens seen", height=260, color_title="", x_label_angle=0, tooltip="all")
    # titles inside the plot, no block label: a label pushes the plot down and clips its legend
    memory = gr.LinePlot(y="KV MiB", y_title="KV memory (MiB)", title="KV memory", show_label=False,
                         elem_id="memory-chart", **chart)
    slots = gr.LinePlot(y="slots per head", y_title="slots per KV head", title="Slots per KV head", show_label=False,
                        elem_id="slots-chart", **chart)
    heavy = gr.Dataframe(label="Top heavy hitters in the view", max_height=260, elem_id="heavy")
    return Panel(legend, stats, layer, head, token_map, retention_map, memory, slots, heavy)


def outputs(p):
    return [p.legend, p.token_map, p.retention_map, p.stats, p.memory, p.slots, p.heavy]


# A reply streaming into the page refreshes only the live view (LIVE: the token map, the retention
# map, the stats); the rest (CHARTS: the legend, the two charts, the table) is drawn once, whole,
# when the reply ends. On a small machine the browser shares the cores with the decode, and
# redrawing two Vega charts at every refresh cost it more than the tokens did. They are left out of
# the stream rather than skipped in it: a chart skipped mid-stream came back drawn from a diff
# against the skip (no lines, a categorical y axis).
LIVE, CHARTS = (1, 2, 3), (0, 4, 5, 6)  # positions in outputs()


def skip():
    return [gr.skip()] * 7


def parse_pick(value, count, what):
    """A picker's value: "all" -> None, else an index in range; anything else is refused."""
    if value in (None, "", "all"):
        return None
    try:
        index = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be 'all' or a number from 0 to {count - 1}, got {value!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{what} must be 'all' or a number from 0 to {count - 1}, got {value!r}")
    return index


def _chart(rows, y):
    # no rows yet: both series at the origin, as in build(). An empty frame's columns have no
    # numbers in them, so the plot would take its axes as categories and keep them once points came
    frame = pd.DataFrame(rows or ORIGIN, columns=CHART_COLUMNS)
    x_top = render.chart_limits(rows, "tokens seen")[1] if rows else 1
    return gr.LinePlot(value=frame, x_lim=[0, x_top], y_lim=render.chart_limits(rows, y))


def view(session, state, live=None, maps=True):
    """The panel's 7 values for this tab's session and view state (maps: see panel.render)."""
    if session is None or not len(session.ledger):
        policy = session.cache_config.policy if session is not None else CacheConfig.policy
        empty = _chart([], "KV MiB")
        waiting = "TTFT … · waiting for the first token" if live else "*Send a message to see what the cache keeps.*"
        return (render.legend_html(policy), "", "", waiting, empty,
                _chart([], "slots per head"), pd.DataFrame())
    shown = render.render(session, state["layer"], state["head"], live=live, maps=maps)
    pins = pinned_turns(session)
    if pins:  # the Chatbot cannot mark a user message, so the stats name the pinned ones
        shown["stats"] += " · pinned (never evicted): " + ", ".join(f"message {i + 1}" for i in pins)
    return (shown["legend"], shown["token_map"], shown["retention_map"], shown["stats"],
            _chart(shown["memory"], "KV MiB"), _chart(shown["memory"], "slots per head"), pd.DataFrame(shown["heavy"]))


def pick(session, state, layer, head, n_layers, n_heads):
    """A picker changed: check both values, then show the new view. An odd value warns and the
    view stays as it was."""
    try:
        new_layer = parse_pick(layer, n_layers, "Layer")
        new_head = parse_pick(head, n_heads, "KV head")
    except ValueError as e:
        warn(e)
        return skip()
    state.update(layer=new_layer, head=new_head if new_layer is not None else None)
    return view(session, state)


def wire(p, session, state, n_layers, n_heads, charts_after):
    """The pickers. charts_after: ui.Tab.charts_after (the charts need a second drawing)."""
    def select(session, state, layer, head):
        return pick(session, state, layer, head, n_layers, n_heads)

    for picker in (p.layer, p.head):
        charts_after(picker.change(select, inputs=[session, state, p.layer, p.head], outputs=outputs(p),
                                   api_name="select", queue=False))
