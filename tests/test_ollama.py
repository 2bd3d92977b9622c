"""Ollama's API (`/api/*` beside `/v1`, serve/ollama.py), driven by the official `ollama` Python
client against a live server on 127.0.0.1, as Open WebUI's Ollama connection and Ollama's tools
use it. The tiny random chat model (float64, and made never to end its turn, so every reply runs
to its num_predict) stands in where real text is not needed; one test runs the embedded model.

Where the official client has no call (`/api/version`) or drops a field it does not know
(`prompt_eval_cached_count`), the test uses the client's own HTTP connection (`client._client`:
its base URL and headers)."""

import json
import logging
import time
from datetime import datetime

import httpx
import ollama
import openai
import pytest
import torch

from h2o_chat.chat import limits as limits_mod
from h2o_chat.serve.api import MACHINE_SHARE
from h2o_chat.serve.ollama import OLLAMA_VERSION, parameter_count
from tests.conftest import make_tiny_chat, make_tiny_llama
from tests.live import deadline, never_ending
from tests.test_api import CACHE, LINE, api_server, logged_lines, numbers

KEY = "ollama-key"
DEADLINE_S = 60  # every request here finishes far sooner on the tiny model
MODEL = "h2o-chat"  # the served id (the folder-less tiny model's); Ollama's clients see MODEL:latest
HELLO = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tokenizer = never_ending(*make_tiny_chat(torch.float64))
    with api_server(tmp_path_factory.mktemp("ollama"), model, tokenizer, concurrency=2, api_key=KEY) as (url, router):
        yield {"url": url, "router": router, "model": model, "tokenizer": tokenizer}


@pytest.fixture
def client(server):
    return ollama.Client(host=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=DEADLINE_S)


def greedy(n):
    return {"temperature": 0, "num_predict": n}


def raw_chat(client, **body):
    """/api/chat's whole answer as JSON, through the official client's own connection."""
    response = client._client.post("/api/chat", json={"model": MODEL, "stream": False, **body})
    assert response.status_code == 200, response.text
    return response.json()


def refusal(call):
    """(status, sentence) of an ollama.ResponseError."""
    with pytest.raises(ollama.ResponseError) as e:
        call()
    return e.value.status_code, e.value.error


# ---------------------------------------------------------------------------------------------
# What the listings say of the model (no server)


def test_parameter_count_reads_shapes_so_packed_weights_count_as_the_float_ones():
    from h2o_chat.models.quantize import quantize_linears

    model = make_tiny_llama()
    floats = sum(p.numel() for p in model.parameters())
    assert parameter_count(model) == floats
    quantize_linears(model, "int4")  # packed 4-bit codes: their storage is no count of weights
    assert parameter_count(model) == floats


# ---------------------------------------------------------------------------------------------
# The model: list, show, ps, version


@pytest.mark.live
@pytest.mark.slow
def test_list_show_ps_and_version_describe_the_served_model(server, client):
    model, tokenizer = server["model"], server["tokenizer"]
    listed = client.list().models
    assert [m.model for m in listed] == [f"{MODEL}:latest"]
    tag = listed[0]
    assert tag.details.family == "llama" and tag.details.format == "safetensors"
    assert tag.size == sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())  # the weights as they sit in memory
    assert tag.details.parameter_size == f"{sum(p.numel() for p in model.parameters()) / 1e3:.0f}K"
    assert len(tag.digest) == 64

    for name in (MODEL, f"{MODEL}:latest"):
        shown = client.show(name)
        assert shown.template == tokenizer.chat_template  # the tokenizer's own (Jinja) template
        assert shown.details == tag.details and shown.capabilities == ["completion"]
        info, config = shown.modelinfo, model.config
        assert info["general.architecture"] == "llama"
        assert info["general.parameter_count"] == sum(p.numel() for p in model.parameters())
        assert (info["llama.block_count"], info["llama.attention.head_count_kv"], info["llama.vocab_size"]) == \
            (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size)
        assert "temperature                    0.7" in shown.parameters  # Sampling's default: what options override
        assert 'stop                           "<|im_end|>"' in shown.parameters
        assert f"PARAMETER {shown.parameters.splitlines()[0]}" in shown.modelfile

    running = client.ps().models
    assert [(m.name, m.model, m.size, m.digest) for m in running] == [(tag.model, tag.model, tag.size, tag.digest)]
    assert running[0].size_vram == 0 and running[0].expires_at.year == 2318  # on the CPU; never unloaded
    assert running[0].context_length == server["router"].api.max_prompt_tokens

    version = client._client.get("/api/version").json()["version"]
    assert version == OLLAMA_VERSION and tuple(map(int, version.split("."))) >= (0, 5, 0)
    for route in ("/api/version", "/api/tags", "/api/ps"):  # the checks clients make before a request
        assert client._client.head(route).status_code == 200


@pytest.mark.live
@pytest.mark.slow
def test_what_open_webui_asks_it_can_read(server):
    """Open WebUI's Ollama connection (backend/open_webui/routers/ollama.py): the tags keyed by
    `model` with `name` beside it; ps's expires_at read by datetime.fromisoformat; the version
    compared as a tuple of ints; then /api/chat with its converted body (tools attached, options,
    keep_alive, the model named with ":latest"), streamed as NDJSON."""
    headers = {"Authorization": f"Bearer {KEY}", "User-Agent": "Python/3.11 aiohttp/3.12.15"}
    url = server["url"]
    tags = httpx.get(url + "/api/tags", headers=headers).json()["models"]
    assert {m["model"]: m["name"] for m in tags} == {f"{MODEL}:latest": f"{MODEL}:latest"}
    loaded = httpx.get(url + "/api/ps", headers=headers).json()["models"]
    assert int(datetime.fromisoformat(loaded[0]["expires_at"]).timestamp()) > time.time()
    version = httpx.get(url + "/api/version", headers=headers).json()["version"]
    assert all(part.isdigit() for part in version.split("."))

    body = {"model": f"{MODEL}:latest", "stream": True, "keep_alive": "5m",
            "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi!"}],
            "options": {"temperature": 0.8, "num_ctx": 2048, "num_predict": 12, "stop": ["\n\n\n"]},
            "tools": [{"type": "function", "function": {"name": "get_current_timestamp", "description": "Now.",
                                                        "parameters": {"type": "object", "properties": {}}}}]}
    with httpx.stream("POST", url + "/api/chat", json=body, headers=headers, timeout=DEADLINE_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        assert "1 tools" in response.headers["X-H2O-Tools-Ignored"]  # answered, and told: without tools
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"] is True
    assert "".join(x["message"]["content"] for x in lines) and lines[-1]["eval_count"] == 12


# ---------------------------------------------------------------------------------------------
# Replies: chat and generate, streamed and whole


@pytest.mark.live
@pytest.mark.slow
def test_chat_streamed_and_whole_are_the_same_reply(client):
    options = {"temperature": 0.9, "seed": 11, "num_predict": 16}
    whole = client.chat(model=MODEL, messages=HELLO, options=options)
    parts = list(client.chat(model=MODEL, messages=HELLO, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content and whole.message.content
    assert all(p.done is False and p.message.role == "assistant" for p in parts[:-1])
    last = parts[-1]
    assert last.done and last.message.content == "" and last.done_reason == whole.done_reason == "length"
    for reply in (whole, last):
        assert reply.eval_count == 16 and reply.prompt_eval_count == whole.prompt_eval_count > 0
        spans = (reply.load_duration, reply.prompt_eval_duration, reply.eval_duration)
        assert all(isinstance(s, int) and s >= 0 for s in spans) and reply.eval_duration > 0
        assert reply.total_duration >= sum(spans)  # the three are parts of the request's time, in nanoseconds


@pytest.mark.live
@pytest.mark.slow
def test_generate_streamed_whole_raw_and_with_a_system_prompt(client):
    options = greedy(10)
    whole = client.generate(model=MODEL, prompt="Once upon a time", options=options)
    parts = list(client.generate(model=MODEL, prompt="Once upon a time", options=options, stream=True))
    assert "".join(p.response for p in parts) == whole.response and len(whole.response) > 0
    assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 10
    assert whole.context is None  # Ollama's deprecated token context is not sent (see the refusals)

    # a prompt is one user turn in the model's template; system is its system prompt
    as_chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], options=options)
    assert whole.response == as_chat.message.content
    with_system = client.generate(model=MODEL, prompt="Once upon a time", system="Be brief.", options=options)
    chat_system = client.chat(model=MODEL, options=options, messages=[{"role": "system", "content": "Be brief."},
                                                                      {"role": "user", "content": "Once upon a time"}])
    assert with_system.response == chat_system.message.content

    # raw: the prompt fed exactly as written, as /v1/completions does
    prompt = "<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n"
    raw = client.generate(model=MODEL, prompt=prompt, raw=True, options=options)
    assert raw.response == whole.response and raw.prompt_eval_count == whole.prompt_eval_count


@pytest.mark.live
@pytest.mark.slow
def test_temperature_zero_is_v1s_greedy_reply(server, client):
    messages = [{"role": "user", "content": "Compare the two APIs."}]
    v1 = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)
    reply = v1.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    ours = client.chat(model=MODEL, messages=messages, options=greedy(24))
    assert ours.message.content == reply.choices[0].message.content
    assert (ours.prompt_eval_count, ours.eval_count) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)


# ---------------------------------------------------------------------------------------------
# Options


@pytest.mark.live
@pytest.mark.slow
def test_num_predict_is_the_exact_number_of_tokens(client):
    for n in (1, 7, 33):
        reply = client.chat(model=MODEL, messages=HELLO, options={"num_predict": n, "seed": 1})
        assert reply.eval_count == n and reply.done_reason == "length"
        streamed = [p for p in client.generate(model=MODEL, prompt="Count.", options=greedy(n), stream=True)]
        assert streamed[-1].eval_count == n


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("num_predict", [None, -1, -2])
def test_without_num_predict_a_reply_runs_to_the_machines_bound_not_256(client, monkeypatch, num_predict):
    """Ollama's -1 (and -2, and no num_predict): until the model stops. This model never does, so
    the bound shows: the tokens this machine has memory for (chat.limits), here a machine
    with 800 KiB free (half usable, 1 KiB a token: 400), of which MACHINE_SHARE (as /v1)."""
    free = 800 * 1024
    monkeypatch.setattr(limits_mod, "free_bytes", lambda device: free)
    expected = int(int(free * limits_mod.USABLE_SHARE) // limits_mod.APP_BYTES_PER_TOKEN * MACHINE_SHARE)
    options = {"temperature": 0} if num_predict is None else {"temperature": 0, "num_predict": num_predict}
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Go on forever."}], options=options)
    assert reply.eval_count == expected > 256 and reply.done_reason == "length"


@pytest.mark.live
@pytest.mark.slow
def test_a_seed_draws_the_same_reply_and_another_seed_another(client):
    def draw(seed):
        return client.chat(model=MODEL, messages=HELLO, options={"temperature": 1.0, "seed": seed,
                                                                 "num_predict": 30}).message.content
    first = draw(7)
    assert draw(7) == first and draw(8) != first


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_reply_before_them(client, stream):
    messages = [{"role": "user", "content": "A long one for the stop test."}]
    text = client.chat(model=MODEL, messages=messages, options=greedy(30)).message.content
    stop = text[12:14]
    options = {**greedy(30), "stop": [stop, "never seen"]}
    if stream:
        parts = list(client.chat(model=MODEL, messages=messages, options=options, stream=True))
        cut, last = "".join(p.message.content for p in parts), parts[-1]
    else:
        last = client.chat(model=MODEL, messages=messages, options=options)
        cut = last.message.content
    assert cut == text[:text.index(stop)] and last.done_reason == "stop"


@pytest.mark.live
@pytest.mark.slow
def test_sampling_options_are_the_samplers(server, client):
    """top_k 1 and min_p 1 leave only the likeliest token: greedy, where the same draw
    without them is not; the penalties change the greedy reply, to /v1's for the same values."""
    def reply(**options):
        return client.chat(model=MODEL, messages=HELLO, options={"num_predict": 20, **options}).message.content

    plain, hot = reply(temperature=0), {"temperature": 1.5, "seed": 3}
    assert reply(**hot) != plain and reply(**hot, top_k=1) == plain and reply(**hot, min_p=1.0) == plain
    v1 = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)
    for ours, theirs in (({"repeat_penalty": 1.5}, {"extra_body": {"repetition_penalty": 1.5}}),
                         ({"frequency_penalty": 1.0, "presence_penalty": 0.5},
                          {"frequency_penalty": 1.0, "presence_penalty": 0.5})):
        expected = v1.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0, **theirs)
        assert reply(temperature=0, **ours) == expected.choices[0].message.content != plain, ours


@pytest.mark.live
@pytest.mark.slow
def test_logprobs_in_ollamas_shape(client):
    reply = client.chat(model=MODEL, messages=HELLO, options=greedy(6), logprobs=True, top_logprobs=2)
    assert len(reply.logprobs) == 6 and "".join(t.token for t in reply.logprobs) == reply.message.content
    for t in reply.logprobs:
        assert len(t.top_logprobs) == 2 and t.token == t.top_logprobs[0].token and t.logprob <= 0  # greedy
    parts = list(client.chat(model=MODEL, messages=HELLO, options=greedy(6), logprobs=True, top_logprobs=2,
                             stream=True))
    assert [(t.token, t.logprob) for p in parts for t in (p.logprobs or [])] == \
        [(t.token, t.logprob) for t in reply.logprobs]


# ---------------------------------------------------------------------------------------------
# Conversations: the same pool as /v1


@pytest.mark.live
@pytest.mark.slow
def test_a_second_turn_computes_only_its_new_tokens(server, client):
    """prompt_eval_count is the whole prompt (Ollama's count), prompt_eval_cached_count the part
    the first turn left in the cache: its prompt and its reply, as they were fed."""
    first_messages = [{"role": "user", "content": "Remember the number 42."}]
    first = raw_chat(client, messages=first_messages, options=greedy(10))
    assert first["prompt_eval_cached_count"] == 0
    second_messages = first_messages + [first["message"], {"role": "user", "content": "Which number?"}]
    second = raw_chat(client, messages=second_messages, options=greedy(10))
    assert second["prompt_eval_cached_count"] == first["prompt_eval_count"] + first["eval_count"]
    new_part = second["prompt_eval_count"] - second["prompt_eval_cached_count"]
    assert 0 < new_part < len("<|im_end|>\n<|im_start|>user\nWhich number?<|im_end|>\n<|im_start|>assistant\n")

    # the official client sends the same conversation the same way: the third turn reuses the second
    third = client.chat(model=f"{MODEL}:latest", options=greedy(10),
                        messages=second_messages + [second["message"], {"role": "user", "content": "Sure?"}])
    assert third.prompt_eval_count > second["prompt_eval_count"] + second["eval_count"]

    # /v1 lends from the same pool: it goes on with the conversation Ollama's route left
    v1 = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)
    later = second_messages + [second["message"], {"role": "user", "content": "Sure?"},
                               {"role": "assistant", "content": third.message.content},
                               {"role": "user", "content": "Thanks."}]
    reply = v1.chat.completions.create(model=MODEL, messages=later, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == third.prompt_eval_count + third.eval_count


@pytest.mark.live
@pytest.mark.slow
def test_ollamas_routes_write_the_same_log_line_as_v1(client, caplog):
    """One line per request, through /v1's one function: its tokens as the final object counts
    them, streamed or whole, and an error's sentence."""
    messages = [{"role": "user", "content": "Log this one."}]
    with caplog.at_level(logging.INFO, logger="h2o_chat.requests"):
        whole = raw_chat(client, messages=messages, options=greedy(6))
        streamed = list(client.generate(model=MODEL, prompt="And this.", options=greedy(5), stream=True))[-1]
        with pytest.raises(ollama.ResponseError):
            client.chat(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
        lines = logged_lines(caplog, 3)
    first, second = LINE.fullmatch(lines[0]), LINE.fullmatch(lines[1])
    assert first and second, lines
    assert first["route"] == "POST /api/chat" and second["route"] == "POST /api/generate"
    assert numbers(first) == {"status": 200, "prompt": whole["prompt_eval_count"],
                              "cached": whole["prompt_eval_cached_count"], "new": 6}
    assert (numbers(second)["prompt"], numbers(second)["new"]) == (streamed.prompt_eval_count, 5)
    assert lines[2].startswith("POST /api/chat 400 · ") and "wizard" in lines[2]


@pytest.mark.live
@pytest.mark.slow
def test_a_final_assistant_message_is_continued(client):
    """Ollama's chat writes on in a final assistant message (a prefill), as /v1 does with
    continue_final_message: the reply goes on where the message stops."""
    full = client.chat(model=MODEL, messages=HELLO, options=greedy(12)).message.content
    continued = client.chat(model=MODEL, messages=HELLO + [{"role": "assistant", "content": full[:5]}],
                            options=greedy(7))
    assert continued.message.content == full[5:12]


@pytest.mark.live
@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_stops_its_reply(server, client):
    stream = client.chat(model=MODEL, messages=[{"role": "user", "content": "Never stop."}],
                         options={"num_predict": 1_000_000}, stream=True)
    assert [next(stream).message.content for _ in range(3)]
    stream.close()  # a million tokens would take many minutes: the server must stop at once
    pool = server["router"].pool
    for _ in deadline(10):
        if not any(lent for _, lent in pool.live()):
            break
    left = next(s for s, _ in pool.live() if s.messages and s.messages[0].content == "Never stop.")
    assert 0 < left.last_turn.new_tokens < 100_000


# ---------------------------------------------------------------------------------------------
# Refusals and bad input


@pytest.mark.live
@pytest.mark.slow
def test_the_api_key_is_required_when_set(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        stranger = ollama.Client(host=server["url"], headers=headers, timeout=DEADLINE_S)
        for call, args in ((stranger.list, {}), (stranger.ps, {}), (stranger.show, {"model": MODEL}),
                           (stranger.chat, {"model": MODEL, "messages": HELLO, "options": greedy(2)}),
                           (stranger.generate, {"model": MODEL, "prompt": "hi", "options": greedy(2)})):
            status, sentence = refusal(lambda: call(**args))  # noqa: B023 (called at once)
            assert status == 401 and "Authorization: Bearer" in sentence
        assert stranger._client.get("/api/version").status_code == 401
    assert client.chat(model=MODEL, messages=HELLO, options=greedy(2)).eval_count == 2  # the key opens it


@pytest.mark.live
@pytest.mark.slow
def test_model_management_is_refused_with_a_sentence(client, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"weights")
    for call in (lambda: client.pull(MODEL), lambda: client.push(MODEL), lambda: client.delete(MODEL),
                 lambda: client.copy(MODEL, "another"), lambda: client.create(model="another", from_=MODEL),
                 lambda: client.create_blob(blob)):
        status, sentence = refusal(call)
        assert status == 501 and "serves the one model it was started with (--model)" in sentence
    for call in (lambda: client.embed(model=MODEL, input="text"), lambda: client.embeddings(model=MODEL, prompt="x")):
        status, sentence = refusal(call)
        assert status == 501 and "does not compute embeddings" in sentence
    assert [m.model for m in client.list().models] == [f"{MODEL}:latest"]  # nothing changed


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("call, status, says", [
    (lambda c: c.chat(model="llama3.2", messages=HELLO), 404, "model 'llama3.2' not found: this server has"),
    (lambda c: c.generate(model="h2o-chat:7b", prompt="hi"), 404, "model 'h2o-chat:7b' not found"),
    (lambda c: c.show("llama3.2"), 404, "not found"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"temperature": "hot"}), 400,
     "options.temperature must be a number"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"num_predict": 2.5}), 400,
     "options.num_predict must be a whole number"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"top_k": -1}), 400, "options.top_k must be at least 0, got -1"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"repeat_penalty": 0}), 400,
     "options.repeat_penalty must be more than 0, got 0"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"stop": [""]}), 400, "options.stop must be a list"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, options={"mirostat": 2}), 400, "options.mirostat is not supported"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "system", "content": "Only rules."}]), 400,
     "messages hold no user message"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "user", "content": "  "}]), 400, "messages[0]"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, "unknown role 'wizard'"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, format="json"), 400, "format (JSON mode, structured outputs)"),
    (lambda c: c.chat(model=MODEL, messages=HELLO, think=True), 400, "think is not supported"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}]),
     400, "messages[0]: images are not supported"),
    (lambda c: c.generate(model=MODEL, prompt="hi", template="{{ .Prompt }}"), 400, "template is not supported"),
    (lambda c: c.generate(model=MODEL, prompt="hi", context=[1, 2, 3]), 400, "context is not supported"),
    (lambda c: c.generate(model=MODEL, prompt="def f(", suffix="return x"), 400, "suffix (fill-in-the-middle)"),
    (lambda c: c.generate(model=MODEL, prompt="hi", raw=True, system="Be brief."), 400,
     "system has no effect with raw: true"),
])
def test_bad_input_gets_a_sentence(client, call, status, says):
    got_status, sentence = refusal(lambda: call(client))
    assert got_status == status and says in sentence, sentence


@pytest.mark.live
@pytest.mark.slow
def test_bodies_the_client_would_not_send_get_a_sentence_too(client):
    for body, says in (({"model": MODEL, "messages": "hi"}, "messages must be a list"),
                       ({"model": MODEL, "messages": HELLO, "options": [1]}, "options must be an object"),
                       ({"model": MODEL, "messages": HELLO, "stream": "yes"}, "stream must be true or false"),
                       ({"messages": HELLO}, "model is required"), ({"model": MODEL, "prompt": 5}, "prompt must be text")):
        route = "/api/generate" if "prompt" in body else "/api/chat"
        response = client._client.post(route, json=body)
        assert response.status_code == 400 and says in response.json()["error"]
    response = client._client.post("/api/chat", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]
    response = client._client.get("/api/nothing-here")
    assert response.status_code == 404 and "/api/chat" in response.json()["error"]


@pytest.mark.live
@pytest.mark.slow
def test_empty_messages_or_prompt_load_the_model_as_in_ollama(server, client):
    """Ollama answers a chat with no messages (a generate with no prompt) by loading the model:
    done_reason "load", nothing generated. Here it is loaded already; nothing is run."""
    steps = server["router"].batcher.steps
    chat = client.chat(model=MODEL, messages=[])
    gen = client.generate(model=f"{MODEL}:latest", prompt="", keep_alive=0)
    assert (chat.done, chat.done_reason, chat.message.content) == (True, "load", "")
    assert (gen.done, gen.done_reason, gen.response) == (True, "load", "")
    assert server["router"].batcher.steps == steps


@pytest.mark.live
@pytest.mark.slow
def test_while_the_model_loads_the_routes_answer_503_but_the_version(tmp_path):
    from tests.live import loading_server

    with loading_server(CACHE) as url:
        client = ollama.Client(host=url, timeout=DEADLINE_S)
        assert client._client.get("/api/version").json() == {"version": OLLAMA_VERSION}
        status, sentence = refusal(client.list)
        assert status == 503 and "loading" in sentence


# ---------------------------------------------------------------------------------------------
# The embedded model


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.embedded
def test_the_embedded_model_chats_through_ollamas_api(embedded_model, tmp_path):
    model, tokenizer = embedded_model
    with api_server(tmp_path, model, tokenizer, concurrency=1) as (url, _):
        client = ollama.Client(host=url, timeout=120)
        name = client.list().models[0].model
        reply = client.chat(model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                            options={"temperature": 0, "num_predict": 24})
        assert reply.done and len(reply.message.content.split()) >= 2
        assert "Paris" in reply.message.content
        assert client.show(name).details.parameter_size == "135M"
