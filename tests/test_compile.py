"""The compiled decode step without making a user wait (models/compile.py).

A session starts on the eager step; the first step of a shape it has not compiled asks the
model's compiler thread to compile that shape on a replica of the cache, and keeps running
eagerly; once the compiled code exists, steps of that shape run it. Most tests here use a backend
that runs the graph Dynamo traced (the same ops as the eager step: the same bits) and counts the
compiles and the thread they ran on; the slow ones run inductor, and a second process that finds
the first one's kernels on disk.
"""

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from h2o_chat import H2OCache
from h2o_chat.chat.batch import Arena, Batcher, Request
from h2o_chat.chat.session import ChatSession
from h2o_chat.models.compile import Compilation, StepCompiler, step_compiler
from h2o_chat.models.decode import Decoder
from tests.conftest import make_tiny_chat, make_tiny_llama, run_threads
from tests.test_decode import FakeQuantLinear

WAIT_S = 120  # a deadline on every wait for the compiler thread (a loaded 2-core machine is slow)
GREEDY = dict(temperature=0, max_new_tokens=24, cache={"budget": 24, "n_sink": 2, "n_recent": 8})
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


class Traced:
    """A backend that runs the graph as Dynamo traced it, noting the thread of each compile; with
    `hold`, each compile waits until `go` is set (deadline WAIT_S); `fail`: True, every compile
    raises, or the numbers of the compiles that raise (1 the first)."""

    def __init__(self, hold=False, fail=False):
        self.threads, self.go, self.entered, self.hold, self.fail = [], threading.Event(), threading.Event(), hold, fail

    def __call__(self, graph, example_inputs):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if self.fail is True or len(self.threads) in (self.fail or ()):
            raise RuntimeError("no kernel for this op")
        if self.hold:
            assert self.go.wait(WAIT_S)
        return graph.forward


def fed(model, **settings):
    """A cache fed 20 tokens with a budget of 12: full, every step evicts."""
    cache = H2OCache(model, budget=12, n_sink=2, n_recent=4, **settings)
    model(torch.arange(20)[None] % model.config.vocab_size, cache=cache)
    return cache


def step(decoder, cache, t):
    token = torch.tensor([[(7 * t) % 128]])
    return decoder.step(token, torch.tensor([cache.get_seq_length()]), cache)


def step_as(decoder, a, b, t, shape):
    """One step of conversation `a` by `decoder`: "alone", "two stacked" (with `b`, in an arena),
    or "one sits out" (b stacked, not stepping); a's logits."""
    token = torch.tensor([[(7 * t) % 128]])
    if shape == "alone":
        return decoder.step(token, torch.tensor([a.get_seq_length()]), a)[0]
    arena = Arena()
    arena.join(a)
    arena.join(b)
    requests = [Request(a, token)] + ([] if shape == "one sits out" else [Request(b, (token + 3) % 128)])
    logits = arena.step(decoder, requests)[0]
    arena.leave(b)
    arena.leave(a)
    return logits


@pytest.mark.parametrize("fed_in,stepped_in", [("no_grad", "no_grad"), ("inference_mode", "inference_mode"),
                                               ("no_grad", "inference_mode")])
def test_the_step_is_compiled_off_the_users_thread_and_switched_to_when_ready(fed_in, stepped_in):
    # the user's thread keeps stepping eagerly while the compile is held in the compiler's thread;
    # once released, the same decoder runs the compiled code, bit for bit what the eager step
    # computes; under no_grad or inference_mode alike, caches filled in either (Dynamo guards on
    # the mode and on each tensor's dispatch keys: the replica and the step's inputs are copied
    # as inference tensors where the user's are, and compiled under the user's mode)
    model = make_tiny_llama(torch.float32)
    backend = Traced(hold=True)
    compiler = StepCompiler(model, backend=backend)
    decoder, eager = Decoder(model).switch_to(compiler.step()), Decoder(model)
    with GRAD_MODES[fed_in]():
        mine, reference = fed(model), fed(model)
    with GRAD_MODES[stepped_in]():
        kinds = []
        for t in range(6):  # the first asks; the compile is held: every step returns at once, eagerly
            started = time.monotonic()
            assert torch.equal(step(decoder, mine, t), step(eager, reference, t))
            assert time.monotonic() - started < WAIT_S / 2
            kinds.append(decoder.compiled.kind)
            if t == 0:
                assert backend.entered.wait(WAIT_S)  # Dynamo traced the replica: the backend holds the compile
        assert kinds == ["compiling"] * 6 and backend.threads == ["h2o-compile"]
        backend.go.set()
        assert compiler.wait(WAIT_S)
        for t in range(6, 30):
            assert torch.equal(step(decoder, mine, t), step(eager, reference, t))
            assert decoder.compiled.kind == "compiled"
    assert backend.threads == ["h2o-compile"]  # nothing compiled on the user's thread
    for i in range(len(mine.layers)):
        assert torch.equal(mine.token_ids(i), reference.token_ids(i))


def test_stacked_rows_are_compiled_shape_by_shape_in_the_background():
    # a lone conversation, then two stacked, then one of them sitting out: each shape asks once,
    # is compiled on a replica in the compiler's thread, and runs compiled afterwards; the logits
    # are the eager step's throughout
    model = make_tiny_llama(torch.float32)
    backend = Traced(hold=True)  # each compile waits for `go`: "compiling" does not race the steps
    compiler = StepCompiler(model, backend=backend)
    decoder, eager = Decoder(model).switch_to(compiler.step()), Decoder(model)

    with torch.no_grad():
        mine, reference = (fed(model), fed(model)), (fed(model), fed(model))
        t = 0
        for shape in ("alone", "two stacked", "one sits out"):
            for rounds in ("asks", "compiled"):
                for _ in range(5):
                    assert torch.equal(step_as(decoder, *mine, t, shape), step_as(eager, *reference, t, shape)), (shape, t)
                    assert decoder.compiled.kind == ("compiled" if rounds == "compiled" else "compiling"), (shape, t)
                    t += 1
                backend.go.set()
                assert compiler.wait(WAIT_S)
                backend.go.clear()
    assert backend.threads == ["h2o-compile"] * 3 and len(compiler.ready) == 3


def test_a_shape_that_fails_to_compile_stays_eager_and_the_others_run_compiled(caplog):
    # the second shape's compile fails after the first's succeeded: that shape runs eagerly from
    # then on (asked once, said once), the first keeps running compiled and a third still compiles
    model = make_tiny_llama(torch.float32)
    backend = Traced(fail={2})
    compiler = StepCompiler(model, backend=backend)
    decoder, eager = Decoder(model).switch_to(compiler.step()), Decoder(model)

    kinds = {}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="h2o_chat"):
        mine, reference = (fed(model), fed(model)), (fed(model), fed(model))
        t = 0
        for shape in ("alone", "two stacked", "one sits out", "alone", "two stacked"):
            assert torch.equal(step_as(decoder, *mine, t, shape), step_as(eager, *reference, t, shape)), (shape, t)
            assert compiler.wait(WAIT_S)
            for _ in range(3):
                t += 1
                assert torch.equal(step_as(decoder, *mine, t, shape), step_as(eager, *reference, t, shape)), (shape, t)
                kinds.setdefault(shape, set()).add(decoder.compiled.kind)
    assert kinds == {"alone": {"compiled"}, "two stacked": {"eager"}, "one sits out": {"compiled"}}
    assert compiler.failed is None and len(compiler.ready) == 2 and len(compiler.asked - compiler.ready) == 1
    assert len(backend.threads) == 3  # the failed shape was not asked for again
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert lines == ["h2o-chat: one shape of the decode step stays eager (stacked, 2 rows): compiling it failed "
                     "(RuntimeError: no kernel for this op)"]


def test_a_session_switches_to_the_compiled_step_and_replies_as_an_off_session():
    # the session's first reply runs eagerly while its step is compiled; its second runs compiled
    # (the stats line says which); greedy replies are the same tokens as an `off` session's
    model, tokenizer = make_tiny_chat()
    backend = Traced()
    step_compiler(model, "on", backend=backend)  # the model's compiler, with the counting backend
    on, off = ChatSession(model, tokenizer, compile="on", **GREEDY), ChatSession(model, tokenizer, compile="off", **GREEDY)
    assert on.stats["step"] == "eager" and off.stats["step"] == "eager"  # nothing asked yet
    for text in ("Hello there, how are you?", "Tell me more."):
        replies = ["".join(s.send(text)) for s in (on, off)]
        assert replies[0] == replies[1]
        assert on.ledger.vocab_ids == off.ledger.vocab_ids
        if text.startswith("Hello"):
            assert on.stats["step"] in ("compiling", "compiled")
            assert on.compiler.wait(WAIT_S)
    assert on.stats["step"] == "compiled" and off.stats["step"] == "eager"
    assert off.compiler is None and backend.threads == ["h2o-compile"]


def test_two_sessions_in_a_batch_switch_to_their_compiled_step(tmp_path):
    # the app's path: sessions decoded together by a Batcher (compile="on"); each shape the batch
    # runs is compiled in the background; the replies are the same tokens as sessions' alone
    # with compile off, and the stats say the batch's step is compiled
    model, tokenizer = make_tiny_chat()
    backend = Traced()
    step_compiler(model, "on", backend=backend)
    batcher = Batcher(model, 2, gather_s=0.05, compile="on")
    texts = ["Hello there, how are you?", "What is a lighthouse?"]
    batched = [ChatSession(model, tokenizer, batcher=batcher, compile="on", **GREEDY) for _ in texts]
    alone = [ChatSession(model, tokenizer, compile="off", **GREEDY) for _ in texts]
    for turn in range(3):
        replies = [None, None]

        def reply(i, turn=turn, replies=replies):
            replies[i] = "".join(batched[i].send(texts[i] if turn == 0 else "Go on."))

        run_threads(reply, 2, WAIT_S)
        assert replies == ["".join(s.send(texts[i] if turn == 0 else "Go on.")) for i, s in enumerate(alone)]
        assert batcher.decoder.compiled.compiler.wait(WAIT_S)
    assert all(s.stats["step"] == "compiled" for s in batched) and batcher.largest_batch == 2
    assert set(backend.threads) == {"h2o-compile"}


def test_the_stats_line_says_which_step_runs(tiny_chat):
    from h2o_chat.ui import draw

    session = ChatSession(*tiny_chat, compile="off", **GREEDY)
    "".join(session.send("Hi"))
    assert draw.stats_markdown(session.stats, session.ledger.retention(session.cache)).split("\n")[0].endswith(
        " · eager step")


def test_auto_on_a_cpu_stays_eager_with_one_log_line(tiny_chat, caplog):
    model, tokenizer = tiny_chat
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        sessions = [ChatSession(model, tokenizer, compile="auto", **GREEDY) for _ in range(2)]
        batcher = Batcher(model, 2, compile="auto")
        "".join(sessions[0].send("Hi"))
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert len(lines) == 1 and "CUDA GPU only" in lines[0] and "0.89x" in lines[0], lines
    assert all(s.compiler is None and s.stats["step"] == "eager" for s in sessions)
    assert batcher.decoder.compiled is None
    assert Compilation().compile == "auto"
    with pytest.raises(ValueError, match="choose one of auto, on, off"):
        ChatSession(model, tokenizer, compile="yes")


def test_what_it_cannot_compile_stays_eager_with_one_log_line(caplog):
    # a model the lean step cannot run; a compile that fails in the compiler's thread: each says
    # why in one line, and the session replies (eagerly) as an `off` one
    model, tokenizer = make_tiny_chat()
    unfit, _ = make_tiny_chat()
    unfit.model.layers[0].mlp.up_proj.__class__ = FakeQuantLinear
    backend = Traced(fail=True)
    step_compiler(model, "on", backend=backend)
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        assert ChatSession(unfit, tokenizer, compile="on").compiler is None
        on, off = ChatSession(model, tokenizer, compile="on", **GREEDY), ChatSession(model, tokenizer, compile="off", **GREEDY)
        for text in ("Hello there, how are you?", "Tell me more."):
            assert "".join(on.send(text)) == "".join(off.send(text))
            assert on.compiler.wait(WAIT_S)
        assert ChatSession(model, tokenizer, compile="on").compiler is None  # failed once: eager from then on
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert len(lines) == 2, lines
    assert lines[0] == "h2o-chat: the decode step stays eager: the lean step cannot run this model (quantized linear layers)"
    assert lines[1] == "h2o-chat: the decode step stays eager: compiling it failed (RuntimeError: no kernel for this op)"
    assert on.stats["step"] == "eager" and backend.threads == ["h2o-compile"]


def test_the_page_and_the_api_make_their_sessions_with_the_apps_setting(tmp_path):
    # every way the app makes a session (the page's new and reopened chats, the API's chat and
    # text sessions and its saved ones) passes on --compile
    from h2o_chat.serve.api import create_router
    from h2o_chat.ui.state import App

    model, tokenizer = make_tiny_chat()
    step_compiler(model, "on", backend=Traced())
    for compile in ("on", "off"):
        api = create_router(model, tokenizer, {}, str(tmp_path), compile=compile).api
        app = App(model, tokenizer, {}, str(tmp_path), chat_defaults=dict(max_new_tokens=4), compile=compile)
        chat = app.new_session()
        "".join(chat.send("Hi"))  # saved in the data folder: it can be reopened
        sessions = [chat, app.open(chat.id), api.make_session("chat", {}, None), api.make_session("text", {}, None),
                    api.open_saved(chat.id)]
        assert [s.compiler is not None for s in sessions] == [compile == "on"] * 5, compile


def test_the_app_flag_is_the_declared_setting():
    import app

    assert app.parse_args([]).compile == Compilation().compile == "auto"
    assert app.parse_args(["--compile", "off"]).compile == "off"
    with pytest.raises(SystemExit), contextlib.redirect_stderr(open(os.devnull, "w")):
        app.parse_args(["--compile", "maybe"])


@pytest.mark.slow
def test_inductors_compiled_step_replies_as_the_eager_one():
    # the real compiler (inductor's C++ kernels, float32): the same greedy tokens as an `off`
    # session, the compiled step running from the second reply on
    model, tokenizer = make_tiny_chat()
    on, off = ChatSession(model, tokenizer, compile="on", **GREEDY), ChatSession(model, tokenizer, compile="off", **GREEDY)
    for text in ("Hello there, how are you?", "Tell me more.", "And then?"):
        assert "".join(on.send(text)) == "".join(off.send(text))
        assert on.ledger.vocab_ids == off.ledger.vocab_ids
        assert on.compiler.wait(600)
    assert on.stats["step"] == "compiled"


START = """
import json, sys, time, torch
from h2o_chat.chat.session import ChatSession
from h2o_chat.models.compile import CACHE_FOLDER
from tests.conftest import make_tiny_chat
from torch._dynamo.utils import counters
model, tokenizer = make_tiny_chat()
session = ChatSession(model, tokenizer, data_dir=sys.argv[1], compile="on", temperature=0, max_new_tokens=8,
                      cache={"budget": 24, "n_sink": 2, "n_recent": 8})
"".join(session.send("Hello there, how are you?"))
assert session.compiler.wait(600)
print(json.dumps({"seconds": [s for _, s in session.compiler.compiles], "inductor": dict(counters["inductor"]),
                  "aot": dict(counters["aot_autograd"])}))
"""


@pytest.mark.slow
def test_a_second_start_reuses_the_compiled_kernels_from_the_data_folder(tmp_path):
    # two processes with the same data folder: the first compiles (inductor's FX graph cache
    # misses, and is written in <data>/compiled), the second finds its kernels there (a hit, no
    # miss): inductor's own counters, not a timing
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    root = Path(__file__).resolve().parent.parent
    starts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", START, str(tmp_path)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = starts
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1 and first["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert any((tmp_path / "compiled" / "fxgraph").iterdir())
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1 and second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["aot"].get("autograd_cache_hit", 0) >= 1
    print(f"time to compiled: first start {first['seconds']}, second {second['seconds']}")
