"""The Gradio app, driven through its API with gradio_client: a tiny model, a real server on
127.0.0.1, one session per client."""

import json
import socket
import threading
import time

import pytest
from gradio_client import Client

from h2o_chat.ui import CSS, build
from tests.conftest import make_tiny_chat

CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="sum", positions="rolling")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    model, tok = make_tiny_chat()
    demo = build(model, tok, CACHE, str(tmp_path_factory.mktemp("data")), concurrency=2)
    demo.queue(default_concurrency_limit=2)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def chat_of(result):
    return result[1]  # API outputs (the session state is not one): text box, chatbot, token map, stats, ...


def text_of(message):
    """Gradio 6 sends a message's content as a list of typed parts."""
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def test_a_message_streams_back_with_the_panel(app_url):
    client = Client(app_url, verbose=False)
    job = client.submit("Hello there", "all", "all", api_name="/send")
    updates = list(job)
    result = job.result()
    chat = chat_of(result)
    assert [m["role"] for m in chat] == ["user", "assistant"] and text_of(chat[0]) == "Hello there"
    assert len(updates) > 2  # streamed, not one final answer
    assert 'class="tok st-' in result[2] and "tokens seen" in result[3]


def test_stop_ends_the_reply_and_keeps_it(app_url):
    client = Client(app_url, verbose=False)
    client.predict("Hi", "all", "all", api_name="/send")  # creates this client's session
    job = client.submit("Tell me a very long story", "all", "all", api_name="/send")
    while len(job.outputs()) < 3:
        time.sleep(0.01)
    client.predict(api_name="/stop")
    started = time.perf_counter()
    result = job.result()
    assert time.perf_counter() - started < 5
    chat = chat_of(result)
    assert chat[-1]["role"] == "assistant" and len(chat) == 4


def test_two_clients_chat_at_once_without_seeing_each_other(app_url):
    results = {}

    def talk(name):
        client = Client(app_url, verbose=False)
        for text in (f"I am {name}.", f"Remember {name}?"):
            results[name] = client.predict(text, "all", "all", api_name="/send")

    threads = [threading.Thread(target=talk, args=(n,)) for n in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for me, other in (("alice", "bob"), ("bob", "alice")):
        chat = chat_of(results[me])
        assert [text_of(m) for m in chat if m["role"] == "user"] == [f"I am {me}.", f"Remember {me}?"]
        assert other not in results[me][2]  # nor in the token map


def test_changing_the_cache_replays_the_chat(app_url):
    client = Client(app_url, verbose=False)
    client.predict("Hello there", "all", "all", api_name="/send")
    result = client.predict("sink", 24, 8, 4, "sum", "rolling", "all", "all", api_name="/apply_cache")
    assert [text_of(m) for m in result[0] if m["role"] == "user"] == ["Hello there"]  # the chat survives
    assert "**24** slots per head" in result[2]
    bad = client.predict("h2o", 0, 8, 4, "sum", "rolling", "all", "all", api_name="/apply_cache")
    assert "**24** slots per head" in bad[2]  # an impossible budget changes nothing


def test_a_head_picked_while_a_reply_streams_is_what_the_panel_shows(app_url):
    client = Client(app_url, verbose=False)
    job = client.submit("Tell me a very long story", "all", "all", api_name="/send")
    while len(job.outputs()) < 3:
        time.sleep(0.01)
    client.predict("1", "0", api_name="/select")  # the tab's selectors change mid-reply
    result = job.result()
    assert "Layer 1, KV head 0: exactly the tokens this head keeps" in result[2]


def test_api_parameters_have_their_names(app_url):
    # a script driving the app through gradio_client sees what each argument is
    api = Client(app_url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
    names = {route: [p["parameter_name"] for p in api[route]["parameters"]] for route in api}
    assert names["/send"] == ["text", "layer", "head"]
    assert names["/edit"] == ["turn", "text", "layer", "head"]
    assert names["/pin"] == names["/unpin"] == ["turn", "layer", "head"]
    assert names["/restore"] == ["session_id", "layer", "head"]
    assert names["/undo"] == names["/new_chat"] == names["/regenerate"] == ["layer", "head"]
    assert names["/sampling"] == ["system_prompt", "temperature", "top_p", "max_new_tokens", "layer", "head"]


def test_every_chat_action_through_the_app(app_url, tmp_path):
    client = Client(app_url, verbose=False)
    chat = chat_of(client.predict("Once upon a time", "all", "all", api_name="/send"))
    first_reply = text_of(chat[1])

    chat = client.predict("all", "all", api_name="/continue")[0]
    assert len(chat) == 2 and text_of(chat[1]).startswith(first_reply)  # the same reply, longer or equal

    chat = client.predict("all", "all", api_name="/regenerate")[0]
    assert [m["role"] for m in chat] == ["user", "assistant"] and text_of(chat[0]) == "Once upon a time"

    chat = client.predict(0, "Twice upon a time", "all", "all", api_name="/edit")[0]
    assert text_of(chat[0]) == "Twice upon a time"

    view = client.predict(0, "all", "all", api_name="/pin")
    assert "st-pinned" in view[1]  # the pinned message shows as pinned in the token map
    view = client.predict(0, "all", "all", api_name="/unpin")
    assert "st-pinned" not in view[1]

    client.predict("You are terse.", 0, 0.9, 64, "all", "all", api_name="/sampling")
    chat = chat_of(client.predict("And then?", "all", "all", api_name="/send"))
    assert [text_of(m) for m in chat if m["role"] == "user"] == ["Twice upon a time", "And then?"]

    markdown, record = client.predict(api_name="/export")
    assert "And then?" in open(markdown, encoding="utf-8").read()
    session_id = json.loads(open(record, encoding="utf-8").read())["id"]

    chat = client.predict("all", "all", api_name="/undo")[0]
    assert [text_of(m) for m in chat if m["role"] == "user"] == ["Twice upon a time"]
    assert client.predict("all", "all", api_name="/new_chat")[0] == []

    client.predict(api_name="/saved_sessions")
    chat = client.predict(session_id, "all", "all", api_name="/restore")[0]
    assert [text_of(m) for m in chat if m["role"] == "user"] == ["Twice upon a time"]  # as autosaved after the undo
