"""The cache's state saved beside its conversation (chat/saved_kv.py): a reopened conversation
loads it bit for bit and replies as if it had never been closed; a file that does not belong (another
model, other settings, truncated, garbled, the wrong shape, a newer format) is refused with a
notice and the conversation is replayed, whole; older branches resume from saved boundaries, a
fork's too; the disk budget holds; deleting a conversation deletes its files. The same through
/v1 (the pool reopens what it dropped) and across a server killed with SIGKILL."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from h2o_chat import ChatSession
from h2o_chat.bench.reopen import openwebui_branches
from h2o_chat.cache.h2o import pack_meta
from h2o_chat.chat import saved_kv, store
from h2o_chat.models.load import load_model
from h2o_chat.serve import cli
from h2o_chat.serve.pool import SessionPool
from tests.conftest import make_tiny_chat
from tests.live import free_port, save_tiny_chat
from tests.test_reuse import make_tiny_bpe_chat, pieces, scripted

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parent.parent
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16)
TURNS = ["A lighthouse on a cliff, " * 3, "Who keeps it? " * 4, "A storm comes in. " * 3, "The keeper waits. " * 3]
DEADLINE_S = 120


def greedy(model, tok, data_dir, cache=CACHE, **kwargs):
    return ChatSession(model, tok, cache=cache, temperature=0, max_new_tokens=12, data_dir=data_dir, **kwargs)


def story(session, turns=TURNS):
    return ["".join(session.send(t)) for t in turns]


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_same_state(a, b):
    """Every layer's buffers bit for bit (keys, values, the slots' ids, positions and scores), the
    counts, pins, limits, logits and the token ledger."""
    for x, y in zip(a.cache.layers, b.cache.layers, strict=True):
        assert (x.n_seen, x.n_slots, x.roll_floor) == (y.n_seen, y.n_slots, y.roll_floor)
        assert torch.equal(bits(x.kv), bits(y.kv)) and torch.equal(x.meta, y.meta) and torch.equal(bits(x.acc), bits(y.acc))
    assert a.cache.pins == b.cache.pins and a.cache.limits == b.cache.limits
    assert torch.equal(bits(a.timeline.logits), bits(b.timeline.logits))
    assert a.ledger == b.ledger


def state_files(data_dir, conversation_id):
    folder = store.kv_folder(data_dir, conversation_id)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def newest(data_dir, conversation_id):
    return max(state_files(data_dir, conversation_id), key=lambda p: saved_kv.parse_name(p.name)[0])


# --- reopening ----------------------------------------------------------------------------------

@pytest.mark.parametrize("budget_shape", ["uniform", "pyramid"])
def test_a_reopened_conversation_loads_its_cache_bit_for_bit_and_replies_as_if_never_closed(tmp_path, budget_shape):
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path, cache=dict(CACHE, budget_shape=budget_shape))
    story(session)
    saved_kv.flush()
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.timeline.tokens_processed == 0 and reopened.take_notices() == []  # loaded, nothing replayed
    assert_same_state(session, reopened)
    assert reopened.cache.limits.layers == (None if budget_shape == "uniform" else (18 + 59, 18 + 1))  # 30 heavy: 58.5, 1.5
    for text in ("And then? " * 2, "The end."):
        assert "".join(reopened.send(text)) == "".join(session.send(text))  # token for token
        assert reopened.ledger.vocab_ids == session.ledger.vocab_ids
    assert_same_state(session, reopened)


def test_a_reopened_state_is_not_written_again_until_it_changes(tmp_path):
    """A conversation opened and closed untouched (a tab that looked, an idle drop) writes nothing:
    the state it loaded is the one on disk. The next reply writes again."""
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:2])
    session.close()
    assert saved_kv.flush(DEADLINE_S)
    files, last_write = state_files(tmp_path, session.id), saved_kv.WRITER.written[-1]
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.timeline.tokens_processed == 0
    reopened.autosave()
    reopened.close()
    assert saved_kv.flush(DEADLINE_S)
    assert saved_kv.WRITER.written[-1] is last_write and state_files(tmp_path, session.id) == files
    again = ChatSession.open(model, tok, session.id, tmp_path)
    "".join(again.send("And then?"))
    assert saved_kv.flush(DEADLINE_S)
    assert len(state_files(tmp_path, session.id)) > len(files)


def test_the_page_opens_a_saved_conversation_from_its_cache(tmp_path):
    from h2o_chat.ui.state import App

    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:2])
    saved_kv.flush()
    shown = []
    opened = App(model, tok, dict(CACHE), str(tmp_path)).open(session.id, lambda share, desc: shown.append(share))
    assert opened.timeline.tokens_processed == 0 and shown == [1.0]  # one step of the bar: loaded, not replayed
    assert_same_state(session, opened)


def test_the_replies_come_back_as_the_tokens_they_were_drawn_as(tmp_path):
    """A reply drawn as "t", "he" re-tokenizes as "the": without the saved reply ids the reopened
    rendering would differ from the cache there and everything after it would be replayed."""
    model, tok = make_tiny_bpe_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=40, data_dir=tmp_path)
    scripted(session, pieces(tok, "the other hen"))
    assert "".join(session.send("Tell me about the farm.")) == "the other hen"
    saved_kv.flush()
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.timeline.tokens_processed == 0 and reopened.ledger == session.ledger


def test_a_seeded_conversation_draws_on_from_its_saved_generator(tmp_path):
    model, tok = make_tiny_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=1.0, top_p=1.0, seed=7, max_new_tokens=12,
                          data_dir=tmp_path)
    story(session, TURNS[:2])
    saved_kv.flush()
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert torch.equal(reopened._sampler.generator.get_state(), session._sampler.generator.get_state())
    assert "".join(reopened.send("Next.")) == "".join(session.send("Next."))


def test_a_reply_does_not_wait_for_its_state_to_reach_the_disk(tmp_path, monkeypatch):
    model, tok = make_tiny_chat()
    release, writing = threading.Event(), threading.Event()
    real = saved_kv.write_atomically

    def slow_disk(path, data):
        writing.set()
        assert release.wait(DEADLINE_S)
        real(path, data)

    monkeypatch.setattr(saved_kv, "write_atomically", slow_disk)
    session = greedy(model, tok, tmp_path)
    try:
        story(session, TURNS[:2])  # two replies end while the disk is stuck on the first state
        # the writer thread may reach the disk after the replies ended (a busy machine): wait for it
        assert writing.wait(DEADLINE_S) and not state_files(tmp_path, session.id)
    finally:
        release.set()
    assert saved_kv.flush(DEADLINE_S)
    assert saved_kv.parse_name(newest(tmp_path, session.id).name)[0] == len(session.ledger)


# --- what does not belong is refused ---------------------------------------------------------------

def rewrite(path, change):
    """Read a state file, let `change(tensors, meta)` alter it, write it back (checksum redone)."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors, meta)
    meta["checksum"] = saved_kv.checksum(tensors)
    path.write_bytes(safetensors_bytes(tensors, meta))


def damage(how):
    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def garble(path):
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))

    def wrong_shape(path):
        rewrite(path, lambda tensors, meta: tensors.update({"layer.0.kv": tensors["layer.0.kv"][:, :, :1, :, :8].contiguous()}))

    def newer(path):
        rewrite(path, lambda tensors, meta: meta.update(format="99"))

    def not_ours(path):
        path.write_bytes(b"not a safetensors file at all")

    return {"truncated": truncate, "garbled": garble, "wrong shape": wrong_shape, "newer format": newer,
            "not a cache file": not_ours}[how]


def replayed_reference(model, tok, session):
    """The same conversation replayed into a fresh cache, with no data folder: what a refused file must leave."""
    return ChatSession.from_conversation(model, tok, store.read(session.data_dir, session.id))


@pytest.mark.parametrize("how, notice", [
    ("truncated", "could not be read (the file is truncated or garbled)"),
    ("not a cache file", "could not be read (the file is truncated or garbled)"),
    ("garbled", "could not be read (its contents do not match their checksum)"),
    ("wrong shape", "could not be read (keys and values of shape [2, 1, 1, 49, 8], the model has 2 KV heads of 16)"),
    ("newer format", "was written by a newer h2o-chat (format 99, this one reads 1)"),
])
def test_a_damaged_or_newer_file_is_refused_with_a_notice_and_the_conversation_replayed(tmp_path, how, notice):
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:3])
    saved_kv.flush()
    for path in state_files(tmp_path, session.id):  # every state, so that none can stand in
        damage(how)(path)
    before = store.load(tmp_path, session.id)
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.take_notices() == [f"The saved cache {notice}: replaying the conversation."]
    assert reopened.timeline.tokens_processed == len(reopened.ledger) == len(session.ledger)  # a whole replay
    assert_same_state(reopened, replayed_reference(model, tok, session))  # nothing of the file was loaded
    assert reopened.history == session.history and store.load(tmp_path, session.id) == before  # nothing lost
    if how == "newer format":
        assert all(p.exists() for p in state_files(tmp_path, session.id))  # a newer version can still read them
    else:
        assert not state_files(tmp_path, session.id)  # never readable: removed


def test_another_model_or_other_settings_is_refused_with_a_notice_and_a_replay(tmp_path):
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:3])
    saved_kv.flush()
    other, _ = make_tiny_chat(seed=1)  # the same config, other weights
    reopened = ChatSession.open(other, tok, session.id, tmp_path)
    assert reopened.take_notices() == ["The saved cache belongs to another model: replaying the conversation."]
    assert reopened.timeline.tokens_processed == len(reopened.ledger)
    assert_same_state(reopened, ChatSession.from_conversation(other, tok, store.read(tmp_path, session.id)))

    conversation = store.read(tmp_path, session.id)  # the user changed the budget in another session
    conversation.settings.cache.budget = 40
    store.write(tmp_path, conversation)
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.take_notices() == ["The saved cache was made with other cache settings: replaying the "
                                       "conversation."]
    assert reopened.timeline.tokens_processed == len(reopened.ledger) and reopened.cache.limits.budget == 40


def test_settings_changed_in_the_session_replay_without_a_notice(tmp_path):
    # the page's "Apply and replay": the states saved under the old settings cannot be used, which
    # is what the user just asked for, so no notice says it (reopening such a chat does: above)
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:3])
    saved_kv.flush()
    assert session.take_notices() == []
    session.configure(cache=dict(CACHE, budget=40))
    assert session.take_notices() == []
    assert session.timeline.tokens_processed == len(session.ledger) and session.cache.limits.budget == 40
    session.configure(cache=CACHE)  # back: the old settings' newest state is loaded, not replayed
    assert session.take_notices() == [] and session.timeline.tokens_processed == 0


def test_a_state_whose_pinned_tokens_were_evicted_is_not_used_for_the_pin(tmp_path):
    """Saved before message 2 was pinned: its tokens are gone from the cache, so the latest saved
    states cannot serve the pinned conversation, which is fed again from before them."""
    model, tok = make_tiny_chat()
    session = greedy(model, tok, tmp_path)
    story(session, [TURNS[0], "Hi.", *TURNS[1:3]])
    saved_kv.flush()
    assert not any(t in head for layer in session.cache.layers for head in layer.token_ids[0].tolist()
                   for t in range(114, 117))  # message 2's words, evicted everywhere
    conversation = store.read(tmp_path, session.id)
    conversation.messages[2].pinned = True
    store.write(tmp_path, conversation)
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    ranges = reopened.cache.pins
    assert ranges == [(114, 117)] and 0 < reopened.timeline.tokens_processed < len(reopened.ledger)
    for layer in reopened.cache.layers:  # every pinned token held by every layer and KV head
        held = layer.token_ids[0].tolist()
        assert all(t in head for start, end in ranges for t in range(start, end) for head in held)


# --- branches resume ------------------------------------------------------------------------------

def test_regenerate_and_an_older_edit_after_a_reopen_start_from_saved_boundaries(tmp_path):
    model, tok = make_tiny_chat()
    never_closed = greedy(model, tok, tmp_path)
    story(never_closed)
    saved_kv.flush()
    reopened = ChatSession.open(model, tok, never_closed.id, tmp_path)

    assert "".join(reopened.regenerate()) == "".join(never_closed.regenerate())
    assert reopened.last_turn.prompt_computed == 0  # the state before the last reply came from disk
    assert reopened.timeline.tokens_processed == reopened.last_turn.new_tokens

    before = reopened.timeline.tokens_processed
    reopened.edit(2, "A calm night instead.")  # an older message: no in-memory snapshot reaches back there
    computed = reopened.timeline.tokens_processed - before
    kept = sum(1 for t in reopened.ledger.turns if t < 2)  # the first exchange: the saved state after its reply
    assert computed == len(reopened.ledger) - kept and kept > 0  # only what follows it, not a replay
    never_closed.edit(2, "A calm night instead.")
    assert_same_state(reopened, never_closed)
    assert "".join(reopened.send("Go on.")) == "".join(never_closed.send("Go on."))


def test_a_fork_finds_the_states_of_the_history_it_shares(tmp_path):
    """The pool forks a conversation whose older history a request rewrites (a new id): the
    states saved under the old id still serve it."""
    model, tok = make_tiny_chat()
    original = greedy(model, tok, tmp_path)
    story(original)
    saved_kv.flush()
    fork = ChatSession.open(model, tok, original.id, tmp_path, lazy=True)
    fork.conversation.become_fork()
    fork.messages = fork.messages[:3]  # the first exchange and the second message, resent
    "".join(fork.regenerate())
    assert fork.id != original.id
    assert fork.last_turn.prompt_computed == 0  # the state right before the second reply, saved by the original
    assert store.read(tmp_path, fork.id).forked_from == original.id


# --- bounded on disk ----------------------------------------------------------------------------------

def test_the_disk_budget_holds_over_a_hundred_conversations_and_delete_removes_every_file(tmp_path, monkeypatch):
    model, tok = make_tiny_chat()
    data = tmp_path / "data"
    monkeypatch.setattr(saved_kv, "BUDGET", saved_kv.DiskBudget(total_mib=1.0, conversation_mib=0.2))
    ids = []
    for i in range(100):
        session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=4, data_dir=data)
        story(session, [f"Conversation {i}: hello.", "Once more."])
        ids.append(session.id)
        if i % 10 == 9:
            saved_kv.flush()
            used, allowed = saved_kv.usage(data)
            assert 0 < used <= allowed == 2**20
            assert all(sum(p.stat().st_size for p in state_files(data, c)) <= 0.2 * 2**20 for c in ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing outside the data folder
    recent = ids[-1]
    assert state_files(data, recent)  # the least recently used went first: the newest is kept
    store.delete(data, recent)
    assert not any(recent in p.name for p in data.rglob("*"))  # its file, its lock, its saved caches
    assert not store.kv_folder(data, recent).exists() and store.list_ids(data)
    with pytest.raises(ValueError, match="invalid session id"):
        store.delete(data, "../data")


def test_a_conversation_deleted_while_its_state_is_queued_leaves_no_file(tmp_path, monkeypatch):
    model, tok = make_tiny_chat()
    release = threading.Event()
    real = saved_kv.write_atomically
    monkeypatch.setattr(saved_kv, "write_atomically", lambda path, data: (release.wait(DEADLINE_S), real(path, data)))
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:2])
    store.delete(tmp_path, session.id)
    release.set()
    saved_kv.flush()
    saved_kv.usage(tmp_path)  # the sweep removes what a write raced in after the delete
    assert not store.kv_folder(tmp_path, session.id).exists()


def test_the_disk_flag_takes_its_default_from_the_one_declaration():
    assert cli.parse_args([]).kv_disk_mib == saved_kv.DiskBudget().total_mib == 2048
    assert cli.parse_args(["--kv-disk-mib", "0.5"]).kv_disk_mib == 0.5


def test_no_disk_budget_saves_nothing_and_replays(tmp_path, monkeypatch):
    model, tok = make_tiny_chat()
    monkeypatch.setattr(saved_kv, "BUDGET", saved_kv.DiskBudget(total_mib=0))
    session = greedy(model, tok, tmp_path)
    story(session, TURNS[:2])
    saved_kv.flush()
    assert not store.kv_folder(tmp_path, session.id).exists()
    assert ChatSession.open(model, tok, session.id, tmp_path).timeline.tokens_processed == len(session.ledger)


# --- the /v1 pool ---------------------------------------------------------------------------------------

def test_the_pool_reopens_a_dropped_conversation_from_disk_as_if_never_dropped(tmp_path):
    model, tok = make_tiny_chat()

    def make(kind, cache, system):
        return ChatSession(model, tok, cache=cache, system_prompt=system, data_dir=tmp_path)

    def open_saved(conversation_id):
        return ChatSession.open(model, tok, conversation_id, tmp_path, lazy=True)

    pool = SessionPool(make, max_kv_bytes=0, data_dir=tmp_path, open_saved=open_saved)  # drops every idle session
    reference = greedy(model, tok, None)
    history = []
    for text in TURNS:
        history.append({"role": "user", "content": text, "pinned": False})
        session, forked = pool.acquire("chat", CACHE, None, history)
        session.configure(temperature=0, max_new_tokens=12)
        session.messages = [dict(m) for m in history[:-1]]
        reply = "".join(session.send(text))
        assert reply == "".join(reference.send(text)) and not forked
        assert session.last_turn.prompt_computed == reference.last_turn.prompt_computed  # the new message only
        pool.release(session)
        assert len(pool) == 0  # dropped at once
        history.append({"role": "assistant", "content": reply, "pinned": False})
    assert len(store.list_ids(tmp_path)) == 1  # one conversation throughout


@pytest.mark.live
@pytest.mark.slow
def test_an_older_branch_resent_through_v1_reuses_its_saved_state(tmp_path):
    from tests.test_api import api_server

    with api_server(tmp_path, max_kv_mib=0.01) as (url, _):  # the pool keeps nothing idle
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        for usage in openwebui_branches(client, "h2o-chat", max_tokens=12):
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens


# --- a real server, killed ------------------------------------------------------------------------------

def start_app(model_dir, data, port, log, *flags):
    return subprocess.Popen(
        [sys.executable, "app.py", "--model", str(model_dir), "--data-dir", str(data), "--port", str(port),
         "--dtype", "float32", "--concurrency", "1", "--budget", "48", "--n-sink", "2", "--n-recent", "16", *flags],
        cwd=REPO, stdout=log.open("a"), stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def wait_healthy(url, proc, log):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"app.py exited:\n{log.read_text()[-2000:]}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"app.py did not start:\n{log.read_text()[-2000:]}")


def kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.live
@pytest.mark.slow
def test_sigkill_then_restart_reopens_bit_for_bit_through_the_app_and_v1(tmp_path):
    """A server (dropping every idle conversation from memory) answers three turns through /v1 and
    is killed; its saved state is bitwise the one an uninterrupted session holds; a restarted
    server (and a session opened here) reply to the fourth turn token for token as it does."""
    model_dir = save_tiny_chat(tmp_path / "model")
    data, log = tmp_path / "data", tmp_path / "app.log"
    model, tok = load_model(model_dir, device="cpu", dtype="float32")
    reference = greedy(model, tok, None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_app(model_dir, data, port, log, "--api-kv-mib", "0.001")
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        messages = []
        for i, text in enumerate(TURNS[:3]):
            messages.append({"role": "user", "content": text})
            r = client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=12, temperature=0)
            assert r.choices[0].message.content == "".join(reference.send(text))
            if i:  # dropped from memory after each request, back from disk: only the new message computed
                cached = r.usage.prompt_tokens_details.cached_tokens
                assert cached == r.usage.prompt_tokens - reference.last_turn.prompt_computed > 0
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        (conversation_id,) = store.list_ids(data)
        deadline = time.monotonic() + DEADLINE_S  # the state of the last reply, written in the background
        while not any(saved_kv.parse_name(p.name)[0] == len(reference.ledger) for p in state_files(data, conversation_id)):
            assert time.monotonic() < deadline, "the last reply's state was never written"
            time.sleep(0.1)
    finally:
        kill(proc)

    # the file holds bit for bit what the uninterrupted session holds
    with safe_open(str(newest(data, conversation_id)), framework="pt") as f:
        for i, layer in enumerate(reference.cache.layers):
            assert torch.equal(bits(f.get_tensor(f"layer.{i}.kv")), bits(layer.kv))
            assert torch.equal(f.get_tensor(f"layer.{i}.meta"), pack_meta(layer.meta, layer.acc))  # the format of before

    # a session opened here (on a copy: the restarted server gets the folder as the kill left it)
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    reopened = ChatSession.open(model, tok, conversation_id, copy)
    assert reopened.timeline.tokens_processed == 0
    assert_same_state(reopened, reference)
    reopened.configure(temperature=0, max_new_tokens=12)
    expected = "".join(reference.send(TURNS[3]))
    assert "".join(reopened.send(TURNS[3])) == expected

    # a restarted server
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_app(model_dir, data, port, log)
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        messages.append({"role": "user", "content": TURNS[3]})
        r = client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == expected
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - reference.last_turn.prompt_computed
        assert store.list_ids(data) == [conversation_id]  # the same conversation, continued
    finally:
        kill(proc)


# --- the embedded model -----------------------------------------------------------------------------------

@pytest.mark.embedded
@pytest.mark.slow
def test_the_embedded_model_reopens_bit_for_bit(embedded_model, tmp_path):
    model, tok = embedded_model
    session = ChatSession(model, tok, cache=dict(budget=64, n_sink=4, n_recent=16), temperature=0, max_new_tokens=24,
                          data_dir=tmp_path)
    story(session, ["Tell me about a lighthouse.", "And its keeper?"])
    saved_kv.flush()
    reopened = ChatSession.open(model, tok, session.id, tmp_path)
    assert reopened.timeline.tokens_processed == 0 and not reopened.take_notices()
    assert_same_state(session, reopened)
    assert "".join(reopened.send("What happens next?")) == "".join(session.send("What happens next?"))
    saved_kv.flush()
    info = json.loads(safe_open(str(newest(tmp_path, reopened.id)), framework="pt").metadata()["fingerprint"])
    assert info["weights"] == "fp32" and info["dtype"] == "torch.float32"
