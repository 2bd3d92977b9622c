"""Helpers for tests that drive a live app: an in-process server on 127.0.0.1, what a
gradio_client call showed (chat, warnings), a tiny chat model saved as a folder for `app.py`."""

import socket
from contextlib import contextmanager

import torch

from h2o_chat.chat.batch import Batcher
from h2o_chat.serve.api import create_router
from h2o_chat.ui.page import CSS, HEAD, build
from tests.conftest import make_tiny_chat

CALL_DEADLINE_S = 60  # a route of the tiny-model app answers in well under a second


def call(client, *args, api_name, seconds=CALL_DEADLINE_S):
    """`client.predict` with a deadline: a route that hangs fails the test instead of the whole run."""
    return client.submit(*args, api_name=api_name).result(timeout=seconds)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_app(data_dir, model=None, tokenizer=None, cache=None, concurrency=1, port=None, api=False, **chat_defaults):
    """The app as `app.py` launches it (show_error on, ssr off), on a free port (or `port`);
    yields (url, demo). api: the /v1 routes beside the page, as app.py mounts them (demo.router)."""
    if model is None:
        model, tokenizer = make_tiny_chat()
    defaults = dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="sum", positions="rolling")
    cache = dict(defaults, **(cache or {}))
    batcher = Batcher(model, concurrency)  # as app.py makes one, for any concurrency
    router = create_router(model, tokenizer, cache, str(data_dir), concurrency=concurrency, batcher=batcher) \
        if api else None
    watch = dict(watchable=router.pool.watchable) if router else {}  # the page lists and watches the API's
    demo = build(model, tokenizer, cache, str(data_dir), concurrency=concurrency, chat_defaults=chat_defaults,
                 batcher=batcher, **watch)
    demo.batcher, demo.router = batcher, router  # for tests: who shared a batch, the API's pool
    demo.queue(default_concurrency_limit=concurrency)
    port = port or free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, head=HEAD, quiet=True,
                show_error=True, ssr_mode=False, app_kwargs={"routes": router.routes} if router else {})
    try:
        yield f"http://127.0.0.1:{port}/", demo
    finally:
        demo.close()


@contextmanager
def serve_routes(router, label):
    """The API's routes of `router` beside a page that only says `label`, on a free local port:
    yields the server's url."""
    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown(label)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs={"routes": router.routes})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        demo.close()


def loading_server(cache):
    """The API's routes beside a page whose model is still loading (create_router with no model)."""
    return serve_routes(create_router(None, None, dict(cache)), "loading")


def text_of(message):
    """Gradio 6 sends a message's content as a list of typed parts."""
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def texts(chat):
    return [(m["role"], text_of(m)) for m in chat]


def warnings_of(job, level="warning"):
    """The gr.Warning toasts (level "info": gr.Info) a finished call showed, in order. Reading
    them uses them up: a job's toasts are read once."""
    found, updates = [], job.communicator.updates
    while not updates.empty():
        update = updates.get_nowait()
        if getattr(update, "log", None) and update.log[1] == level:
            found.append(update.log[0])
    return found


def never_ending(model, tokenizer):
    """Make the tiny chat model (almost) never say <|im_end|>: every reply runs to
    max_new_tokens, greedy or sampled as the app samples (top-p 0.9), so a reply is reliably
    still streaming when a test interrupts it."""
    with torch.no_grad():
        model.model.norm.weight.mul_(50)  # peaked logits: top-p keeps only the top few tokens ...
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 0  # ... never this one (logit 0)
    return model, tokenizer


def save_tiny_chat(folder, never_ends=False):
    """The conftest tiny chat model and tokenizer as a folder `load_model` (and so `app.py`) reads."""
    model, tokenizer = make_tiny_chat()
    if never_ends:
        never_ending(model, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


STREAMED = ("conversation_id", "chat", "marks", "saved", "legend", "token_map", "retention_map", "stats", "memory", "slots",
            "heavy")
FIELDS = ("system_prompt", "pin_system_prompt", "temperature", "top_p", "max_new_tokens", "policy", "budget", "n_recent", "n_sink",
          "score", "positions", "keep_template", "kv_quant")


def shown(result):
    """A route's outputs by name: /send's start with the message box, the conversation-level
    routes (new chat, restore, apply) end with every settings field."""
    result = list(result)
    names = (("box",) if len(result) == len(STREAMED) + 1 else ()) + STREAMED + (
        FIELDS if len(result) == len(STREAMED) + len(FIELDS) else ())
    assert len(names) == len(result), (len(names), len(result))
    return dict(zip(names, result))


def left_as_typed(value):
    """A route's output the app did not update: the page keeps what the user typed there."""
    return value == {"__type__": "update"}


def deadline(seconds):
    """A wait's end: `for _ in deadline(5): if done(): break` (fails the test when it runs out)."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        yield
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting after {seconds} s")
