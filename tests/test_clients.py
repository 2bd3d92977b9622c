"""What SillyTavern, Open WebUI and llama.cpp's clients really send, against a live server: raw
SillyTavern bodies kept in tests/fixtures (each says where in SillyTavern's source it comes from),
the `openai` client for OpenAI's fields (n, logprobs, penalties, logit_bias), llama.cpp's native
routes, and the limits (a body too large, a prompt too long, a client that leaves mid-prefill)."""

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from h2o_chat.chat import timeline as timeline_mod
from h2o_chat.serve.api import create_router
from tests.conftest import make_tiny_chat
from tests.live import never_ending, serve_routes
from tests.test_api import CACHE, api_server

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.live, pytest.mark.slow]

KEY = "clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIXTURES = Path(__file__).parent / "fixtures"
DEADLINE_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tokenizer = never_ending(*make_tiny_chat(torch.float64))
    with api_server(tmp_path_factory.mktemp("clients"), model, tokenizer, concurrency=3, api_key=KEY,
                    max_prompt_tokens=4096) as (url, router):
        yield {"url": url, "router": router}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)


def fixture(name):
    return json.loads((FIXTURES / name).read_text())


def post(server, route, body, stream=False):
    """(status, JSON or the list of server-sent events' JSON)."""
    if not stream:
        response = httpx.post(server["url"] + route, json=body, headers=AUTH, timeout=DEADLINE_S)
        return response.status_code, response.json()
    with httpx.stream("POST", server["url"] + route, json=body, headers=AUTH, timeout=DEADLINE_S) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return response.status_code, [json.loads(line) for line in lines if line != "[DONE]"]


# ---------------------------------------------------------------------------------------------
# SillyTavern's bodies, as its source builds them


@pytest.mark.parametrize("name", ["sillytavern_chat_continue.json", "sillytavern_chat_impersonate.json",
                                  "sillytavern_chat_authors_note.json"])
def test_sillytavern_chat_completion_bodies_are_answered_from_the_cache(server, name):
    """Continue (a system nudge after the last reply), Impersonate (a system prompt after it) and
    an Author's Note (a system message inside the history): answered, with the history cached."""
    spec = fixture(name)
    body = dict(spec["body"], max_tokens=24, stream_options={"include_usage": True})
    messages = body["messages"]
    before = len(messages) - next(i for i, m in enumerate(reversed(messages)) if m["role"] == "user")
    status, _ = post(server, spec["route"], dict(body, messages=messages[:before], stream=False))  # the turn before
    assert status == 200
    status, events = post(server, spec["route"], body, stream=True)
    assert status == 200
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    usage = events[-1]["usage"]
    assert text and usage["prompt_tokens_details"]["cached_tokens"] > 0.5 * usage["prompt_tokens"]


@pytest.mark.parametrize("name", ["sillytavern_text_generic.json", "sillytavern_text_ooba_deterministic.json"])
def test_sillytavern_text_completion_bodies_are_answered_from_the_cache(server, name):
    """SillyTavern's defaults: seed -1 (random), every sampler field at its default; the
    Deterministic preset's top_p 0 (greedy)."""
    spec = fixture(name)
    body = spec["body"]
    shorter = body["prompt"].rsplit("<|im_start|>user", 1)[0]
    assert post(server, spec["route"], dict(body, prompt=shorter))[0] == 200
    status, answer = post(server, spec["route"], body)
    assert status == 200 and answer["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shorter) - 6 * len("<|im_start|>")
    if "deterministic" in name:
        assert post(server, spec["route"], body)[1]["choices"][0]["text"] == answer["choices"][0]["text"]


def test_sillytavern_llamacpp_completion_streams_in_llamacpps_shape(server):
    spec = fixture("sillytavern_llamacpp_completion.json")
    status, events = post(server, spec["route"], dict(spec["body"], n_predict=12), stream=True)
    assert status == 200
    pieces, last = events[:-1], events[-1]
    assert all(e["stop"] is False and isinstance(e["content"], str) for e in pieces)
    assert "".join(e["content"] for e in pieces)
    assert last["stop"] is True and last["tokens_predicted"] == 12 and last["stop_type"] == "limit"
    assert last["tokens_evaluated"] > 0 and "tokens_cached" in last
    probs = [p for e in pieces for p in e.get("completion_probabilities", [])]
    assert len(probs) == 12 and all(len(p["top_logprobs"]) == 10 for p in probs)
    assert all(p["id"] != 6 for p in probs)  # [6, false]: banned
    again = post(server, spec["route"], dict(spec["body"], n_predict=4, stream=False))[1]  # the same prompt again
    assert again["stop"] is True and again["tokens_cached"] == again["tokens_evaluated"]


def test_llamacpps_other_routes(server):
    ids = httpx.post(server["url"] + "/tokenize", json={"content": "hi<|im_end|>"}, headers=AUTH).json()["tokens"]
    assert len(ids) == 3  # parse_special: its special token is one token
    plain = httpx.post(server["url"] + "/tokenize", json={"content": "hi<|im_end|>", "parse_special": False,
                                                          "with_pieces": True}, headers=AUTH).json()["tokens"]
    assert "".join(t["piece"] for t in plain) == "hi<|im_end|>" and len(plain) == 12
    assert httpx.post(server["url"] + "/detokenize", json={"tokens": ids}, headers=AUTH).json() == \
        {"content": "hi<|im_end|>"}
    props = httpx.get(server["url"] + "/props", headers=AUTH).json()
    assert props["total_slots"] == 3 and "<|im_start|>" in props["chat_template"]
    assert props["default_generation_settings"]["params"]["repeat_penalty"] == 1.0
    assert props["default_generation_settings"]["params"]["n_predict"] == -1  # until the model stops, as llama.cpp


# ---------------------------------------------------------------------------------------------
# OpenAI's fields, with the openai client


def test_n_choices_are_drawn_as_rows_of_one_batch(server, client):
    batcher = server["router"].batcher
    reply = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "Three tales."}],
                                           n=3, max_tokens=40, temperature=1.0, seed=4)
    texts = [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) == 3 and all(texts)
    assert reply.usage.completion_tokens == 3 * 40
    assert batcher.largest_batch == 3  # the three decoded as rows of one batched forward
    again = client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "Three tales."}],
                                           n=3, max_tokens=40, temperature=1.0, seed=4)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded: the same


def test_chat_logprobs_in_openais_shape(client):
    messages = [{"role": "user", "content": "Some logprobs, please."}]
    reply = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == reply.choices[0].message.content  # one character a token here
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= 0
        assert t.token == t.top_logprobs[0].token and t.bytes == list(t.token.encode())  # greedy: the likeliest
    streamed = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    entries = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in entries] == [(t.token, t.logprob) for t in content]


def test_text_completion_logprobs_in_openais_shape(client):
    reply = client.completions.create(model="h2o-chat", prompt="Once upon a time", max_tokens=6, temperature=0,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text and lp.text_offset == list(range(6))
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_penalties_and_logit_bias_change_the_reply(client):
    messages = [{"role": "user", "content": "Say something plain."}]
    plain = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=20, temperature=0)
    text = plain.choices[0].message.content
    banned = ord(text[0]) - 31  # the char-level tokenizer: id = code point - 31
    biased = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=20, temperature=0,
                                            logit_bias={str(banned): -100})
    assert text[0] not in biased.choices[0].message.content
    penalised = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=20, temperature=0,
                                               frequency_penalty=2, presence_penalty=2)
    out = penalised.choices[0].message.content
    assert out != text and max(out.count(c) for c in set(out)) <= max(text.count(c) for c in set(text))


def test_a_final_assistant_message_is_continued_as_the_model_would_have_written_it(client):
    """Open WebUI's "Continue response": the history ends with the reply. It is written on from
    where it ends, from the tokens the cache already holds (every prompt token is cached), and
    the two halves are exactly the reply one longer request gets."""
    question = [{"role": "user", "content": "Recite the letters, please."}]
    start = [{"role": "assistant", "content": "A B C D E F G"}]
    half = client.chat.completions.create(model="h2o-chat", messages=question + start, max_tokens=10, temperature=0)
    first = half.choices[0].message.content
    more = client.chat.completions.create(model="h2o-chat", max_tokens=10, temperature=0, messages=question + [
        {"role": "assistant", "content": "A B C D E F G" + first}])
    whole = client.chat.completions.create(model="h2o-chat", messages=question + start, max_tokens=20, temperature=0)
    assert first + more.choices[0].message.content == whole.choices[0].message.content
    assert more.usage.prompt_tokens == half.usage.prompt_tokens + half.usage.completion_tokens
    assert more.usage.prompt_tokens_details.cached_tokens == more.usage.prompt_tokens  # nothing recomputed


@pytest.mark.parametrize("finished", [{"continue_final_message": False}, {"add_generation_prompt": True}])
def test_a_final_assistant_message_is_answered_when_the_client_says_it_is_finished(client, finished):
    messages = [{"role": "user", "content": "Start a list."}, {"role": "assistant", "content": "1. Apples"}]
    answered = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=8, temperature=0,
                                              extra_body=finished)
    continued = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=8, temperature=0)
    fresh = client.chat.completions.create(model="h2o-chat", max_tokens=8, temperature=0,
                                           messages=messages + [{"role": "assistant", "content": ""}])
    assert answered.choices[0].message.content == fresh.choices[0].message.content  # a new turn after it
    assert continued.choices[0].message.content != answered.choices[0].message.content


def test_completion_tokens_stop_at_the_stop_string(client):
    messages = [{"role": "user", "content": "Say something long for the stop test."}]
    full = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    stop = text[10:12]
    cut = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=30, temperature=0, stop=stop)
    kept = cut.choices[0].message.content
    assert kept == text[: text.find(stop)] and cut.usage.completion_tokens == len(kept)  # a token per character


# ---------------------------------------------------------------------------------------------
# Limits


def test_a_1mb_body_is_refused_in_under_a_second(server):
    body = {"model": "h2o-chat", "messages": [{"role": "user", "content": "x" * 1_000_000}]}
    start = time.perf_counter()
    response = httpx.post(server["url"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=DEADLINE_S)
    assert time.perf_counter() - start < 1.0
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_prompt_past_max_prompt_tokens_is_refused_before_any_prefill(server, client):
    processed = sum(s.timeline.tokens_processed for s, _ in server["router"].pool.live())
    with pytest.raises(openai.BadRequestError, match="4,096") as refused:
        client.chat.completions.create(model="h2o-chat", messages=[{"role": "user", "content": "y" * 5000}],
                                       max_tokens=2)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert sum(s.timeline.tokens_processed for s, _ in server["router"].pool.live()) == processed


def test_a_client_that_leaves_mid_prefill_frees_the_cpu_within_2_s(tmp_path, monkeypatch, caplog):
    """A long prompt's prefill, chunk after slow chunk: the client leaves after half a second;
    within two seconds no worker is busy and most of the prompt was never computed. Nothing is
    logged as an error (the client left before the first token)."""
    slow = timeline_mod.Timeline._forward

    def forward(self, x):
        if x.shape[1] > 1:
            time.sleep(0.1)  # a prefill chunk on a slow CPU
        return slow(self, x)

    monkeypatch.setattr(timeline_mod.Timeline, "_forward", forward)
    with api_server(tmp_path, concurrency=1) as (url, router), caplog.at_level(logging.ERROR):
        body = {"model": "h2o-chat", "messages": [{"role": "user", "content": "z" * 20_000}], "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting for the first token
            httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(DEADLINE_S, read=0.5))
        left = time.perf_counter()
        while any(lent for _, lent in router.pool.live()) and time.perf_counter() - left < 5:
            time.sleep(0.02)
        assert time.perf_counter() - left < 2.0
        session = router.pool.live()[0][0]
        assert len(session.ledger) < 5_000  # of ~20,000 tokens: 80 chunks of 0.1 s, stopped after a few
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@contextmanager
def api_only(data_dir):
    """The API alone on a free port (the page needs a writable data folder for its browser key)."""
    model, tokenizer = make_tiny_chat(torch.float64)
    router = create_router(model, tokenizer, dict(CACHE), str(data_dir))
    with serve_routes(router, "api only") as url:
        yield url, router


def test_a_data_folder_that_cannot_be_written_still_answers(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with api_only(blocker / "data") as (url, router):
        response = httpx.post(url + "/v1/chat/completions", timeout=DEADLINE_S, json={
            "model": "h2o-chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        assert response.headers["x-h2o-not-saved"] == "Not a directory"  # why, without the path


def test_a_story_resent_every_turn_gets_what_one_session_gets_token_for_token(tmp_path):
    """The client resends the story as text each turn; its replies are drawn as tokens BPE would
    merge ("t" "h" "e": a bias makes the model write them often). Every turn reuses the previous
    reply, and the story is, token for token, the one a single ChatSession writes (the page's
    path): /v1 adds nothing of its own to what the model sees."""
    from h2o_chat import ChatSession
    from tests.test_reuse import make_tiny_bpe_chat

    model, tok = make_tiny_bpe_chat()
    bias = {str(tok.convert_tokens_to_ids(c)): 4.0 for c in "the "}
    sampling = dict(temperature=1.0, top_p=1.0, max_new_tokens=24)
    turns = [f"Turn {i}: tell me more." for i in range(6)]
    with api_server(tmp_path, model, tok, concurrency=1) as (url, router):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S, max_retries=0)
        messages, served, previous = [{"role": "system", "content": "A story."}], [], None
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            reply = client.chat.completions.create(model="h2o-chat", messages=messages, max_tokens=24, temperature=1.0,
                                                   top_p=1.0, seed=100 + i, logit_bias=bias,
                                                   extra_body={"h2o": dict(CACHE)})
            if previous is not None:
                assert reply.usage.prompt_tokens_details.cached_tokens == \
                    previous.usage.prompt_tokens + previous.usage.completion_tokens
            served.append(reply.choices[0].message.content)
            messages.append({"role": "assistant", "content": served[-1]})
            previous = reply
    alone = ChatSession(model, tok, cache=dict(CACHE), system_prompt="A story.", **sampling)
    for i, text in enumerate(turns):
        alone.configure(seed=100 + i, logit_bias=bias)
        assert "".join(alone.send(text)) == served[i]
    assert any("the" in r for r in served)  # replies BPE re-tokenizes differently were there to reuse


@pytest.mark.embedded
def test_the_embedded_model_continues_a_b_c_d_e_f_g_with_h(tmp_path, embedded_model):
    """Greedy, the real model writes on in the assistant's message: " H" first; continued again,
    the prompt is the tokens the cache holds (all of them cached)."""
    with api_server(tmp_path, *embedded_model, concurrency=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S, max_retries=0)
        model = client.models.list().data[0].id
        question = {"role": "user", "content": "Recite the alphabet with spaces between the letters."}
        first = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            question, {"role": "assistant", "content": "A B C D E F G"}])
        text = first.choices[0].message.content
        assert text.startswith(" H")
        again = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            question, {"role": "assistant", "content": "A B C D E F G" + text}])
        assert again.usage.prompt_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
