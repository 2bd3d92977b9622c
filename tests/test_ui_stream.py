"""How a streaming reply reaches the page: how often the chat and the live panel are updated, and
which of the page's parts a stream carries. The page redraws every update it is sent, on the same
cores as the decode, so these are properties of the app (bench panel measures what they cost)."""

import pytest

from h2o_chat.ui import chat as ui_chat
from h2o_chat.ui.page import build
from h2o_chat.ui.state import CHAT_EVERY_S, PANEL_EVERY_S, new_view
from tests.conftest import make_tiny_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeTab:
    """Records what each update of `stream_into` would show."""

    def __init__(self):
        self.updates = []

    def streamed(self, session, state, live=None, panel=True, saved=True):
        self.updates.append({"live": live, "panel": panel, "saved": saved, "pieces": len(session.ledger)})
        return self.updates[-1]


class FakeSession:
    def __init__(self):
        self.ledger = []


def pieces(session, clock, n, every_s):
    """A reply of n pieces, one every `every_s` on the clock."""
    for i in range(n):
        clock.now += every_s
        session.ledger.append(i)
        yield "x"


def test_a_fast_reply_updates_the_chat_at_most_every_chat_every_s(monkeypatch):
    clock, tab, session = Clock(), FakeTab(), FakeSession()
    monkeypatch.setattr(ui_chat.time, "perf_counter", clock)
    outputs = list(ui_chat.stream_into(tab, session, new_view(), pieces(session, clock, 300, 0.01), saved=True))
    assert len(outputs) == len(tab.updates)
    first, *middle, last = tab.updates
    assert first["live"] == (None, None) and first["pieces"] == 0  # "waiting for the first token"
    assert middle[0]["pieces"] == 1  # the first token shows at once: the TTFT the user sees
    seconds = 300 * 0.01
    assert seconds / CHAT_EVERY_S - 2 <= len(middle) <= seconds / CHAT_EVERY_S + 2  # 300 pieces, ~30 updates
    panels = [u for u in middle if u["panel"]]
    assert seconds / PANEL_EVERY_S - 1 <= len(panels) <= seconds / PANEL_EVERY_S + 1
    assert all(u["live"][0] is not None and u["live"][1] > 0 for u in panels)  # TTFT and speed so far
    assert last == {"live": None, "panel": True, "saved": True, "pieces": 300}  # everything, once it ends


def test_a_slow_reply_updates_the_chat_at_every_piece(monkeypatch):
    clock, tab, session = Clock(), FakeTab(), FakeSession()
    monkeypatch.setattr(ui_chat.time, "perf_counter", clock)
    list(ui_chat.stream_into(tab, session, new_view(), pieces(session, clock, 20, CHAT_EVERY_S * 1.5), saved=False))
    assert [u["pieces"] for u in tab.updates[1:-1]] == list(range(1, 21))  # nothing is held back
    assert tab.updates[-1]["saved"] is False


def test_a_reply_streams_into_the_page_without_the_charts_which_follow_it_whole(tmp_path):
    """The page's streaming events (Enter, Send, retry, Continue) update the chat and the live
    view; the event chained after each draws the legend, the charts and the table, once."""
    model, tok = make_tiny_chat()
    demo = build(model, tok, dict(policy="h2o", budget=48), str(tmp_path))
    fns = list(demo.fns.values())

    def shows(fn):
        return {getattr(o, "elem_id", None) for o in fn.outputs} - {None}

    charts = {"legend", "memory-chart", "slots-chart", "heavy"}
    streams = [fn for fn in fns if fn.name in ("step2", "retried", "continued")]
    assert len(streams) == 4  # Enter and Send each start step2
    for fn in streams:
        assert {"chat", "token-map", "retention-map", "stats"} <= shows(fn) and not charts & shows(fn)
        assert [shows(f) for f in fns if f.trigger_after == fn._id] == [charts]
    # what scripts call (/send, /regenerate, ...) answers with everything, the charts included
    api = ("send", "edit", "regenerate", "continue_reply", "undo", "pin")
    for fn in fns:
        if fn.name in api:
            assert charts <= shows(fn)


def test_every_page_event_that_shows_the_charts_draws_them_again_after_it(tmp_path):
    """Gradio's LinePlot shows a value only once another arrives (ui.Tab.charts_after)."""
    model, tok = make_tiny_chat()
    fns = list(build(model, tok, dict(policy="h2o", budget=48), str(tmp_path)).fns.values())
    charts = {"memory-chart", "slots-chart"}
    drawn = [fn for fn in fns if charts <= {getattr(o, "elem_id", None) for o in fn.outputs}]
    page = [fn for fn in drawn if fn.name not in ("send", "edit", "regenerate", "continue_reply", "undo", "pin")]
    assert {fn.name for fn in page} >= {"charts", "load", "new_chat", "restore", "apply_cache", "apply_sampling",
                                        "undone", "edited", "liked", "select", "tick", "pin_system_prompt"}
    for fn in page:
        after = [f.name for f in fns if f.trigger_after == fn._id]
        # a charts drawing may be followed by another, or (load, new chat, restore) by the watch's timer
        assert after == ["charts"] or (fn.name == "charts" and after in ([], ["charts"], ["follow"])), (fn.name, after)
