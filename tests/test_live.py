"""The page's live conversations (ui/live.py, App.attach/held/delete): one ChatSession per
conversation shared by every tab on it, dropped from memory once idle and no tab shows it, and
back through App.open. Real sessions of the tiny model; the idle clock is a fake one, except in
the timer's own test (a deadline)."""

import time

import pytest

from h2o_chat.chat import saved_kv, store
from h2o_chat.ui.live import LiveSessions
from h2o_chat.ui.state import App, PrefillSpeed, prefill_notice
from tests.live import CALL_DEADLINE_S, deadline

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def app(tiny_chat, tmp_path):
    """An App whose live sessions go idle after 60 s of a fake clock; opens counts App.open's calls."""
    model, tok = tiny_chat
    app = App(model, tok, dict(CACHE), str(tmp_path), dict(temperature=0, max_new_tokens=12))
    app.clock = Clock()
    app.live = LiveSessions(idle_s=60, clock=app.clock)
    app.opens = []
    opened = app.open
    app.open = lambda cid, progress=None: app.opens.append(cid) or opened(cid, progress)
    return app


def story(app, tab="tab-a", turns=3):
    """A conversation of a few turns, written in `tab`, saved."""
    session = app.attach(tab, None)
    for n in range(turns):
        "".join(session.send(f"Turn {n}: tell me more about the lighthouse."))
    return session


def test_a_second_tab_and_a_reload_attach_to_the_live_session_without_a_replay(app):
    first = story(app)
    processed = first.timeline.tokens_processed
    app.live.detach("tab-a")  # the reload: the old tab goes ...
    assert app.attach("tab-a2", first.id) is first  # ... and the new one gets the same session
    assert app.attach("tab-b", first.id) is first  # a second tab too
    assert first.timeline.tokens_processed == processed and app.opens == []  # nothing read, nothing replayed


def test_an_idle_session_no_tab_shows_is_dropped_and_comes_back_through_open(app):
    session = story(app)
    cid, history = session.id, session.history
    app.live.detach("tab-a")
    app.clock.now += 59
    assert app.live.sweep() == [] and app.live.get(cid) is session  # not idle long enough yet
    app.clock.now += 1
    assert app.live.sweep() == [session] and app.live.get(cid) is None  # dropped ...
    assert session.stats["tokens_seen"] == 0  # ... its cache freed
    assert store.read(app.data_dir, cid).messages == session.messages  # the conversation stays saved
    saved_kv.flush(CALL_DEADLINE_S)
    back = app.attach("tab-b", cid)
    assert back is not session and back.history == history and app.opens == [cid]  # back through App.open
    assert back.timeline.tokens_processed == 0  # from the cache saved beside it: nothing replayed
    assert app.live.get(cid) is back


def test_a_session_a_tab_shows_is_never_dropped_however_idle(app):
    session = story(app)
    app.clock.now += 10_000
    assert app.live.sweep() == [] and app.live.get(session.id) is session


def test_an_unsaved_chat_is_kept_it_could_not_come_back(tiny_chat):
    model, tok = tiny_chat
    clock = Clock()
    app = App(model, tok, dict(CACHE), None, dict(temperature=0, max_new_tokens=8))  # no data folder
    app.live = LiveSessions(idle_s=60, clock=clock)
    session = app.attach("tab", None)
    "".join(session.send("Remember me"))
    app.live.detach("tab")
    clock.now += 10_000
    assert app.live.sweep() == [] and app.live.get(session.id) is session
    empty = app.attach("other", None)  # an empty new chat: nothing to lose
    app.live.detach("other")
    clock.now += 60
    assert app.live.sweep() == [empty]


def test_closing_one_tab_leaves_the_reply_another_tab_shows_and_the_last_stops_it(app):
    session = story(app, turns=1)
    app.attach("tab-b", session.id)
    reply = session.send("A long reply, please.")
    next(reply, None)  # streaming now: the session is busy
    app.live.detach("tab-a")
    assert not session._stop.is_set()  # tab b still shows it: its reply goes on
    app.live.detach("tab-b")
    assert session._stop.is_set()  # nobody shows it: stopped, as a closed tab's reply always was
    for _ in reply:
        pass
    app.clock.now += 60
    assert app.live.sweep() == [session]  # busy sessions wait; idle ones go


def test_a_tab_that_slept_past_the_idle_time_acts_on_the_session_opened_again(app):
    session = story(app)
    app.live.detach("tab-a")  # asleep: its heartbeat ended; its page still holds `session`
    app.clock.now += 60
    app.live.sweep()
    other = app.attach("tab-b", session.id)  # meanwhile another tab opened it again
    assert app.held("tab-a", session) is other  # one session per conversation, not two
    app.live.detach("tab-b")
    app.clock.now += 60
    assert app.live.sweep() == []  # tab a shows it now
    app.live.detach("tab-a")
    app.clock.now += 60
    assert app.live.sweep() == [other]
    again = app.held("tab-a", other)
    assert again is not other and again.history == session.history and app.opens == [session.id] * 2


def test_delete_lets_the_live_session_go_and_a_tab_left_on_it_gets_a_new_chat(app):
    session = story(app)
    cid = session.id
    saved_kv.flush(CALL_DEADLINE_S)
    assert app.disk_usage().startswith(f"Saved caches: {saved_kv.usage(app.data_dir)[0] / saved_kv.MIB:,.0f} MiB of ")
    assert saved_kv.usage(app.data_dir)[0] > 0
    app.delete(cid)
    assert not app.is_saved(cid) and app.live.get(cid) is None
    assert saved_kv.usage(app.data_dir)[0] == 0  # its saved caches went with it
    assert not (store.session_path(app.data_dir, cid).parent / f".{cid}.lock").exists()
    assert session.data_dir is None  # never saved again: no write can bring the file back
    fresh = app.held("tab-b", session)  # a tab that still showed it
    assert fresh is not session and fresh.messages == [] and app.live.get(fresh.id) is fresh
    assert fresh.take_notices() == ["That conversation was deleted (in another tab): this is a new chat."]


def test_delete_refuses_a_conversation_writing_a_reply(app):
    session = story(app, turns=1)
    reply = session.send("Go on.")
    next(reply, None)
    with pytest.raises(ValueError, match="stop it first"):
        app.delete(session.id)
    session.stop()
    for _ in reply:
        pass
    assert app.is_saved(session.id)


def test_a_fork_is_held_under_its_new_id(app):
    session = story(app, turns=1)
    old = session.id
    other = store.read(app.data_dir, old)  # another process writes the file: this session's next save forks
    other.messages[0].content = "Changed elsewhere."
    store.write(app.data_dir, other)
    "".join(session.send("And then?"))
    assert session.id != old
    app.live.show("tab-a", session)
    assert app.live.get(session.id) is session and app.live.get(old) is None


def test_the_idle_timer_drops_on_its_own(tiny_chat, tmp_path):
    model, tok = tiny_chat
    app = App(model, tok, dict(CACHE), str(tmp_path), dict(temperature=0, max_new_tokens=8))
    app.live = LiveSessions(idle_s=0.3)
    session = app.attach("tab", None)
    "".join(session.send("Hello"))
    app.live.detach("tab")
    for _ in deadline(10):
        if app.live.get(session.id) is None:
            break
    assert session.stats["tokens_seen"] == 0


def test_a_long_message_is_announced_with_its_measured_prefill_time(app):
    speed = PrefillSpeed()
    speed.record(32, 1.0)  # too short to measure anything: overhead
    assert speed.tokens_per_s() is None
    speed.record(1000, 2.0)
    speed.record(3000, 2.0)
    assert speed.tokens_per_s() == 1000 and speed.estimate(5000) == 5.0
    app.prefill = speed
    assert prefill_notice(app, "short") is None
    said = prefill_notice(app, "x" * 20_000)  # the tiny tokenizer: one token a character
    assert said.startswith("This message is 20,000 tokens: reading it takes about 20 s on this machine") and \
        "1,000 tokens/s" in said
    app.prefill = PrefillSpeed()  # nothing measured yet: the message's start is read to measure it
    before = time.perf_counter()
    prefill_notice(app, "y" * 20_000)
    assert app.prefill.tokens_per_s() is not None and time.perf_counter() - before < 30


def test_a_script_tab_closed_mid_reply_stops_it(app):
    # a gradio_client tab runs no page load: App.live never saw it show the session; its state did
    session = app.attach(None, None)
    "".join(session.send("Hello"))
    reply = session.send("A long reply, please.")
    next(reply, None)
    app.live.detach("script-tab", session)
    assert session._stop.is_set()
    for _ in reply:
        pass
