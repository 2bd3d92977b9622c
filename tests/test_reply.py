"""Reply (chat/reply.py): one reply's loop, and its close() that cleans up however the reply ended:
the cache leaves the batch, the message holds exactly what was shown, the timing ends, the reply's
tokens are remembered as its text's, the charts get its row; and the session is free again."""

import pytest

from h2o_chat import ChatSession
from h2o_chat.chat.batch import Batcher
from tests.live import never_ending

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16)


def batched_session(tiny_chat):
    model, tok = never_ending(*tiny_chat)
    batcher = Batcher(model, max_batch=2)
    return ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=60, batcher=batcher), batcher


def assert_cleaned_up(session, batcher, shown):
    reply, stats = session._reply, session.last_turn
    assert reply.closed and not session.busy
    assert batcher.batch_size == 0  # the cache has buffers of its own again
    assert session.history[-1] == {"role": "assistant", "content": shown}
    assert stats.end is not None and stats.kept_tokens == stats.new_tokens
    drawn = session.ledger.vocab_ids[stats.prompt_tokens:]
    assert session._known.replies[shown][0] == drawn  # re-rendered next turn as the tokens it was fed as
    assert session.turn_stats[-1]["turn"] == len(session.messages) - 1
    assert session.turn_stats[-1]["tokens_seen"] == len(session.ledger) == session.cache.get_seq_length()
    rows = len(session.turn_stats)
    reply.close()  # once only
    assert len(session.turn_stats) == rows


def test_a_reply_stopped_midway_is_cleaned_up_by_close(tiny_chat):
    session, batcher = batched_session(tiny_chat)
    stream, shown = session.send("Tell me a story"), ""
    for _ in range(6):
        shown += next(stream)
    assert batcher.batch_size == 1 and session.busy  # decoding in the batch
    session.stop()
    shown += "".join(stream)  # the reply ends within one token
    assert session.last_turn.finish == "stop" and session.last_turn.new_tokens == 6
    assert_cleaned_up(session, batcher, shown)
    assert "".join(session.send("Go on"))  # the next turn uses the cache as close() left it
    assert session.last_turn.prompt_computed < session.last_turn.prompt_tokens


def test_a_reply_that_fails_midway_is_cleaned_up_by_close(tiny_chat, monkeypatch):
    session, batcher = batched_session(tiny_chat)
    feed_token, fed = session.timeline.feed_token, []

    def fails_at_the_fifth(*args):
        if len(fed) == 4:
            raise RuntimeError("the device fell over")
        fed.append(args[1])
        feed_token(*args)

    monkeypatch.setattr(session.timeline, "feed_token", fails_at_the_fifth)
    stream, shown = session.send("Tell me a story"), ""
    with pytest.raises(RuntimeError, match="fell over"):
        for piece in stream:
            shown += piece
    assert len(fed) == 4 and batcher.batch_size == 0
    assert_cleaned_up(session, batcher, shown)
    monkeypatch.undo()
    assert "".join(session.send("Again?")) and not session.busy


def test_a_reply_closed_by_its_client_leaving_is_cleaned_up(tiny_chat):
    session, batcher = batched_session(tiny_chat)
    stream = session.send("Tell me a story")
    shown = next(stream) + next(stream) + next(stream)
    stream.close()  # the client went away: GeneratorExit at the yield
    assert_cleaned_up(session, batcher, shown)
