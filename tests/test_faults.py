"""Faults: Stop at any moment, a tab closed or a call cancelled mid-reply, two tabs at once,
the server killed with SIGKILL mid-reply, the model running out of memory. Each time no
finished word is lost, the session stays consistent (its next turn is what a fresh replay of
the transcript gives) and the app goes on serving."""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch
from gradio_client import Client
from transformers import DynamicCache

import h2o_chat.ui.state as ui_state
from h2o_chat import ChatSession, H2OCache
from h2o_chat.chat import session as session_mod
from h2o_chat.chat import store
from h2o_chat.chat.batch import StackedCache
from h2o_chat.chat.conversation import Message
from h2o_chat.chat.session import GenerationError
from h2o_chat.models.load import load_model
from tests.conftest import make_tiny_chat
from tests.live import (
    CALL_DEADLINE_S,
    call,
    deadline,
    free_port,
    live_app,
    never_ending,
    save_tiny_chat,
    text_of,
    texts,
    warnings_of,
)

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_torch_thread")
NO_EVICTION = dict(policy="h2o", budget=4096, n_sink=4, n_recent=64)
EVICTING = dict(policy="h2o", budget=48, n_sink=2, n_recent=16)


def greedy_reply(model, tok, history, max_new_tokens):
    """What re-prefilling the whole history gives (the reference for 'the cache is consistent')."""
    ids = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, cache=DynamicCache(), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def assert_consistent(session):
    """The tokens fed, the ledger and the cache agree token for token, and the saved transcript
    restores to the same history."""
    assert len(session.ledger) == len(session._fed) == session.stats["tokens_seen"]
    kept = session.ledger.retention(session.cache)["kept"]
    for layer in range(2):
        ids = session.cache.token_ids(layer)[0]
        for head in range(2):
            assert kept[layer, head].nonzero().flatten().tolist() == sorted(ids[head].tolist())
    replayed = ChatSession.restore(session.model, session.tokenizer, session.id, session.data_dir)
    assert replayed.history == session.history


def assert_in_sync(session):
    """Right after a reply: the cache saw exactly the template's rendering of the history before it."""
    prompt = session.tokenizer.apply_chat_template(session.history[:-1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    assert session._fed[: len(prompt)] == prompt


# ---------------------------------------------------------------------------------------------
# Stop


@pytest.mark.parametrize("cache", [NO_EVICTION, EVICTING], ids=["no-eviction", "evicting"])
@pytest.mark.slow
def test_stop_at_50_random_points(tiny_chat, tmp_path, cache):
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=cache, temperature=0, max_new_tokens=8, data_dir=tmp_path)
    rng = random.Random(50)
    stopped = 0
    for i in range(50):
        stop_after = rng.randint(0, 9)  # 0: Stop right after Send; 8 or 9: after the reply has ended
        stream = session.send(f"Question {i}: go on.")
        if stop_after == 0:
            session.stop()
        pieces = []
        for piece in stream:
            pieces.append(piece)
            if len(pieces) == stop_after:
                session.stop()
        if stop_after < 8:
            stopped += 1
            assert len(pieces) <= stop_after  # nothing streams after Stop
        assert session.history[-1] == {"role": "assistant", "content": "".join(pieces)}  # exactly as streamed
        assert store.load(tmp_path, session.id)["messages"][-1]["content"] == "".join(pieces)  # and saved
    assert stopped > 30 and len(session.history) == 100
    assert_consistent(session)
    history = session.history + [{"role": "user", "content": "And finally?"}]
    session.configure(max_new_tokens=10)
    reply = "".join(session.send("And finally?"))
    assert_in_sync(session)
    if cache is NO_EVICTION:  # with nothing evicted the next turn is exactly a full re-prefill's
        assert reply == greedy_reply(model, tok, history, 10)


def test_stop_from_another_thread_at_random_moments(tiny_chat, tmp_path):
    # the UI's Stop arrives on another thread, at any point of a step
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=EVICTING, temperature=0, max_new_tokens=40, data_dir=tmp_path)
    rng = random.Random(3)
    for i in range(10):
        timer = threading.Timer(rng.uniform(0, 0.02), session.stop)
        timer.start()
        streamed = "".join(session.send(f"Turn {i}"))
        timer.join(timeout=10)
        assert not timer.is_alive(), "stop() from the timer's thread never returned"
        assert session.history[-1]["content"] == streamed
    assert_consistent(session)


def test_a_long_reply_is_saved_while_it_streams(tiny_chat, tmp_path, monkeypatch):
    # SIGKILL mid-reply loses at most AUTOSAVE_EVERY_S of it; here every step is saved
    monkeypatch.setattr(session_mod, "AUTOSAVE_EVERY_S", 0.0)
    model, tok = tiny_chat
    never_ending(model, tok)
    session = ChatSession(model, tok, cache=EVICTING, temperature=0, max_new_tokens=30, data_dir=tmp_path)
    pieces, stream = [], session.send("Tell me a story")
    for piece in stream:
        pieces.append(piece)
        saved = store.load(tmp_path, session.id)["messages"]
        # the save at the start of this step holds everything streamed before it
        assert saved[-1] == {"role": "assistant", "content": "".join(pieces[:-1]), "pinned": False}
        if len(pieces) == 10:
            break  # the "crash": the reply stays suspended (still referenced), its end never comes
    restored = ChatSession.restore(model, tok, session.id, tmp_path)
    assert restored.history[-1]["content"] == "".join(pieces[:9])
    assert "".join(restored.continue_reply())  # the story goes on from there
    del stream


def test_regenerate_answers_a_message_left_without_a_reply(tiny_chat, tmp_path):
    # SIGKILL before the first partial save leaves the user's message without a reply
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=EVICTING, temperature=0, max_new_tokens=6, data_dir=tmp_path)
    "".join(session.send("First"))
    session.messages.append(Message("user", "Second"))
    session.autosave()
    restored = ChatSession.restore(model, tok, session.id, tmp_path)
    "".join(restored.regenerate())
    assert [m["role"] for m in restored.history] == ["user", "assistant", "user", "assistant"]
    assert restored.history[2]["content"] == "Second"


# ---------------------------------------------------------------------------------------------
# Out of memory


class OutOfMemory:
    """Makes a forward of the model run out of memory, once: its n-th call from now or (with
    decode=True) its n-th one-token call, the n-th generated token's. The error comes from the
    last decoder layer's attention, after the first has already written the new tokens into its
    cache, as a real out-of-memory midway through the model would. It hooks the caches every
    forward goes through: a conversation's own (the model's forward, and the lean decode step of
    decode.py) and the stacked one of a batched decode step (chat/batch.py)."""

    def __init__(self, monkeypatch, model):
        self.countdown, self.decode, self.failing = None, False, False
        self.last = model.config.num_hidden_layers - 1
        for cache_class in (H2OCache, StackedCache):
            monkeypatch.setattr(cache_class, "attend", self._hooked(cache_class.attend))

    def _hooked(self, attend):
        def failing_attend(cache, layer_idx, query, keys, values, scaling):
            if layer_idx == 0 and self.countdown is not None and (query.shape[2] == 1 or not self.decode):
                self.countdown -= 1
                self.failing = self.countdown == 0
                self.countdown = None if self.failing else self.countdown
            if layer_idx == self.last and self.failing:
                self.failing = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            return attend(cache, layer_idx, query, keys, values, scaling)
        return failing_attend

    def at_call(self, n, decode=False):
        self.countdown, self.decode = n, decode


def test_out_of_memory_mid_reply_ends_the_reply_and_keeps_it(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    oom = OutOfMemory(monkeypatch, model)
    session = ChatSession(model, tok, cache=NO_EVICTION, temperature=0, max_new_tokens=12, data_dir=tmp_path)
    "".join(session.send("Hello there"))
    oom.at_call(3, decode=True)  # three tokens stream; reading the third back into the cache fails
    pieces = []
    with pytest.raises(GenerationError, match="out of memory"):
        for piece in session.send("Tell me more"):
            pieces.append(piece)
    assert len(pieces) == 3
    assert session.history[-1]["content"] == "".join(pieces)  # the reply ends where it was, as streamed
    assert store.load(tmp_path, session.id)["messages"][-1]["content"] == "".join(pieces)
    assert_consistent(session)
    history = session.history + [{"role": "user", "content": "Go on"}]
    assert "".join(session.send("Go on")) == greedy_reply(model, tok, history, 12)  # the cache caught up
    assert_in_sync(session)


def test_out_of_memory_before_the_reply_takes_the_message_back(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    oom = OutOfMemory(monkeypatch, model)
    session = ChatSession(model, tok, cache=NO_EVICTION, temperature=0, max_new_tokens=8, data_dir=tmp_path)
    "".join(session.send("Hello there"))
    before, fed = session.history, list(session._fed)
    oom.at_call(1)  # reading the new message fails
    stream = session.send("A long paste " * 30)  # checked at once; read by the model when iterated
    with pytest.raises(GenerationError, match="out of memory") as failed:
        next(stream)
    assert session.history == before and session._fed == fed  # as if never sent
    assert failed.value.unsent == "A long paste " * 30  # the text, for the UI to give back
    assert not session.busy
    assert [m["content"] for m in store.load(tmp_path, session.id)["messages"]] == [m["content"] for m in before]
    history = session.history + [{"role": "user", "content": "Short one"}]
    assert "".join(session.send("Short one")) == greedy_reply(model, tok, history, 8)


def test_out_of_memory_while_replaying_leaves_a_usable_session(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    oom = OutOfMemory(monkeypatch, model)
    session = ChatSession(model, tok, cache=dict(NO_EVICTION, prefill_chunk=8), temperature=0, max_new_tokens=6,
                          data_dir=tmp_path)
    for text in ("One", "Two", "Three"):
        "".join(session.send(text))
    oom.at_call(3)  # changing the cache replays the chat: its third chunk fails
    with pytest.raises(GenerationError, match="out of memory"):
        session.configure(cache=dict(EVICTING, prefill_chunk=8))
    assert len(session.history) == 6
    "".join(session.send("Four"))  # the next turn replays what is missing
    assert_consistent(session)
    assert_in_sync(session)


# ---------------------------------------------------------------------------------------------
# Closing a session


def test_close_frees_the_cache_and_the_next_turn_replays(tiny_chat, tmp_path):
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=NO_EVICTION, temperature=0, max_new_tokens=8, data_dir=tmp_path)
    twin = ChatSession(model, tok, cache=NO_EVICTION, temperature=0, max_new_tokens=8)
    for s in (session, twin):
        "".join(s.send("Hello there"))
    session.close()
    assert session.cache.kv_bytes() == 0 and len(session.ledger) == 0 and session.history == twin.history
    assert "".join(session.send("Again")) == "".join(twin.send("Again"))  # a sleeping tab that wakes up


def test_close_mid_reply_stops_it_then_frees_the_cache(tiny_chat, tmp_path):
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=EVICTING, temperature=0, max_new_tokens=200, data_dir=tmp_path)
    pieces = []
    for piece in session.send("Tell me a story"):
        pieces.append(piece)
        if len(pieces) == 3:
            closing = threading.Thread(target=session.close, daemon=True)
            closing.start()  # the tab closes; the reply is mid-step
            time.sleep(0.05)
            assert session.cache.kv_bytes() > 0  # not under the running reply's feet
    closing.join(timeout=10)
    assert not closing.is_alive(), "close() never returned"
    assert len(pieces) == 3 and session.history[-1]["content"] == "".join(pieces)
    assert session.cache.kv_bytes() == 0  # freed as soon as the reply stopped
    "".join(session.send("Go on"))
    assert_consistent(session)
    assert_in_sync(session)


# ---------------------------------------------------------------------------------------------
# Through the app: a never-ending tiny model (every reply runs to max_new_tokens), one reply at
# a time, every ChatSession it makes tracked, and a switch that makes the model run out of memory


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    data = tmp_path_factory.mktemp("app-data")
    model, tok = never_ending(*make_tiny_chat())
    sessions = weakref.WeakSet()

    class Tracked(ChatSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.add(self)

    with pytest.MonkeyPatch.context() as mp:
        oom = OutOfMemory(mp, model)
        mp.setattr(ui_state, "ChatSession", Tracked)
        # Gradio notices a closed tab when its next heartbeat fails to send: every 15 s by default
        mp.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.2")
        with live_app(data, model, tok, cache=EVICTING, concurrency=1, temperature=0, max_new_tokens=2000) as (url, demo):
            yield {"url": url, "data": data, "oom": oom, "sessions": sessions, "live": demo.h2o_app.live}


def session_of(app, first_message):
    return next(s for s in list(app["sessions"]) if s.history and s.history[0]["content"] == first_message)


def streaming(job, outputs=3):
    deadline = time.monotonic() + 30
    while len(job.outputs()) < outputs:
        assert time.monotonic() < deadline, "the reply never started"
        time.sleep(0.01)


def open_heartbeat(url, session_hash):
    """The connection a browser tab holds open while it lives (closing it = closing the tab)."""
    host, port = url.split("//")[1].strip("/").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"GET /gradio_api/heartbeat/{session_hash} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


def short_replies(client):
    call(client, "", 0, 0.9, 16, api_name="/sampling")  # max new tokens: 16


@pytest.mark.live
@pytest.mark.slow
def test_a_tab_closed_mid_reply_stops_its_reply_and_frees_its_cache(app, monkeypatch):
    url = app["url"]
    monkeypatch.setattr(app["live"], "idle_s", 0.5)  # a conversation no tab shows leaves memory after this
    tab = Client(url, verbose=False)
    heartbeat = open_heartbeat(url, tab.session_hash)
    job = tab.submit("Closing tab: tell me a long story", api_name="/send")
    streaming(job)
    session = session_of(app, "Closing tab: tell me a long story")
    assert session.cache.kv_bytes() > 0
    heartbeat.close()  # the tab is closed

    other = Client(url, verbose=False)
    started = time.monotonic()
    short_replies(other)  # queued behind the closed tab's 2000-token reply unless that one stopped
    assert texts(call(other, "Hi", api_name="/send")[2])[0] == ("user", "Hi")
    assert time.monotonic() - started < 10
    assert job.done()
    for _ in deadline(30):  # idle, and no tab shows it: its memory is released (ui/live.py)
        if session.cache.kv_bytes() == 0 and app["live"].get(session.id) is None:
            break
    assert len(session.ledger) == 0
    reply = session.history[-1]["content"]
    assert 0 < len(reply) < 2000 and store.load(app["data"], session.id)["messages"][-1]["content"] == reply
    # a tab that was only asleep comes back: its chat goes on, opened again into a fresh cache
    short_replies(tab)
    chat = texts(call(tab, "Still there?", api_name="/send")[2])
    assert chat[:2] == [("user", "Closing tab: tell me a long story"), ("assistant", reply)]
    back = app["live"].get(session.id)
    assert chat[2] == ("user", "Still there?") and back is not session and back.cache.kv_bytes() > 0


@pytest.mark.live
@pytest.mark.slow
def test_a_cancelled_call_stops_the_reply_and_the_app_goes_on(app):
    client = Client(app["url"], verbose=False)
    job = client.submit("Cancelled: tell me a long story", api_name="/send")
    streaming(job)
    job.cancel()
    session = session_of(app, "Cancelled: tell me a long story")
    time.sleep(0.5)
    length = len(session.history[-1]["content"])
    time.sleep(0.5)
    assert len(session.history[-1]["content"]) == length < 2000  # it stopped growing
    short_replies(client)
    chat = texts(call(client, "And now?", api_name="/send")[2])
    assert [c for c in chat if c[0] == "user"] == [("user", "Cancelled: tell me a long story"), ("user", "And now?")]


@pytest.mark.live
@pytest.mark.slow
def test_two_tabs_at_once_each_stop_only_their_own(app):
    # one reply at a time: the second tab's waits in the queue
    a, b = Client(app["url"], verbose=False), Client(app["url"], verbose=False)
    job_a = a.submit("Tab A speaking", api_name="/send")
    streaming(job_a)
    job_b = b.submit("Tab B speaking", api_name="/send")
    call(a, api_name="/stop")
    chat_a = job_a.result(timeout=15)[2]
    streaming(job_b)  # A's Stop did not stop B
    call(b, api_name="/stop")
    chat_b = job_b.result(timeout=15)[2]
    assert [r for r, _ in texts(chat_a)] == [r for r, _ in texts(chat_b)] == ["user", "assistant"]
    assert text_of(chat_a[0]) == "Tab A speaking" and text_of(chat_b[0]) == "Tab B speaking"
    for name, chat in (("A", chat_a), ("B", chat_b)):
        saved = store.load(app["data"], session_of(app, f"Tab {name} speaking").id)["messages"]
        assert [(m["role"], m["content"]) for m in saved] == texts(chat)


@pytest.mark.live
@pytest.mark.slow
def test_out_of_memory_in_the_app_ends_the_reply_with_a_message(app):
    client = Client(app["url"], verbose=False)
    short_replies(client)
    app["oom"].at_call(5, decode=True)  # five tokens stream, the fifth fails to go into the cache
    job = client.submit("Out of memory soon", api_name="/send")
    chat = texts(job.result(timeout=CALL_DEADLINE_S)[2])
    shown = warnings_of(job)
    assert any("out of memory" in w for w in shown), shown
    assert chat[0] == ("user", "Out of memory soon") and chat[1][0] == "assistant" and chat[1][1]
    assert session_of(app, "Out of memory soon").history[-1]["content"] == chat[1][1]  # what it showed, kept
    chat = texts(call(client, "Next one", api_name="/send")[2])
    assert chat[2] == ("user", "Next one") and chat[3][0] == "assistant"


@pytest.mark.live
@pytest.mark.slow
def test_out_of_memory_reading_a_message_keeps_it_in_the_box(app):
    client = Client(app["url"], verbose=False)
    short_replies(client)
    before = texts(call(client, "Hello", api_name="/send")[2])
    app["oom"].at_call(1)
    job = client.submit("A message too big for memory", api_name="/send")
    result = job.result(timeout=CALL_DEADLINE_S)
    shown = warnings_of(job)
    assert any("out of memory" in w for w in shown), shown
    assert result[0] == "A message too big for memory" and texts(result[2]) == before
    assert texts(call(client, "Smaller", api_name="/send")[2])[2] == ("user", "Smaller")


# ---------------------------------------------------------------------------------------------
# SIGKILL mid-reply, then a restart on the same data folder


def wait_until_up(url, proc, log, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"app.py exited:\n{log.read_text()[-2000:]}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"app.py did not start:\n{log.read_text()[-2000:]}")


@pytest.mark.live
@pytest.mark.slow
def test_sigkill_mid_reply_then_restart_restores_every_finished_turn(tmp_path):
    model_dir = save_tiny_chat(tmp_path / "model", never_ends=True)
    data, log, port = tmp_path / "data", tmp_path / "app.log", free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = subprocess.Popen([sys.executable, "app.py", "--model", str(model_dir), "--data-dir", str(data),
                             "--port", str(port), "--budget", "48", "--n-sink", "2"],
                            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        wait_until_up(url, proc, log)
        client = Client(url, verbose=False)
        short_replies(client)
        call(client, "First turn: a lighthouse.", api_name="/send")
        finished = texts(call(client, "Second turn: its keeper.", api_name="/send")[2])
        call(client, "", 0.7, 0.9, 2048, api_name="/sampling")  # a long third reply
        job = client.submit("Third turn: the storm.", api_name="/send")
        streaming(job)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        seen = texts(job.outputs()[-1][2])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert len(finished) == 4 and seen[:4] == finished and seen[4] == ("user", "Third turn: the storm.")

    # the restarted app (in-process: same code, same data folder; a second app.py start only costs time)
    restarted_model, restarted_tok = load_model(model_dir, device="cpu")
    with live_app(data, restarted_model, restarted_tok, cache=EVICTING) as (new_url, _):
        tab = Client(new_url, verbose=False)
        (session_id,) = [c[1] for c in call(tab, api_name="/saved_sessions")["choices"]]
        chat = texts(call(tab, session_id, api_name="/restore")[1])
        assert chat[:4] == finished  # every finished turn, word for word
        assert chat[4] == ("user", "Third turn: the storm.")  # and the message that was being answered
        if len(chat) > 5:  # a partial reply saved while it streamed: a prefix of the same reply
            partial, shown = chat[5][1], seen[5][1] if len(seen) > 5 else ""
            assert partial.startswith(shown) or shown.startswith(partial)
        short_replies(tab)
        action = "/continue" if len(chat) > 5 else "/regenerate"  # finish the interrupted reply
        chat = texts(call(tab, api_name=action)[1])
        assert chat[:4] == finished and chat[4] == ("user", "Third turn: the storm.") and chat[5][0] == "assistant"
        chat = texts(call(tab, "Fourth turn.", api_name="/send")[2])
        assert chat[:4] == finished and chat[6] == ("user", "Fourth turn.") and chat[7][0] == "assistant"
