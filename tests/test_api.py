"""The OpenAI-compatible API (`/v1` beside the UI), driven as clients drive it: the real `openai`
client against a live server on 127.0.0.1. The tiny random chat model (float64, so that the
exact comparisons never hinge on rounding) stands in where real text is not needed."""

import json
import logging
import re
import threading
import time
from contextlib import contextmanager

import gradio as gr
import httpx
import openai
import pytest
import torch

import app as app_main
import h2o_chat.models.load
from h2o_chat import ChatSession, Sampling
from h2o_chat.chat import store
from h2o_chat.chat.batch import Batcher
from h2o_chat.chat.limits import Limits
from h2o_chat.serve import api as api_module
from h2o_chat.serve.api import client_name, create_router
from h2o_chat.ui.page import CSS, build
from tests.conftest import make_tiny_chat
from tests.live import deadline, free_port, loading_server, never_ending

# every test here starts a server (the app, or app.py in a process)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.live, pytest.mark.slow]

KEY = "test-key-123"
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="sum", positions="rolling")
DEADLINE_S = 60  # every request of these tests finishes far sooner on the tiny model


@contextmanager
def api_server(data_dir, model=None, tokenizer=None, concurrency=2, **router_kwargs):
    """The UI and the API on one free port, as app.py mounts them; yields (base_url, router)."""
    if model is None:
        model, tokenizer = make_tiny_chat(torch.float64)
    batcher = Batcher(model, concurrency)  # as app.py shares one, for any concurrency
    demo = build(model, tokenizer, dict(CACHE), str(data_dir), concurrency=concurrency, batcher=batcher)
    demo.queue(default_concurrency_limit=concurrency)
    router = create_router(model, tokenizer, dict(CACHE), str(data_dir), concurrency=concurrency, batcher=batcher,
                           **router_kwargs)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, css=CSS,
                show_error=True, app_kwargs={"routes": router.routes})
    try:
        yield f"http://127.0.0.1:{port}", router
    finally:
        demo.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("api-data")
    with api_server(data, api_key=KEY) as (url, router):
        yield {"url": url, "router": router, "data": data}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="h2o-chat", messages=messages, **kwargs)


def streamed(client, messages, **kwargs):
    """(text, finish_reason, usage) of a streamed reply."""
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="h2o-chat", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def cached(reply):
    return reply.usage.prompt_tokens_details.cached_tokens


# ---------------------------------------------------------------------------------------------
# The routes


@pytest.mark.parametrize("headers, name", [
    ({"X-Title": "SillyTavern", "User-Agent": "node"}, "SillyTavern"),  # OpenRouter's convention
    ({"User-Agent": "Mozilla/5.0 SillyTavern/1.12.0"}, "SillyTavern"),
    ({"User-Agent": "node", "Referer": "http://127.0.0.1:8000/open-webui/"}, "Open WebUI"),
    ({"User-Agent": "OpenAI/Python 1.99.0"}, "OpenAI/Python"),
    ({}, None),
])
def test_a_request_names_its_client_for_the_page(headers, name):
    assert client_name(httpx.Headers(headers)) == name


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["h2o-chat"]
    assert client.models.retrieve("h2o-chat").id == "h2o-chat"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    key = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server["url"] + "/health", headers=key).json() == {"status": "ok", "model": "h2o-chat"}
    assert httpx.get(server["url"] + "/health").status_code == 401  # with a key, nothing answers without it
    assert httpx.get(server["url"] + "/config").status_code == 200  # the UI is still there, on the same port


def test_streamed_and_whole_replies_are_the_same(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    whole = chat(client, messages, max_tokens=16, temperature=0.8, seed=3)
    text, finish, usage = streamed(client, messages, max_tokens=16, temperature=0.8, seed=3)
    assert text == whole.choices[0].message.content and len(text) > 0
    assert finish == whole.choices[0].finish_reason
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens > 0
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"


def test_the_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": "h2o-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, timeout=DEADLINE_S,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1


def test_content_as_text_parts_is_the_same_as_text(client):
    text = [{"role": "user", "content": "Say something about parts."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say something "},
                                          {"type": "text", "text": "about parts."}]}]
    assert chat(client, text).choices[0].message.content == chat(client, parts).choices[0].message.content


def test_unknown_fields_are_ignored_and_unsupported_ones_refused_unless_default(client):
    reply = chat(client, [{"role": "user", "content": "hello"}],
                 extra_body={"mirostat": 0, "typical_p": 1, "user_name": "x", "no_such_field": [1]}, user="someone")
    assert reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="mirostat is not supported"):
        chat(client, [{"role": "user", "content": "hello"}], extra_body={"mirostat": 2})


# ---------------------------------------------------------------------------------------------
# Conversation reuse


def test_a_growing_chat_is_served_from_the_cache(client):
    """Each turn computes only its new message: every token of the previous prompt and reply is
    cached; the replies are those of a fresh session that reads the whole history at once."""
    model, tokenizer = make_tiny_chat(torch.float64)
    messages = [{"role": "system", "content": "A growing chat."}]
    previous = None
    for turn in range(5):
        messages.append({"role": "user", "content": f"This is message number {turn}, tell me more."})
        reply = chat(client, messages, max_tokens=10, extra_body={"h2o": {"policy": "full"}})
        text = reply.choices[0].message.content
        if previous is not None:
            assert cached(reply) == previous.usage.prompt_tokens + previous.usage.completion_tokens
        if turn >= 2:
            assert cached(reply) > 0.6 * reply.usage.prompt_tokens  # most of it
        fresh = ChatSession(model, tokenizer, cache={"policy": "full"}, system_prompt=messages[0]["content"],
                            temperature=0, max_new_tokens=10)
        fresh.messages = [dict(m, pinned=False) for m in messages[1:-1]]
        assert "".join(fresh.send(messages[-1]["content"])) == text
        messages.append({"role": "assistant", "content": text})
        previous = reply


def test_a_regenerate_is_served_from_the_cache(client):
    messages = [{"role": "user", "content": "Tell me a story about a regenerate."}]
    first = chat(client, messages, temperature=1.0, seed=11)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    reply = chat(client, messages, temperature=1.0, seed=5)
    swipe = chat(client, messages, temperature=1.0, seed=6)  # the same history again, another draw
    again = chat(client, messages, temperature=1.0, seed=5)
    assert cached(swipe) == cached(again) == reply.usage.prompt_tokens  # nothing recomputed
    assert again.choices[0].message.content == reply.choices[0].message.content  # the same state as the first time
    assert swipe.choices[0].message.content != reply.choices[0].message.content


def test_an_edited_reply_goes_back_to_what_still_agrees(client):
    """The user edits the bot's last reply (SillyTavern's edit) and writes on: the prompt up to
    that reply is still cached."""
    messages = [{"role": "user", "content": "First message of the edit test."}]
    one = chat(client, messages)
    messages += [{"role": "assistant", "content": "An edited reply."}, {"role": "user", "content": "Go on."}]
    edited = chat(client, messages)
    assert cached(edited) == one.usage.prompt_tokens < edited.usage.prompt_tokens


def test_an_edited_message_goes_back_to_the_reply_before_it(client):
    messages = [{"role": "user", "content": "First message of the message-edit test."}]
    one = chat(client, messages)
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "Second message."}]
    chat(client, messages)
    messages[-1] = {"role": "user", "content": "Second message, edited."}
    edited = chat(client, messages)
    assert cached(edited) >= one.usage.prompt_tokens + one.usage.completion_tokens


def test_two_conversations_interleaved_keep_their_caches(client):
    convs = {name: [{"role": "system", "content": f"Conversation {name}."}] for name in "AB"}
    last = {}
    for turn in range(3):
        for name, messages in convs.items():
            messages.append({"role": "user", "content": f"{name} says hello for the {turn}th time."})
            reply = chat(client, messages)
            if name in last:
                assert cached(reply) == last[name].usage.prompt_tokens + last[name].usage.completion_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            last[name] = reply


def test_past_the_memory_bound_the_least_recently_used_conversation_is_dropped(tmp_path):
    """Each tiny-model conversation holds 0.1875 MiB (its full 48-slot cache and three snapshots):
    two fit in 0.5 MiB, a third drops the one used longest ago, which comes back from its saved cache."""
    with api_server(tmp_path, max_kv_mib=0.5) as (url, router):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        convs = {name: [{"role": "user", "content": f"Conversation {name} starts with a long enough message."}]
                 for name in "ABC"}
        for messages in convs.values():
            messages.append({"role": "assistant", "content": chat(client, messages).choices[0].message.content})
            messages.append({"role": "user", "content": "And then?"})
        assert len(router.pool) == 2 and router.pool.kv_bytes() <= 0.5 * 2**20
        assert cached(chat(client, convs["C"])) > 0 and cached(chat(client, convs["B"])) > 0  # kept
        assert all(s.history[0] != convs["A"][0] for s, _ in router.pool.live())  # dropped from memory ...
        assert cached(chat(client, convs["A"])) > 0  # ... and back from disk: its saved cache, not a replay


def test_text_completion_reuses_the_growing_prompt(client):
    prompt = "<|im_start|>user\nContinue this text please.<|im_end|>\n<|im_start|>assistant\n"
    first = client.completions.create(model="h2o-chat", prompt=prompt, max_tokens=8, temperature=0)
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    # the client's own template: each special token in the prompt is one token, as written
    assert first.usage.prompt_tokens == len(prompt) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3
    prompt += first.choices[0].text + "<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"
    second = client.completions.create(model="h2o-chat", prompt=prompt, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 8
    pieces = client.completions.create(model="h2o-chat", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == second.choices[0].text


def test_cache_settings_and_pins_per_request(server, client):
    messages = [{"role": "user", "content": "Remember this message."}, {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Which cache holds this?"}]
    chat(client, messages, extra_body={"h2o": {"policy": "window", "budget": 60, "n_sink": 2, "pinned": [0]}})
    session = next(s for s, _ in reversed(server["router"].pool.live()) if s.messages[-1].content and
                   s.messages[0].content == "Remember this message.")
    assert session.cache_config.policy == "window" and session.cache_config.budget == 60
    assert session.messages[0].pinned and not session.messages[2].pinned
    assert session.cache.pins  # the pinned message's tokens are held


def test_api_conversations_are_saved_where_the_ui_lists_them(server, client):
    messages = [{"role": "user", "content": "Save me in the list, please."}]
    reply = chat(client, messages)
    records = [store.load(server["data"], i) for i in store.list_ids(server["data"])]
    saved = [r for r in records if r["messages"] and r["messages"][0]["content"] == messages[0]["content"]]
    assert saved and saved[0]["messages"][1] == {"role": "assistant", "content": reply.choices[0].message.content,
                                                 "pinned": False}


# ---------------------------------------------------------------------------------------------
# Stop strings


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_end_the_reply_before_them(client, stream):
    messages = [{"role": "user", "content": "Say something long for the stop test."}]
    full = chat(client, messages, max_tokens=30).choices[0].message.content
    stop = full[8:10]
    expected = full[:full.find(stop)]
    if stream:
        text, finish, _ = streamed(client, messages, max_tokens=30, stop=[stop, "never-said"])
    else:
        reply = chat(client, messages, max_tokens=30, stop=stop)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text == expected and stop not in text and finish == "stop"


# ---------------------------------------------------------------------------------------------
# No max_tokens: until the model stops, or the machine's bound


@pytest.mark.parametrize("route", ["chat", "completions", "native"])
def test_without_max_tokens_a_reply_runs_past_256_to_the_machines_bound(server, monkeypatch, route):
    """OpenAI, llama.cpp (n_predict -1) and Open WebUI's requests give no max_tokens: the reply
    runs until the model stops, not to Sampling's 256 (the page's default). ignore_eos keeps the
    tiny model going: it stops at what the machine can hold (made small here), said "length"."""
    monkeypatch.setattr(Limits, "max_new_tokens", lambda self, cache: 330)
    bound = int(330 * api_module.MACHINE_SHARE)
    auth = {"Authorization": f"Bearer {KEY}"}
    if route == "native":
        body = {"prompt": "<|im_start|>user\nGo on and on.<|im_end|>\n<|im_start|>assistant\n", "n_predict": -1,
                "ignore_eos": True, "temperature": 0}
        reply = httpx.post(server["url"] + "/completion", json=body, headers=auth, timeout=DEADLINE_S).json()
        assert reply["tokens_predicted"] == bound > 256 and reply["stop_type"] == "limit"
        return
    if route == "chat":
        body = {"messages": [{"role": "user", "content": "Go on and on."}], "ignore_eos": True, "temperature": 0}
    else:
        body = {"prompt": "Go on and on.", "ignore_eos": True, "temperature": 0}
    reply = httpx.post(f"{server['url']}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, headers=auth,
                       timeout=DEADLINE_S).json()
    assert reply["usage"]["completion_tokens"] == bound > 256 and reply["choices"][0]["finish_reason"] == "length"
    if route == "chat":  # the bound was this request's: the saved conversation keeps the page's default
        session = next(s for s, _ in server["router"].pool.live() if s.messages[0].content == "Go on and on.")
        assert session.sampling.max_new_tokens == Sampling().max_new_tokens
        saved = store.load(server["data"], session.id)
        assert saved["sampling"]["max_new_tokens"] == Sampling().max_new_tokens


def test_without_max_tokens_a_reply_stops_at_the_models_trained_context(server, monkeypatch):
    """With memory to spare, the bound is the model's trained context (the tiny model's 512
    positions): one reply longer than any text it was trained on is a loop, not a reply."""
    monkeypatch.setattr(Limits, "max_new_tokens", lambda self, cache: 10**9)
    trained = make_tiny_chat()[0].config.max_position_embeddings
    body = {"messages": [{"role": "user", "content": "Never stop."}], "ignore_eos": True, "temperature": 0}
    reply = httpx.post(f"{server['url']}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=DEADLINE_S).json()
    assert reply["usage"]["completion_tokens"] == trained and reply["choices"][0]["finish_reason"] == "length"


def test_a_reply_without_max_tokens_that_the_model_ends_says_stop(client):
    """A small bias towards <|im_end|> makes the random model end this reply after a few tokens."""
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    bias = {str(make_tiny_chat()[1].convert_tokens_to_ids("<|im_end|>")): 0.15}
    bounded = chat(client, messages, max_tokens=400, logit_bias=bias)
    free = client.chat.completions.create(model="h2o-chat", messages=messages, temperature=0, logit_bias=bias)
    assert free.choices[0].message.content == bounded.choices[0].message.content
    assert free.choices[0].finish_reason == bounded.choices[0].finish_reason == "stop"  # the model ended it
    assert 0 < free.usage.completion_tokens < 400


# ---------------------------------------------------------------------------------------------
# One log line per request


LINE = re.compile(r"(?P<route>\S+ \S+) (?P<status>\d+) · (?P<client>[^·]+) · prompt (?P<prompt>[\d,]+) "
                  r"\((?P<cached>[\d,]+) cached\) · (?P<new>[\d,]+) new · TTFT (?P<ttft>[\d.]+) s · "
                  r"(?P<rate>[\d.]+) tokens/s · (?P<seconds>[\d.]+) s")


def logged_lines(caplog, count):
    """The request log's lines, once there are `count` (a stream's is written as it closes)."""
    for _ in deadline(10):
        lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat.requests"]
        if len(lines) >= count:
            return lines


def numbers(match):
    return {k: int(match[k].replace(",", "")) for k in ("status", "prompt", "cached", "new")}


def test_every_request_writes_one_line_with_its_tokens_and_speed(client, caplog):
    messages = [{"role": "user", "content": "Log me, please."}]
    with caplog.at_level(logging.INFO, logger="h2o_chat.requests"):
        whole = chat(client, messages, max_tokens=12)
        text, _, usage = streamed(client, messages + [{"role": "assistant", "content": whole.choices[0].message.content},
                                                      {"role": "user", "content": "More."}], max_tokens=9)
        with pytest.raises(openai.BadRequestError):
            chat(client, [{"role": "wizard", "content": "hi"}])
        lines = logged_lines(caplog, 3)
    assert len(lines) == 3
    first, second = LINE.fullmatch(lines[0]), LINE.fullmatch(lines[1])
    assert first and second, lines
    assert first["route"] == second["route"] == "POST /v1/chat/completions" and first["client"] == "OpenAI/Python"
    assert numbers(first) == {"status": 200, "prompt": whole.usage.prompt_tokens, "cached": cached(whole),
                              "new": 12}
    assert numbers(second) == {"status": 200, "prompt": usage.prompt_tokens,
                               "cached": usage.prompt_tokens_details.cached_tokens, "new": 9}
    assert numbers(second)["cached"] > 0
    for match in (first, second):
        assert 0 < float(match["ttft"]) <= float(match["seconds"]) and float(match["rate"]) > 0
    assert lines[2].startswith("POST /v1/chat/completions 400 · OpenAI/Python · ")
    assert lines[2].endswith("messages[0]: unknown role 'wizard'; the roles are system, developer, user, assistant, "
                             "tool, function")


def test_a_client_that_leaves_is_logged_with_how_far_it_got(tmp_path, caplog):
    model, tokenizer = never_ending(*make_tiny_chat(torch.float64))
    with api_server(tmp_path, model, tokenizer, concurrency=1) as (url, router), \
            caplog.at_level(logging.INFO, logger="h2o_chat.requests"):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        stream = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "go on"}],
                                                max_tokens=100_000, stream=True)
        for _ in range(5):
            next(stream)
        stream.close()
        (line,) = logged_lines(caplog, 1)
    assert line.startswith("POST /v1/chat/completions 200 · OpenAI/Python · prompt ")
    assert re.search(r"· the client left after [\d,]+ tokens$", line), line


# ---------------------------------------------------------------------------------------------
# Bad input, keys, models


# one of each kind: every check of a body is a plain call in test_bad_input.py (read_chat_request)
@pytest.mark.parametrize("body, says", [
    pytest.param({"messages": []}, "non-empty", id="empty-messages"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                 "only text parts", id="image"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens", id="negative-max"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "h2o": {"budget": -1}}, "budget", id="bad-budget"),
])
def test_bad_bodies_get_400_with_a_message(client, body, says):
    body = dict(body)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="h2o-chat", messages=body.pop("messages"), extra_body=body)
    assert says in raised.value.body["message"]
    assert raised.value.status_code == 400 and raised.value.body["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_gets_400(server):
    response = httpx.post(server["url"] + "/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_a_wrong_or_missing_key_gets_401(server):
    wrong = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0, timeout=DEADLINE_S)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(wrong, [{"role": "user", "content": "hi"}])
    for path in ("/v1/models", "/v1/anything"):
        response = httpx.get(server["url"] + path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_an_unknown_model_or_route_gets_404(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    response = httpx.get(server["url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404 and "error" in response.json()


def test_while_the_model_loads_the_api_answers_503(tmp_path):
    with loading_server(CACHE) as url:
        assert httpx.get(url + "/health").status_code == 503
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=DEADLINE_S)
        with pytest.raises(openai.InternalServerError, match="loading"):
            chat(client, [{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------
# Concurrency and disconnects


def test_concurrent_requests_never_mix_their_text(client):
    """Four conversations at once (two generate in parallel): each gets exactly the reply it
    gets alone."""
    convs = [[{"role": "system", "content": f"Speaker {i}."}, {"role": "user", "content": f"Tell me about {word}."}]
             for i, word in enumerate(["apples", "rivers", "engines", "clocks"])]
    together = [None] * len(convs)

    def ask(i):
        together[i] = chat(client, convs[i], max_tokens=40, temperature=1.0, seed=i).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(convs))]
    for t in threads:
        t.start()
    end = time.monotonic() + DEADLINE_S
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request never finished"
    alone = [chat(client, c, max_tokens=40, temperature=1.0, seed=i).choices[0].message.content
             for i, c in enumerate(convs)]
    assert together == alone and len(set(alone)) == len(alone)


def test_a_client_that_disconnects_mid_stream_frees_the_generator(tmp_path):
    model, tokenizer = never_ending(*make_tiny_chat(torch.float64))
    with api_server(tmp_path, model, tokenizer, concurrency=1) as (url, router):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        stream = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "go on"}],
                                                max_tokens=1_000_000, stream=True)
        pieces = [next(stream).choices[0].delta.content for _ in range(4)]
        assert len("".join(pieces)) > 0
        stream.close()  # the client goes away mid-reply (a million tokens would take many minutes)
        start = time.perf_counter()
        reply = chat(client, [{"role": "user", "content": "next one"}], max_tokens=3)  # one worker: it waits
        assert reply.usage.completion_tokens == 3 and time.perf_counter() - start < 10
        deadline = time.monotonic() + 10
        while any(lent for _, lent in router.pool.live()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(lent for _, lent in router.pool.live())
        first = next(s for s, _ in router.pool.live() if s.messages[0].content == "go on")
        assert 0 < first.last_turn.new_tokens < 100_000  # it stopped, far before its max_tokens

        # stop, then swipe at once (SillyTavern): the swipe waits for the stopping reply's cache
        stream = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "go on"}],
                                                max_tokens=1_000_000, stream=True)
        next(stream)
        stream.close()
        swipe = chat(client, [{"role": "user", "content": "go on"}], max_tokens=3)
        assert cached(swipe) == swipe.usage.prompt_tokens


def test_clients_decoded_in_one_batch_get_what_each_gets_alone_and_a_disconnect_stops_only_its_own(tmp_path):
    """--concurrency 3: three streaming clients share the batched decode steps. One goes away
    mid-reply; the other two still get exactly the reply each gets alone."""
    model, tokenizer = never_ending(*make_tiny_chat(torch.float64))
    with api_server(tmp_path, model, tokenizer, concurrency=3) as (url, router):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        convs = [[{"role": "user", "content": f"Tell me about {word}."}] for word in ("apples", "rivers")]
        alone = [streamed(client, c, max_tokens=60)[0] for c in convs]
        batcher = router.batcher
        steps_before = batcher.steps
        leaving = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "go on"}],
                                                 max_tokens=1_000_000, stream=True)
        next(leaving)
        together = [None, None]

        def ask(i):
            together[i] = streamed(client, convs[i], max_tokens=60)[0]

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + DEADLINE_S
        while batcher.largest_batch < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        leaving.close()  # the first client goes away while the others stream beside it
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads)
        assert together == alone
        assert batcher.largest_batch == 3 and batcher.rows_stepped - steps_before > batcher.steps - steps_before
        deadline = time.monotonic() + 10
        while batcher.batch_size and time.monotonic() < deadline:
            time.sleep(0.05)
        assert batcher.batch_size == 0  # every reply has ended: no rows are held


# ---------------------------------------------------------------------------------------------
# app.py


@pytest.fixture
def app_server(monkeypatch, tmp_path):
    """app.main with the tiny chat model, really serving (the test's own thread keeps going)."""
    demos = []

    def run(argv):
        original_launch = gr.Blocks.launch

        def launch(demo, **kwargs):
            demos.append(demo)
            original_launch(demo, **kwargs, prevent_thread_lock=True, quiet=True)

        monkeypatch.setattr(gr.Blocks, "launch", launch)
        monkeypatch.setattr(h2o_chat.models.load, "load_model", lambda spec, **kwargs: make_tiny_chat())
        port = free_port()
        app_main.main(argv + ["--port", str(port), "--data-dir", str(tmp_path)])
        return f"http://127.0.0.1:{port}"

    yield run
    for demo in demos:
        demo.close()


def test_app_serves_the_api_open_on_localhost_by_default(app_server):
    url = app_server([])
    client = openai.OpenAI(base_url=url + "/v1", api_key="anything", max_retries=0, timeout=DEADLINE_S)
    assert chat(client, [{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2


def test_app_api_key_from_the_flag_or_the_environment(app_server, monkeypatch):
    monkeypatch.setenv("H2O_CHAT_API_KEY", "from-env")
    url = app_server([])
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert app_main.parse_args(["--api-key", "flag"]).api_key == "flag"


def test_with_a_ui_login_the_api_is_never_open(app_server):
    url = app_server(["--auth", "alice:s3cret"])
    response = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 401 and "--api-key" in response.json()["error"]["message"]
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer alice:s3cret"}).status_code == 401


def test_with_a_ui_login_and_a_key_the_key_opens_the_api(app_server):
    url = app_server(["--auth", "alice:s3cret", "--api-key", "k2"])
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert httpx.get(url + "/config").status_code == 401  # the UI keeps its login


# ---------------------------------------------------------------------------------------------
# The bench that compares the API with llama.cpp's server (its h2o arm, on the tiny model)


def test_bench_api_drives_a_chat_through_app_py(tmp_path):
    from h2o_chat.bench import api as bench_api
    from tests.live import save_tiny_chat

    folder = save_tiny_chat(tmp_path / "tiny")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"turns": ["First question?", "Second one?"]}) + "\n"
                         + json.dumps({"turns": ["Third?", "Fourth?"]}) + "\n")
    bench_api.main(["--arms", "h2o", "--turns", "3", "--max-tokens", "4", "--data", str(questions),
                    "--h2o-args", f"--model {folder} --budget 48 --n-sink 2 --n-recent 16", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "api_vs_llamacpp.json").read_text())["arms"]["h2o"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and not any("error" in r for r in rows)
    assert rows[0]["cached_tokens"] == 0
    for before, after in zip(rows, rows[1:]):  # every earlier prompt and reply is served from the cache
        assert after["cached_tokens"] == before["prompt_tokens"] + before["completion_tokens"]
    assert (tmp_path / "api_vs_llamacpp.md").read_text().startswith("Command: `python -m h2o_chat.bench.api")


def test_bench_concurrent_runs_chats_together_and_one_at_a_time(tmp_path):
    from h2o_chat.bench import cli
    from tests.live import save_tiny_chat

    folder = save_tiny_chat(tmp_path / "tiny")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"turns": [f"Question {i}?", "And then?"]}) + "\n" for i in range(3)))
    cli.main(["--model", str(folder), "--out", str(tmp_path), "concurrent", "--sizes", "1,3", "--turns", "2",
              "--max-tokens", "6", "--turns-file", str(questions), "--budget", "48", "--repeats", "2",
              "--h2o-args=--n-sink 2 --n-recent 16"])
    results = json.loads((tmp_path / "concurrent.json").read_text())["sizes"]
    assert list(results) == ["1", "3"]
    for row in results.values():
        for arm in ("together", "one_at_a_time"):
            assert row[arm]["tokens"] > 0 and row[arm]["aggregate_tok_s"] > 0 and row[arm]["runs"] == 2
        assert row["same_replies"]  # greedy, float32 on the tiny model: batched or not, the same text
    assert len(results["3"]["together_texts"]) == 3
