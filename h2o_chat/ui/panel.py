"""The live cache panel: legend, stats, the layer/head pickers, the token map next to the
layers x positions retention map, two charts and the heavy-hitter table.

`Panel.shown` lists what every chat action refreshes, `Panel.live` the part a streaming reply
refreshes and `Panel.charts` the part drawn once it ends; `update(panel, session, state)` is the
Gradio update of those parts, {component: value}, drawn (draw.py) from the session and the tab's
view state (the pickers change that state, so a pick made while a reply streams shows at its
next refresh).
"""

from dataclasses import dataclass

import gradio as gr
import pandas as pd

from ..cache.config import CacheConfig
from . import draw
from .state import warn

CHART_COLUMNS = ["tokens seen", "cache", "KV MiB", "slots per head"]
COLOR_MAP = {draw.SERIES[0]: "#0072B2", draw.SERIES[1]: "#E69F00"}
ORIGIN = [{"tokens seen": 0, "cache": name, "KV MiB": 0.0, "slots per head": 0} for name in draw.SERIES]


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

    @property
    def shown(self):
        """Everything a chat action refreshes, in the order the API routes answer with it."""
        return [self.legend, self.token_map, self.retention_map, self.stats, self.memory, self.slots, self.heavy]

    @property
    def live(self):
        """What a reply streaming into the page refreshes. On a small machine the browser shares the
        cores with the decode, and redrawing two Vega charts at every refresh cost it more than the
        tokens did, so the legend, the charts and the table (`charts`) are drawn once, when the reply
        ends. They are left out of the stream rather than skipped in it: a chart skipped mid-stream
        came back drawn from a diff against the skip (no lines, a categorical y axis)."""
        return [self.token_map, self.retention_map, self.stats]

    @property
    def charts(self):
        return [self.legend, self.memory, self.slots, self.heavy]


def build(n_layers, n_heads, policy):
    legend = gr.HTML(draw.legend_html(policy), elem_id="legend")
    stats = gr.Markdown(elem_id="stats")
    with gr.Row():
        layer = gr.Dropdown(["all"] + [str(i) for i in range(n_layers)], value="all", label="Layer", elem_id="layer")
        head = gr.Dropdown(["all"] + [str(i) for i in range(n_heads)], value="all", label="KV head", elem_id="head")
    with gr.Row(equal_height=False):
        token_map = gr.HTML(elem_id="token-map", min_height=120)
    retention_map = gr.HTML(elem_id="retention-map")
    # the value starts with both series (at the origin): the legend's entries are made from the
    # first value's series, and an empty first value left the legend with its title alone
    start = pd.DataFrame(ORIGIN, columns=CHART_COLUMNS)
    chart = dict(value=start, x="tokens seen", color="cache", color_map=COLOR_MAP, colors_in_legend=list(draw.SERIES),
                 x_title="tokens seen", height=260, color_title="", x_label_angle=0, tooltip="all")
    # titles inside the plot, no block label: a label pushes the plot down and clips its legend
    memory = gr.LinePlot(y="KV MiB", y_title="KV memory (MiB)", title="KV memory", show_label=False,
                         elem_id="memory-chart", **chart)
    slots = gr.LinePlot(y="slots per head", y_title="slots per KV head", title="Slots per KV head", show_label=False,
                        elem_id="slots-chart", **chart)
    heavy = gr.Dataframe(pd.DataFrame(columns=draw.HEAVY_COLUMNS), label="Top heavy hitters in the view",
                         max_height=260, elem_id="heavy")
    return Panel(legend, stats, layer, head, token_map, retention_map, memory, slots, heavy)


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
    x_top = draw.chart_limits(rows, "tokens seen")[1] if rows else 1
    return gr.LinePlot(value=frame, x_lim=[0, x_top], y_lim=draw.chart_limits(rows, y))


def update(p, session, state, live=None, maps=True):
    """The panel's parts for this tab's session and view state, {component: value} (maps=False
    leaves the token map and the retention map out: the costly parts, not needed for the charts)."""
    if session is None or not len(session.ledger):
        policy = session.cache_config.policy if session is not None else CacheConfig.policy
        waiting = "TTFT … · waiting for the first token" if live else "*Send a message to see what the cache keeps.*"
        maps_update = {p.token_map: "", p.retention_map: ""} if maps else {}
        return {p.legend: draw.legend_html(policy), **maps_update, p.stats: waiting, p.memory: _chart([], "KV MiB"),
                p.slots: _chart([], "slots per head"), p.heavy: pd.DataFrame(columns=draw.HEAVY_COLUMNS)}
    drawn = draw.panel(session, state["layer"], state["head"], live=live, maps=maps)
    maps_update = {p.token_map: drawn["token_map"], p.retention_map: drawn["retention_map"]} if maps else {}
    return {p.legend: drawn["legend"], **maps_update, p.stats: drawn["stats"],
            p.memory: _chart(drawn["memory"], "KV MiB"), p.slots: _chart(drawn["memory"], "slots per head"),
            p.heavy: pd.DataFrame(drawn["heavy"], columns=draw.HEAVY_COLUMNS)}


def pick(p, session, state, layer, head, n_layers, n_heads):
    """A picker changed: check both values, then show the new view. An odd value warns and the
    view stays as it was."""
    try:
        new_layer = parse_pick(layer, n_layers, "Layer")
        new_head = parse_pick(head, n_heads, "KV head")
    except ValueError as e:
        warn(e)
        return {p.stats: gr.skip()}  # an empty dict would read as one value, not as no update
    state.update(layer=new_layer, head=new_head if new_layer is not None else None)
    return update(p, session, state)


def remembered_view(remembered, n_layers, n_heads):
    """The view a browser remembers ({"layer", "head"}, as `wire` saves it) checked against this
    model: a view of another model's layers, or anything odd, is every layer and head."""
    try:
        layer = parse_pick((remembered or {}).get("layer"), n_layers, "Layer")
        head = parse_pick((remembered or {}).get("head"), n_heads, "KV head")
    except (ValueError, AttributeError):
        return {"layer": None, "head": None}
    return {"layer": layer, "head": head if layer is not None else None}


def pickers(p, state):
    """The pickers' values for a view state."""
    return {p.layer: "all" if state["layer"] is None else str(state["layer"]),
            p.head: "all" if state["head"] is None else str(state["head"])}


def wire(p, session, state, n_layers, n_heads, charts_after, remembered):
    """The pickers (.input: a pick by the user, not the page setting them on load). Each pick is
    remembered by the browser (`remembered`, a BrowserState), so a reload shows the same view.
    charts_after: ui.Tab.charts_after (the charts need a second drawing)."""
    def select(session, state, layer, head):
        shown = pick(p, session, state, layer, head, n_layers, n_heads)
        return {**shown, remembered: dict(state)}

    for picker in (p.layer, p.head):
        charts_after(picker.input(select, inputs=[session, state, p.layer, p.head], outputs=[*p.shown, remembered],
                                  api_name="select", queue=False))
