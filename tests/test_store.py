"""store: atomic JSON files, a revision check that never lets a stale writer overwrite, the
saved-conversations list, and format 1 files."""

import json
import threading
import time

import pytest

from h2o_chat import Conversation, Message
from h2o_chat.chat import store


def saved(folder, text="hello", **fields):
    conversation = Conversation(messages=[Message("user", text)], **fields)
    store.write(folder, conversation)
    return conversation


def test_write_then_read_round_trips_and_counts_revisions(tmp_path):
    conversation = saved(tmp_path)
    assert conversation.revision == 1
    conversation.messages.append(Message("assistant", "hi"))
    assert store.write(tmp_path, conversation) == 2
    assert store.read(tmp_path, conversation.id) == conversation


def test_a_stale_writer_is_refused_and_the_file_kept(tmp_path):
    first = saved(tmp_path)
    second = store.read(tmp_path, first.id)
    first.messages.append(Message("assistant", "from the first"))
    store.write(tmp_path, first)
    second.messages.append(Message("assistant", "from the second"))
    with pytest.raises(store.StaleRevisionError, match="changed elsewhere .*revision 2.*read as revision 1"):
        store.write(tmp_path, second)
    assert store.read(tmp_path, first.id).messages[-1].content == "from the first"
    assert second.revision == 1  # unchanged: the caller decides (ChatSession saves it as a fork)


def test_a_new_conversation_never_replaces_a_file_with_its_id(tmp_path):
    first = saved(tmp_path)
    with pytest.raises(store.StaleRevisionError):
        store.write(tmp_path, Conversation(id=first.id))


def test_concurrent_writers_of_one_revision_exactly_one_wins(tmp_path):
    base = saved(tmp_path)
    copies = [store.read(tmp_path, base.id) for _ in range(8)]
    outcomes, barrier = {}, threading.Barrier(len(copies))

    def write(i, copy):
        copy.messages.append(Message("assistant", f"writer {i}"))
        barrier.wait(timeout=30)
        try:
            store.write(tmp_path, copy)
            outcomes[i] = "saved"
        except store.StaleRevisionError:
            outcomes[i] = "stale"  # told, so its session can save a fork
        except Exception as e:  # noqa: BLE001 - any other ending is the bug
            outcomes[i] = repr(e)

    threads = [threading.Thread(target=write, args=(i, c), daemon=True) for i, c in enumerate(copies)]
    for t in threads:
        t.start()
    end = time.monotonic() + 30
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a writer never finished"
    assert sorted(outcomes.values()) == ["saved"] + ["stale"] * 7, outcomes
    (winner,) = [i for i, outcome in outcomes.items() if outcome == "saved"]
    assert store.read(tmp_path, base.id).messages[-1].content == f"writer {winner}"


def test_one_copy_saved_from_two_threads_never_takes_itself_for_another_writer(tmp_path):
    # issue 25, 3: one click on Pin ran two pins at once on one tab's conversation; the second
    # save read the revision the first had written before the first recorded it, and forked
    conversation = Conversation(messages=[Message("user", "hi")])
    store.write(tmp_path, conversation)
    stale = []

    def save():
        for _ in range(100):
            try:
                store.write(tmp_path, conversation)
            except store.StaleRevisionError as e:
                stale.append(e)

    threads = [threading.Thread(target=save) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert stale == [] and conversation.revision == 201


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    conversation = saved(tmp_path)
    before = (tmp_path / f"{conversation.id}.json").read_bytes()

    def dies(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "fsync", dies)  # the disk fills while the new file is written
    conversation.messages.append(Message("assistant", "lost"))
    with pytest.raises(OSError, match="disk full"):
        store.write(tmp_path, conversation)
    assert (tmp_path / f"{conversation.id}.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == [] and conversation.revision == 1


def test_summaries_are_titled_and_newest_first(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    old = saved(tmp_path, "an old chat about boats")
    new = saved(tmp_path, "a new chat about trains and more words than a title shows")
    rows = store.summaries(tmp_path)
    assert [r.id for r in rows] == [new.id, old.id, "broken"]  # newest first, by the saved time
    assert rows[0].title == "a new chat about trains and more words ..." and rows[0].n_messages == 1
    assert rows[0].updated >= rows[1].updated and rows[0].error is None
    (broken,) = [r for r in rows if r.id == "broken"]
    assert "is corrupt" in broken.error  # listed, so the UI can say what is wrong
    old.messages.append(Message("assistant", "boats float"))
    store.write(tmp_path, old)
    assert store.summaries(tmp_path)[0].id == old.id  # saving again moves it to the top


def test_a_format_1_file_loads_as_revision_0_then_saves_as_format_2(tmp_path):
    record = {"version": 1, "id": "old1", "updated": 1.0, "system_prompt": "Be kind.",
              "messages": [{"role": "user", "content": "hi", "pinned": True}],
              "cache": {"policy": "h2o", "budget": 64, "n_sink": 4, "n_recent": None, "score": "sum",
                        "decay": 0.9, "positions": "rolling", "prefill_chunk": 256},
              "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.0,
                           "max_new_tokens": 64, "seed": None, "stop": []}}
    (tmp_path / "old1.json").write_text(json.dumps(record))
    conversation = store.read(tmp_path, "old1")
    assert conversation.revision == 0 and conversation.messages == [Message("user", "hi", True)]
    assert conversation.settings.cache.budget == 64 and conversation.settings.sampling.max_new_tokens == 64
    assert conversation.settings.system_prompt == "Be kind."
    store.write(tmp_path, conversation)
    assert json.loads((tmp_path / "old1.json").read_text())["version"] == store.FORMAT_VERSION == 2


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", "", "x" * 65, None, "abc\n"])
def test_no_id_names_a_file_outside_the_folder(tmp_path, bad_id):
    folder = tmp_path / "data"
    with pytest.raises(ValueError, match="invalid session id"):
        store.write(folder, Conversation(id=bad_id))
    with pytest.raises(ValueError, match="invalid session id"):
        store.read(folder, bad_id)
    with pytest.raises(ValueError, match="invalid session id"):
        store.delete(folder, bad_id)
    assert list(tmp_path.rglob("*")) == []


def test_delete_removes_the_conversation_and_its_lock_and_nothing_else(tmp_path):
    gone, kept = saved(tmp_path, "delete me"), saved(tmp_path, "keep me")
    assert {p.name for p in tmp_path.iterdir()} == {f"{gone.id}.json", f".{gone.id}.lock", f"{kept.id}.json",
                                                    f".{kept.id}.lock"}
    store.delete(tmp_path, gone.id)
    assert {p.name for p in tmp_path.iterdir()} == {f"{kept.id}.json", f".{kept.id}.lock"}
    assert [s.id for s in store.summaries(tmp_path)] == [kept.id]
    store.delete(tmp_path, gone.id)  # already gone: nothing to do, no error
