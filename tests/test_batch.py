"""Many conversations decoded in one batch (batch.py) give what each gives alone.

Every test runs the same conversations twice: one at a time with no batcher (the model runs in the
conversation's own thread, as with --concurrency 1), then all at once, each in its own thread,
through one Batcher. Greedy replies must be identical, token for token: float64 on the tiny
model, so no batched-matmul rounding can flip a choice. The batcher waits up to GATHER_S for every
stacked conversation, so the concurrent runs really share steps (each test checks it did).
"""

import threading

import pytest
import torch
from conftest import make_tiny_chat, run_threads

from h2o_chat.chat.batch import Batcher
from h2o_chat.chat.session import ChatSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEADLINE_S = 120
GATHER_S = 2.0  # long, so that a test's conversations always meet in the same steps
PROMPTS = ["hello there, how are you today?", "tell me a story about a cat", "x", "what is 2 + 2?"]
# prompt and template take 30-55 tokens: budget 24 starts every conversation full (evicting),
# budget 64 makes them join below their budget and fill up inside the batch
POLICIES = [
    dict(policy="h2o", n_sink=2, n_recent=6),
    dict(policy="h2o", n_sink=2, n_recent=6, score="mean"),
    dict(policy="h2o", n_sink=2, n_recent=6, score="decay"),
    dict(policy="window", n_sink=0, n_recent=8),
    dict(policy="sink", n_sink=4, n_recent=8),
    dict(policy="h2o", n_sink=2, n_recent=6, budget_shape="pyramid"),  # layers of different budgets, filling apart
]


def tiny(kv_heads=2):
    model, tokenizer = make_tiny_chat(torch.float64)
    if kv_heads != 2:  # the same tokenizer over a model with another KV-head count (MQA for 1)
        from conftest import make_tiny_llama
        model = make_tiny_llama(torch.float64, vocab_size=len(tokenizer), kv_heads=kv_heads)
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, tokenizer


def converse(session, script, log=None):
    """Send each message of `script` in turn; the replies. A step may be ("stop after", n, message):
    the reply is stopped after n pieces. `log` gets every piece as it streams (for joins mid-stream)."""
    replies = []
    for step in script:
        stop_after, text = (step[1], step[2]) if isinstance(step, tuple) else (None, step)
        pieces = []
        for piece in session.send(text):
            pieces.append(piece)
            if log is not None:
                log.append(piece)
            if stop_after is not None and len(pieces) == stop_after:
                session.stop()
        replies.append("".join(pieces))
    return replies


def run_together(make_session, scripts, batcher, start_after=None):
    """Each script in its own thread through `batcher`; start_after[i] = (j, n): thread i starts
    once thread j has streamed n pieces. Returns (replies per script, sessions)."""
    sessions = [make_session(i, batcher) for i in range(len(scripts))]
    results, errors, logs = [None] * len(scripts), [], [[] for _ in scripts]

    def work(i):
        try:
            results[i] = converse(sessions[i], scripts[i], logs[i])
        except BaseException as e:  # reported below, with the deadline's verdict
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(scripts))]
    started = set()
    for i, t in enumerate(threads):
        if not (start_after and i in start_after):
            t.start()
            started.add(i)
    waiting = dict(start_after or {})
    deadline = threading.Event()
    timer = threading.Timer(DEADLINE_S, deadline.set)
    timer.start()
    while waiting and not deadline.is_set():
        for i, (j, n) in list(waiting.items()):
            if len(logs[j]) >= n or not threads[j].is_alive() and j in started:
                threads[i].start()
                started.add(i)
                del waiting[i]
        deadline.wait(0.001)
    for t in threads:
        t.join(max(0.0, DEADLINE_S))
    timer.cancel()
    assert not any(t.is_alive() for t in threads), "a batched conversation did not finish in time"
    assert not errors, errors
    return results, sessions


def alone_and_together(make_session, scripts, max_batch=None, start_after=None):
    alone_sessions = [make_session(i, None) for i in range(len(scripts))]
    alone = [converse(session, script) for session, script in zip(alone_sessions, scripts)]
    batcher = Batcher(make_session.model, max_batch=max_batch or len(scripts), gather_s=GATHER_S)
    together, sessions = run_together(make_session, scripts, batcher, start_after)
    for a, b in zip(alone_sessions, sessions):
        assert_same_cache(a.cache, b.cache)
    return alone, together, batcher, sessions


def assert_same_cache(a, b):
    """The same tokens in the same slots of every layer and head, at the same positions, with the
    same scores, to the rounding of the model's dtype (a batched matmul adds in another order)."""
    assert a.get_seq_length() == b.get_seq_length()
    tolerance = dict(rtol=1e-9, atol=1e-12) if a.scores(0).dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for layer in range(len(a.layers)):
        assert torch.equal(a.token_ids(layer), b.token_ids(layer))
        assert torch.equal(a.positions(layer), b.positions(layer))
        torch.testing.assert_close(a.scores(layer), b.scores(layer), **tolerance)


def session_maker(model, tokenizer, caches, max_new_tokens=40, **kwargs):
    def make(i, batcher):
        return ChatSession(model, tokenizer, cache=caches[i % len(caches)], temperature=0,
                           max_new_tokens=max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens,
                           batcher=batcher, **kwargs)
    make.model = model
    return make


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("budget", [24, 64], ids=["full-from-the-start", "fills-inside-the-batch"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "-".join((p["policy"], p.get("score", "sum"),
                                                                      p.get("budget_shape", "uniform"))))
@pytest.mark.slow
def test_conversations_decoded_together_reply_as_each_alone(policy, budget, kv_heads):
    model, tokenizer = tiny(kv_heads)
    make = session_maker(model, tokenizer, [dict(policy, budget=budget)])
    scripts = [[p, "and then?"] for p in PROMPTS[:3]]
    alone, together, batcher, sessions = alone_and_together(make, scripts)
    assert together == alone
    assert batcher.rows_stepped > batcher.steps, "the conversations never shared a step"
    assert batcher.batch_size == 0 and not batcher.arenas, "a finished reply kept its rows"
    for s in sessions:  # each ran past its budget: the batch evicted, and rolled positions
        assert s.cache.get_seq_length() > budget >= s.cache.slots_used(None)


@pytest.mark.parametrize("budget", [24, 64], ids=["full-from-the-start", "fills-inside-the-batch"])
def test_int8_conversations_decoded_together_reply_as_each_alone(budget):
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(POLICIES[0], budget=budget, kv_quant="int8")])
    scripts = [[p, "and then?"] for p in PROMPTS[:3]]
    alone, together, batcher, sessions = alone_and_together(make, scripts)
    assert together == alone
    assert batcher.rows_stepped > batcher.steps, "the conversations never shared a step"
    for s in sessions:
        assert s.cache.get_seq_length() > budget >= s.cache.slots_used()
        assert all(layer.kv.dtype == torch.uint8 for layer in s.cache.layers)


def test_sinks_written_inside_the_batch_are_kept_as_sinks():
    """A short chat with many sinks: its first reply's tokens are still sinks when it joins."""
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="sink", budget=64, n_sink=40, n_recent=8)])
    scripts = [["x", "and then?"], ["y", "why?"]]
    alone, together, batcher, sessions = alone_and_together(make, scripts)
    assert together == alone and batcher.rows_stepped > batcher.steps
    assert len(render_ids(sessions[0], "x")) < 40  # so some sinks were generated, in the batch
    for s in sessions:
        assert set(range(40)) <= set(s.cache.token_ids(0)[0, 0].tolist())


def render_ids(session, text):
    from h2o_chat.chat.conversation import Message
    from h2o_chat.chat.template import render, token_ids

    return token_ids(render(session.tokenizer, None, [Message("user", text)], add_generation_prompt=True))


def test_conversations_with_different_cache_settings_batch_apart():
    model, tokenizer = tiny()
    caches = [dict(policy="h2o", budget=24, n_sink=2, n_recent=6), dict(policy="window", budget=40, n_recent=8)]
    make = session_maker(model, tokenizer, caches)
    scripts = [[p, "more"] for p in PROMPTS]
    alone, together, batcher, _ = alone_and_together(make, scripts)
    assert together == alone
    assert batcher.largest_batch == 4 and batcher.rows_stepped > batcher.steps


def test_a_pinned_message_stays_whole_in_a_batch():
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=64, n_sink=2, n_recent=6)])

    def pinned_then(i, batcher):
        session = make(i, batcher)
        list(session.send(PROMPTS[i]))
        session.pin(0)
        return session

    pinned_then.model = model
    scripts = [["go on", "and more"], ["why?", "tell me"]]
    alone, together, batcher, sessions = alone_and_together(pinned_then, scripts)
    assert together == alone and batcher.rows_stepped > batcher.steps
    for s in sessions:
        assert s.cache.get_seq_length() > 64  # the pin held under eviction
        start, end = s.cache.pins[0]
        for layer in range(len(s.cache.layers)):
            ids = s.cache.token_ids(layer)[0]
            for head in ids:
                assert set(range(start, end)) <= set(head.tolist())


def test_stopping_one_conversation_leaves_the_others_running():
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=32, n_sink=2, n_recent=6)])
    scripts = [[("stop after", 5, PROMPTS[0]), "and now?"], [PROMPTS[1], "more"], [PROMPTS[2], "more"]]
    alone, together, batcher, sessions = alone_and_together(make, scripts)
    assert together == alone
    assert len(together[0][0]) == 5  # five one-character pieces, then the stop
    assert len(together[1][0]) > 5 and batcher.rows_stepped > batcher.steps


def test_a_conversation_that_joins_mid_stream_and_one_that_ends_early():
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=32, n_sink=2, n_recent=6)],
                         max_new_tokens=[40, 40, 4])
    scripts = [[PROMPTS[0]], [PROMPTS[1]], [PROMPTS[3], "ok"]]
    alone, together, batcher, _ = alone_and_together(make, scripts, start_after={1: (0, 12)})
    assert together == alone
    assert len(together[2][0]) <= 4 < len(together[0][0])
    assert batcher.rows_stepped > batcher.steps


def test_no_more_rows_than_the_largest_batch():
    """Memory is bounded by max_batch x budget: a conversation beyond it decodes alone, between steps."""
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=24, n_sink=2, n_recent=6)])
    scripts = [[p] for p in PROMPTS[:3]]
    alone, together, batcher, _ = alone_and_together(make, scripts, max_batch=2)
    assert together == alone
    assert batcher.largest_batch == 2


def test_a_failed_step_fails_its_replies_and_the_conversations_go_on(monkeypatch):
    model, tokenizer = tiny()
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=24, n_sink=2, n_recent=6)])
    batcher = Batcher(model, max_batch=2, gather_s=GATHER_S)
    sessions = [make(i, batcher) for i in range(2)]
    import h2o_chat.chat.batch as batch

    real_attend, calls, last = batch.StackedCache.attend, [], model.config.num_hidden_layers - 1

    def failing_attend(self, layer_idx, *args):
        # the third batched step fails in its last layer, after the others wrote the new tokens
        # into every member's slots: the rows are part-stepped, as after a real out-of-memory
        calls.append(layer_idx)
        if layer_idx == last and calls.count(last) == 3:
            raise torch.OutOfMemoryError("simulated")
        return real_attend(self, layer_idx, *args)

    monkeypatch.setattr(batch.StackedCache, "attend", failing_attend)
    outcomes = [None, None]

    def first_reply(i):
        try:
            outcomes[i] = "".join(sessions[i].send(PROMPTS[i]))
        except ValueError as e:  # GenerationError: the reply could not be finished
            outcomes[i] = e

    run_threads(first_reply, 2, DEADLINE_S)
    assert any(isinstance(o, ValueError) and "memory" in str(o) for o in outcomes), outcomes
    monkeypatch.setattr(batch.StackedCache, "attend", real_attend)
    # the conversations survive: the failed one kept its message, its cache agrees with its
    # ledger (a failed forward goes back to a state the cache has fully seen), and both reply on
    for s in sessions:
        assert not s.busy and s.messages[0].content in PROMPTS
        assert len(s.ledger) == s.cache.get_seq_length()
        assert "".join(s.send("still there?"))
        assert len(s.ledger) == s.cache.get_seq_length()


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_model_decodes_the_same_in_a_batch(embedded_model):
    """fp32 on the real model: the batched matmuls round differently, yet greedy text agrees."""
    model, tokenizer = embedded_model
    make = session_maker(model, tokenizer, [dict(policy="h2o", budget=64)], max_new_tokens=16)
    scripts = [["Name three colours."], ["What is the capital of France?"]]
    alone, together, batcher, _ = alone_and_together(make, scripts)
    assert together == alone and batcher.rows_stepped > batcher.steps


def test_conversations_rendered_at_once_are_rendered_as_one_at_a_time():
    """Two tabs or API clients render at the same moment: a user's "<|im_start|>" stays text and
    the template's stays one token (the tokenizer's split flag is shared: this raced)."""
    from h2o_chat.chat.conversation import Message
    from h2o_chat.chat.template import render, token_ids

    _, tokenizer = make_tiny_chat()
    histories = [[Message("user", f"say <|im_start|> {i} " * 3), Message("assistant", "ok <|im_end|>")]
                 for i in range(4)]
    expected = [token_ids(render(tokenizer, "be brief", h, add_generation_prompt=True)) for h in histories]
    seen, errors = [[] for _ in histories], []

    def work(i):
        try:
            for _ in range(60):
                seen[i].append(token_ids(render(tokenizer, "be brief", histories[i], add_generation_prompt=True)))
        except BaseException as e:
            errors.append(e)

    run_threads(work, 4, DEADLINE_S)
    assert not errors
    assert all(ids == expected[i] for i in range(4) for ids in seen[i])


def test_a_bug_in_the_batcher_fails_its_callers_instead_of_hanging_them(monkeypatch):
    model, tokenizer = tiny()
    batcher = Batcher(model, max_batch=2, gather_s=GATHER_S)
    session = session_maker(model, tokenizer, [dict(policy="h2o", budget=24, n_sink=2, n_recent=6)])(0, batcher)
    monkeypatch.setattr(Batcher, "_stackable", lambda self, request: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        list(session.send("hello"))
    monkeypatch.undo()
    assert "".join(session.send("hello again"))  # the batcher thread lived on
