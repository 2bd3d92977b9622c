"""The API's pool of live conversations (h2o_chat/serve/pool.py), without a server: the routes that use
it are driven in test_api.py."""

import threading
import time

import pytest

from h2o_chat import ChatSession
from h2o_chat.serve.pool import LENT_WAIT_S, SessionPool
from tests.conftest import make_tiny_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="sum", positions="rolling")


@pytest.mark.slow  # it waits LENT_WAIT_S (2 s) on purpose
def test_a_request_waits_briefly_for_the_busy_session_that_holds_its_history():
    model, tokenizer = make_tiny_chat()
    pool = SessionPool(lambda kind, cache, system: ChatSession(model, tokenizer, cache=cache, system_prompt=system),
                       max_kv_bytes=2**30)
    history = [{"role": "user", "content": "hello there", "pinned": False}]
    busy, _ = pool.acquire("chat", CACHE, None, history)
    busy.messages = [dict(m) for m in history]
    list(busy.regenerate())  # it has fed the history (and a reply) and is still lent
    threading.Timer(0.3, pool.release, args=(busy,)).start()
    start = time.monotonic()
    again, _ = pool.acquire("chat", CACHE, None, history)
    assert again is busy and 0.2 < time.monotonic() - start < LENT_WAIT_S
    other, _ = pool.acquire("chat", CACHE, None, history)  # lent again: after the wait, a new session
    assert other is not busy and len(pool) == 2


def test_the_page_can_list_every_live_session_with_its_client():
    model, tokenizer = make_tiny_chat()
    pool = SessionPool(lambda kind, cache, system: ChatSession(model, tokenizer, cache=cache, system_prompt=system),
                       max_kv_bytes=2**30)
    story = [{"role": "user", "content": "a story", "pinned": False}]
    first, _ = pool.acquire("chat", CACHE, None, story, client="SillyTavern")
    pool.release(first)
    second, _ = pool.acquire("chat", dict(CACHE, budget=32), None, story, client="OpenAI/Python")
    assert pool.watchable() == [(second, "OpenAI/Python"), (first, "SillyTavern")]  # most recent first
    pool.release(second)
