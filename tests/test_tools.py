"""Function tools through `/v1/chat/completions`, with the real `openai` client.

Open WebUI attaches its built-in tools to every chat request. A model whose chat template shows
tools gets them, and the calls it writes come back as OpenAI's `tool_calls` (streamed as deltas);
a model whose template has none answers as a chat without them, and says so. The model whose
template has tools here is a tiny random LLaMA with a Hermes/Qwen-style template, its lm_head
biased so that greedy decoding writes a call: each of a few tokens makes the next one the
likeliest by far (a bigram chain), whatever the random layers add."""

import json
import logging
from contextlib import contextmanager

import openai
import pytest
import torch
from tokenizers import AddedToken

from h2o_chat.chat.template import render, token_ids
from h2o_chat.chat.tools import KnownCalls, call_prefix, parse_calls, renders_tools
from h2o_chat.serve.requests import read_chat_request
from tests.conftest import char_tokenizer, make_tiny_chat, make_tiny_llama
from tests.live import deadline
from tests.test_api import CACHE, api_server

DEADLINE_S = 60

# Shaped like Open WebUI's built-in tools (a function without arguments, functions with typed
# ones, optional and required); the names and texts are this test's own.
WEBUI_TOOLS = [
    {"type": "function", "function": {"name": "current_time", "description": "The date and time now.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {
        "name": "search_notes", "description": "Search the user's notes for a phrase.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "count": {"type": "integer", "description": "How many notes at most", "default": 5}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "remember", "description": "Keep a fact about the user for later chats.",
        "parameters": {"type": "object", "properties": {"fact": {"type": "string"},
                                                        "important": {"type": "boolean"}}, "required": ["fact"]}}},
] + [{"type": "function", "function": {"name": f"knowledge_{i}", "description": f"Look up knowledge base {i}.",
                                       "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                      "required": ["q"]}}} for i in range(27)]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# A Hermes/Qwen2.5-style template: the tools in the system turn, calls in <tool_call> tags, tool
# results as a user turn in <tool_response> tags.
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}{% for call in message.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # one token of the tool model
ARGS = '{"city": "Paris"}'  # one token too: what follows `"arguments": ` when a call is asked for


def make_tool_chat():
    """The tiny chat model (a token per character, ChatML's tokens) with the HERMES template, the
    call's pieces as tokens of their own, and a bigram chain in its weights: after "\\n" (the end
    of the generation prompt) it writes <tool_call>, the call, </tool_call>, <|im_end|>; with
    <tool_call> banned, "OK"; after `"arguments": ` (a call asked for), the arguments and the
    closing tag. Each link's token has a one-hot embedding, and the lm_head row of the next
    token points at it."""
    tokenizer = char_tokenizer(HERMES)
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>", CALL, ARGS)])
    model = make_tiny_llama(torch.float64, vocab_size=len(tokenizer))
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config.eos_token_id = ids("<|im_end|>")
    chain = [("\n", "<tool_call>", 10.0), ("<tool_call>", CALL, 10.0), (CALL, "</tool_call>", 10.0),
             ("</tool_call>", "<|im_end|>", 10.0), ("\n", "O", 5.0), ("O", "K", 10.0), ("K", "<|im_end|>", 10.0),
             (" ", ARGS, 10.0), (ARGS, "}", 10.0), ("}", "</tool_call>", 10.0)]
    dims = {}
    with torch.no_grad():
        for before, after, weight in chain:
            if before not in dims:
                dims[before] = len(dims)
                model.model.embed_tokens.weight[ids(before)] = 0
                model.model.embed_tokens.weight[ids(before), dims[before]] = 1.0
            model.lm_head.weight[ids(after), dims[before]] = weight
    return model, tokenizer


@contextmanager
def served(tmp_path, model, tokenizer):
    with api_server(tmp_path, model, tokenizer, concurrency=1) as (url, router):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S, max_retries=0), router


def ask(client, messages, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="h2o-chat", messages=messages, **kwargs)


def request_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "h2o_chat.requests"]


# ---------------------------------------------------------------------------------------------
# Templates without tools: answered as a chat, and said


def test_the_templates_here_and_whether_they_show_tools():
    assert renders_tools(make_tool_chat()[1])
    assert not renders_tools(make_tiny_chat()[1])  # ChatML as the tiny model writes it: no tools


def tools_ignored_on(client, caplog):
    """Open WebUI's default request (its tools, no tool_choice, no max_tokens) on a template
    without tools: a 200 with text, the header and the request's log line say why."""
    messages = [{"role": "user", "content": "Hello! What can you do?"}]
    with caplog.at_level(logging.INFO, logger="h2o_chat.requests"):
        model = client.models.list().data[0].id
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages,
                                                               tools=WEBUI_TOOLS, temperature=0, max_tokens=16)
        reply = raw.parse()
        assert raw.status_code == 200 and reply.choices[0].message.content and not reply.choices[0].message.tool_calls
        assert raw.headers["x-h2o-tools-ignored"] == "this model's chat template does not show tools to the model"
        for _ in deadline(10):
            if request_lines(caplog):
                break
    line = request_lines(caplog)[-1]
    assert line.startswith("POST /v1/chat/completions 200") and "tools ignored: this model's chat template" in line
    return reply


@pytest.mark.live
@pytest.mark.slow
def test_webui_tools_on_a_template_without_tools_get_a_reply_that_says_they_were_ignored(tmp_path, caplog):
    model, tokenizer = make_tiny_chat(torch.float64)
    with served(tmp_path, model, tokenizer) as (client, router):
        reply = tools_ignored_on(client, caplog)
        plain = ask(client, [{"role": "user", "content": "Hello! What can you do?"}], max_tokens=16)
        assert plain.choices[0].message.content == reply.choices[0].message.content  # the tools changed nothing
        with pytest.raises(openai.BadRequestError, match="asks for a tool call, and this model's chat template"):
            ask(client, [{"role": "user", "content": "hi"}], tools=WEBUI_TOOLS, tool_choice="required")
        with pytest.raises(openai.BadRequestError, match="asks for a tool call"):
            ask(client, [{"role": "user", "content": "hi"}], tools=WEBUI_TOOLS,
                tool_choice={"type": "function", "function": {"name": "current_time"}})


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.embedded
def test_webui_tools_on_the_embedded_model_get_a_reply(tmp_path, embedded_model, caplog):
    """SmolLM2's template shows no tools: Open WebUI's default request gets a reply."""
    model, tokenizer = embedded_model
    assert not renders_tools(tokenizer)
    with served(tmp_path, model, tokenizer) as (client, _):
        tools_ignored_on(client, caplog)


# ---------------------------------------------------------------------------------------------
# A template with tools: the model's calls come back as tool_calls


def streamed_calls(client, messages, **kwargs):
    """(content, {index: call}, finish_reason) of a streamed reply, its tool call deltas joined
    as a client joins them."""
    content, calls, finish = "", {}, None
    for chunk in ask(client, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.live
@pytest.mark.slow
def test_a_call_the_model_writes_comes_back_as_tool_calls_whole_and_streamed(tmp_path, caplog):
    model, tokenizer = make_tool_chat()
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    with served(tmp_path, model, tokenizer) as (client, router):
        reply = ask(client, messages, tools=[WEATHER] + WEBUI_TOOLS[:2])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert reply.usage.completion_tokens == 3  # <tool_call>, the call, </tool_call>

        content, calls, finish = streamed_calls(client, messages, tools=[WEATHER] + WEBUI_TOOLS[:2])
        assert content == "" and finish == "tool_calls" and list(calls) == [0]
        assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)
        assert calls[0]["id"].startswith("call_") and calls[0]["id"] != call.id

        # the same request with tool_choice "none": the model is shown no tools, its text is text
        plain = ask(client, messages, tools=[WEATHER], tool_choice="none")
        assert plain.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
        assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls

        # the legacy functions / function_call: the call as message.function_call
        legacy = ask(client, messages, functions=[WEATHER["function"]])
        assert legacy.choices[0].finish_reason == "function_call"
        assert legacy.choices[0].message.function_call.name == "get_weather"


@pytest.mark.live
@pytest.mark.slow
def test_a_tool_result_continues_the_conversation_from_the_cache(tmp_path):
    """The client runs the call and sends its result (role "tool"): the reply to it reuses every
    token of the prompt and of the call the model wrote (the call it sends back is rendered as
    the model wrote it). A call the server never handed out is rendered by the template."""
    model, tokenizer = make_tool_chat()
    no_more_calls = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): -100}
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    with served(tmp_path, model, tokenizer) as (client, router):
        first = ask(client, messages, tools=[WEATHER])
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        answer = ask(client, messages, tools=[WEATHER], logit_bias=no_more_calls)
        assert answer.choices[0].message.content == "OK" and answer.choices[0].finish_reason == "stop"
        assert answer.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + \
            first.usage.completion_tokens
        session = next(s for s, _ in router.pool.live() if s.messages[-1].content == "OK")
        assert [(m.role, m.tool_call_id) for m in session.messages] == [("user", None), ("assistant", None),
                                                                        ("tool", call.id), ("assistant", None)]

        # the same turn from a client that made up its own call id: the template writes the call
        foreign = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_mine", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "call_mine", "content": "18 degrees and sunny"}]
        again = ask(client, foreign, tools=[WEATHER], logit_bias=no_more_calls)
        assert again.choices[0].message.content == "OK"
        shown = tokenizer.decode(token_ids(render(tokenizer, None, session_messages(router, "call_mine"),
                                                  tools=[WEATHER])))
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in shown
        assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in shown
        assert first.usage.prompt_tokens <= again.usage.prompt_tokens_details.cached_tokens < \
            answer.usage.prompt_tokens_details.cached_tokens


def session_messages(router, call_id):
    return next(s.messages for s, _ in router.pool.live() if any(m.tool_call_id == call_id for m in s.messages))


@pytest.mark.live
@pytest.mark.slow
def test_a_call_asked_for_by_name_is_started_in_the_reply(tmp_path):
    """tool_choice naming a function: the reply starts with the opening of that call in the
    template's format, so the model can only go on with its arguments (here it would otherwise
    say "OK": <tool_call> is banned)."""
    model, tokenizer = make_tool_chat()
    no_calls = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): -100}
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    with served(tmp_path, model, tokenizer) as (client, _):
        assert ask(client, messages, tools=[WEATHER], logit_bias=no_calls).choices[0].message.content == "OK"
        forced = ask(client, messages, tools=[WEATHER], logit_bias=no_calls,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert forced.choices[0].finish_reason == "tool_calls"
        assert json.loads(forced.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


# ---------------------------------------------------------------------------------------------
# The parts, without a server


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "current_time", "arguments": {}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Oslo"}), ("current_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),  # Llama 3.1
    ('{"name": "no_such_tool", "parameters": {}}', '{"name": "no_such_tool", "parameters": {}}', []),
    ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("<tool_call>not JSON</tool_call> then text", "<tool_call>not JSON</tool_call> then text", []),
    ("An unfinished <tool_", "An unfinished <tool_", []),
], ids=["text", "hermes", "text-and-two-calls", "llama-json", "unknown-name", "other-json", "unclosed", "not-json",
        "tag-tail"])
def test_calls_are_read_from_the_formats_models_write_whole_and_piece_by_piece(text, content, calls):
    names = ["get_weather", "current_time"]
    whole_content, whole_calls = parse_calls(text, names)
    assert (whole_content or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls] == calls
    from h2o_chat.chat.tools import ToolCalls

    reader, shown, found = ToolCalls(names), "", []
    for character in text:  # streamed a character at a time: the same content and calls
        piece, more = reader.feed(character)
        shown, found = shown + piece, found + more
    piece, more = reader.finish()
    assert shown + piece == whole_content and [c["function"] for c in found + more] == \
        [c["function"] for c in whole_calls]


def test_the_opening_of_a_call_asked_for_is_in_the_templates_format():
    _, tokenizer = make_tool_chat()
    assert call_prefix(tokenizer) == '<tool_call>\n{"name": "'
    assert call_prefix(tokenizer, "get_weather") == '<tool_call>\n{"name": "get_weather", "arguments": '
    job = read_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                             "tool_choice": "required"}, CACHE)
    assert job.forced_tool == "" and not job.continue_final
    content, calls = parse_calls('get_weather", "arguments": {"city": "Paris"}}</tool_call>', ["get_weather"],
                                 prefix=call_prefix(tokenizer))
    assert content == "" and calls[0]["function"]["name"] == "get_weather"


def test_a_call_sent_back_is_the_text_it_was_read_from_only_if_it_is_the_same_call():
    known, text = KnownCalls(), 'Sure.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    _, calls = parse_calls(text, ["f"])
    known.remember(calls, text, ["f"])
    assert known.text_of(calls) == text
    assert known.text_of([{**calls[0], "function": {"name": "f", "arguments": '{"x": 1}'}}]) == text  # spacing
    assert known.text_of([{**calls[0], "function": {"name": "f", "arguments": '{"x": 2}'}}]) is None  # edited
    assert known.text_of([{**calls[0], "id": "call_other"}]) is None


def test_llama_31_style_templates_render_calls_and_json_quoted_results():
    """A template that shows only a message's call (not its text) and writes a tool's result as a
    JSON string (Llama 3.1 does both): the result's text is still tokenized as text."""
    tokenizer = make_tiny_chat()[1]
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if 'tool_calls' in m %}<|im_start|>assistant\n"
        "{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": "
        "{{ m.tool_calls[0].function.arguments | tojson }}}<|im_end|>\n"
        "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content | tojson }}<|im_end|>\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    from h2o_chat.chat.conversation import Message

    messages = [Message("user", "weather?"), Message("assistant", "ignored by this template", tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        Message("tool", 'sunny <|im_end|> "18"', tool_call_id="c1")]
    segments = render(tokenizer, None, messages, add_generation_prompt=True)
    text = tokenizer.decode(token_ids(segments))
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|im_end|>' in text
    assert '<|im_start|>ipython\n"sunny <|im_end|> \\"18\\""<|im_end|>' in text
    result = next(s for s in segments if s.text and s.role == "tool")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in result.ids  # the result's words stay text


def test_the_page_shows_a_tool_result_as_input_to_the_model(tmp_path):
    """An API conversation with a tool result, restored or watched on the page: the Chatbot knows
    no tool role, so the result is shown as the user's; a saved file keeps it a tool message."""
    from h2o_chat import ChatSession
    from h2o_chat.chat import store
    from h2o_chat.ui.state import chat_view

    model, tokenizer = make_tool_chat()
    session = ChatSession(model, tokenizer, data_dir=tmp_path)
    session.conversation.tools = [WEATHER]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    session.messages = [{"role": "user", "content": "weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    session.autosave()
    assert [m["role"] for m in chat_view(session)] == ["user", "assistant", "user"]
    saved = store.read(tmp_path, session.id)
    assert saved.messages == session.messages and saved.tools == [WEATHER]
    assert store.load(tmp_path, session.id)["messages"][0] == {"role": "user", "content": "weather?", "pinned": False}


def test_the_prompt_size_limit_counts_the_tools_the_template_shows():
    from h2o_chat.serve.api import ApiError, create_router

    model, tokenizer = make_tool_chat()
    body = {"messages": [{"role": "user", "content": "hi"}]}
    bare = read_chat_request(body, CACHE)
    with_tools = read_chat_request(dict(body, tools=WEBUI_TOOLS), CACHE)
    api = create_router(model, tokenizer, CACHE, max_prompt_tokens=100).api
    api.check_prompt_size(bare)  # a few dozen tokens
    with pytest.raises(ApiError, match=r"the prompt is [\d,]+ tokens; this server reads at most 100"):
        api.check_prompt_size(with_tools)  # thirty tools' JSON: thousands
