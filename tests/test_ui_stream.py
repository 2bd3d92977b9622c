"""How a streaming reply reaches the page: how often the chat and the live panel are updated, and
what a mid-stream panel update carries. The page redraws every update it is sent, on the same
cores as the decode, so these rates are a property of the app (bench panel measures the speed)."""

import gradio as gr
import pytest

from h2o_chat import ChatSession, ui_chat, ui_panel
from h2o_chat.ui_state import CHAT_EVERY_S, PANEL_EVERY_S, new_view
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


@pytest.fixture(scope="module")
def session():
    model, tok = make_tiny_chat()
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), temperature=0,
                    max_new_tokens=20)
    "".join(s.send("Tell me a story about a lighthouse."))
    return s


def test_mid_stream_the_panel_sends_only_its_live_view(session):
    names = ["legend", "token_map", "retention_map", "stats", "memory", "slots", "heavy"]  # ui_panel.outputs' order
    done = dict(zip(names, ui_panel.view(session, new_view())))
    live = dict(zip(names, ui_panel.view(session, new_view(), live=(0.2, 12.5))))
    skipped = {n for n, v in live.items() if is_skip(v)}
    assert skipped == {"legend", "memory", "slots", "heavy"}  # redrawn when the reply ends
    assert live["token_map"] == done["token_map"] and live["retention_map"] == done["retention_map"]
    assert "· streaming" in live["stats"] and "streaming" not in done["stats"]
    assert not any(is_skip(v) for v in done.values())  # a finished reply: all of it
    waiting = ui_panel.view(session, new_view(), live=(None, None))
    assert not any(is_skip(v) for v in waiting)  # a new reply starts whole


def is_skip(value):
    return isinstance(value, dict) and value == gr.skip()
