"""What a client's next request reuses of the last one: a reply re-renders as the tokens it was
generated as (BPE would split it otherwise), a stop-string cut takes back what the cache was fed
past it, and system messages may come anywhere (a template that refuses them gets them folded).
Also: Stop ends a long prefill within one chunk, and a data folder that cannot be written never
fails a reply."""

import logging
import shutil
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from h2o_chat import ChatSession
from h2o_chat.chat import saved_kv, store
from h2o_chat.chat import timeline as timeline_mod
from h2o_chat.chat.conversation import Message
from h2o_chat.chat.template import KnownTokens, render, token_ids
from tests.conftest import CHATML, make_tiny_chat, make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16)


def make_tiny_bpe_chat():
    """make_tiny_chat with BPE merges ("th", "he", "the"): a model that draws "t" then "he" wrote
    a text that tokenizes as "the", as a real model's replies often do."""
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    for merged in ("th", "he", "the"):
        vocab[merged] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("h", "e"), ("th", "e")], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = make_tiny_llama(vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, tokenizer


def scripted(session, ids):
    """The session draws exactly `ids`, then the end of its turn."""
    end = session.tokenizer.convert_tokens_to_ids("<|im_end|>")
    queue = list(ids)

    def sample(logits, ban_stop=False):
        return torch.tensor(queue.pop(0) if queue else end)

    session._sampler.sample = sample


def pieces(tokenizer, text):
    """Non-canonical ids for `text`: one token per character (BPE would merge "the")."""
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def test_a_reply_drawn_as_other_tokens_than_its_text_tokenizes_to_is_reused_next_turn():
    model, tok = make_tiny_bpe_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=40)
    reply = "the other hen"
    assert tok(reply, add_special_tokens=False).input_ids != pieces(tok, reply)  # BPE would split it otherwise
    scripted(session, pieces(tok, reply))
    assert "".join(session.send("Tell me about the farm.")) == reply
    fed = list(session.ledger.vocab_ids)
    processed = session.timeline.tokens_processed
    # the client resends the history (the reply as text), as every OpenAI client does
    session.messages = [{"role": "user", "content": "Tell me about the farm."}, {"role": "assistant", "content": reply}]
    "".join(session.send("And then?"))
    new = session.timeline.tokens_processed - processed
    assert session.ledger.vocab_ids[: len(fed)] == fed  # the reply was not fed again ...
    assert new == session.last_turn.prompt_tokens - len(fed) + session.last_turn.new_tokens  # only what is new


def test_a_reply_the_client_trimmed_reuses_the_tokens_it_still_holds():
    model, tok = make_tiny_bpe_chat()
    known = KnownTokens(tok)
    ids = pieces(tok, "the other hen  ")
    known.remember("the other hen  ", ids)
    assert known.ids("the other hen  ") == ids
    assert known.ids("the other hen") == ids[:13]  # SillyTavern trims the end
    assert known.ids("the other hen  and more") == ids + tok("and more", add_special_tokens=False).input_ids
    assert known.ids("the other hens") is None  # an edit inside it: tokenized as a new text
    assert known.ids("the others") is None  # only its first characters: never matched (that could change)
    assert known.ids("something else") is None


def test_a_reply_cut_inside_a_character_is_reused_with_its_partial_bytes():
    # bench story, seed 1: a 300-token reply ended inside a Hebrew letter; the text the client got
    # drops the partial bytes, so it did not start with the tokens' text and the whole reply (322
    # tokens) was computed again on the next turn. The partial bytes stay: the cache holds them
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                      merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    ids = tok("the café", add_special_tokens=False).input_ids  # é is two byte tokens
    cut = ids[:-1]
    assert tok.decode(cut) == "the caf\ufffd"
    known = KnownTokens(tok)
    known.remember("the caf", cut)  # what the client was sent: the partial character dropped
    assert known.ids("the caf") == cut
    assert known.ids("the caf, and then") == cut + tok(", and then", add_special_tokens=False).input_ids
    assert known.ids("the ca") == ids[:-3]  # a client that trimmed it: the tokens it still holds


def test_every_reply_of_a_long_chat_keeps_rendering_as_it_was_fed():
    """Forty turns, each reply drawn as tokens BPE would merge: every turn, however far the first
    replies lie behind, computes only its new message."""
    model, tok = make_tiny_bpe_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=40)
    history = []
    for turn in range(40):
        reply = f"the {turn} then"
        scripted(session, pieces(tok, reply))
        history.append({"role": "user", "content": f"Turn {turn}"})
        session.messages = history[:-1]  # the client resends everything, as text
        fed = len(session.ledger)
        assert "".join(session.send(history[-1]["content"])) == reply
        stats = session.last_turn
        assert stats.prompt_computed == stats.prompt_tokens - fed  # nothing fed before was fed again
        history.append({"role": "assistant", "content": reply})


def test_a_stop_string_cut_takes_back_what_the_cache_was_fed_past_it():
    """The stop string's first characters were fed to the model before it was complete: the cache
    goes back to before them, and completion tokens count only the tokens of the text kept."""
    model, tok = make_tiny_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=40, stop=["\nUser:"])
    drawn = "Hello there.\nUser: more"
    scripted(session, pieces(tok, drawn))
    assert "".join(session.send("Hi")) == "Hello there."
    stats = session.last_turn
    assert stats.kept_tokens == len("Hello there.") and stats.new_tokens == len("Hello there.\nUser:")
    assert stats.stop_string == "\nUser:"
    assert tok.decode(session.ledger.vocab_ids[stats.prompt_tokens:]) == "Hello there."  # nothing of "\nUser" is held
    processed = session.timeline.tokens_processed
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    "".join(session.send("Go on."))
    prompt = session.last_turn.prompt_tokens
    assert session.last_turn.prompt_computed == prompt - stats.prompt_tokens - len("Hello there.")
    assert session.timeline.tokens_processed - processed == session.last_turn.prompt_computed + \
        session.last_turn.new_tokens


def test_system_messages_stay_where_chatml_takes_them_and_reuse_the_prefix():
    model, tok = make_tiny_chat()
    session = ChatSession(model, tok, cache=dict(policy="full"), system_prompt="Be brief.", temperature=0,
                          max_new_tokens=8)
    first = "".join(session.send("Hello."))
    fed = len(session.ledger)
    reply = "".join(session.send("[Continue your last message.]", role="system"))
    assert session.history[-2] == {"role": "system", "content": "[Continue your last message.]"}
    assert session.last_turn.prompt_computed == session.last_turn.prompt_tokens - fed  # new text after the prefix
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + session.history[:-1],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert session.ledger.vocab_ids[: len(rendered)] == rendered
    assert first and isinstance(reply, str)


STRICT = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('System messages must come first') }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("roles, expected", [
    pytest.param(["user", "assistant", "system", "user"], ["user", "assistant", "user"], id="before-a-user-turn"),
    pytest.param(["user", "system", "assistant"], ["user", "assistant"], id="after-a-user-turn"),
    pytest.param(["user", "assistant", "system"], ["user", "assistant", "user"], id="at-the-end"),
])
def test_a_template_that_refuses_late_system_messages_gets_them_folded_into_a_user_turn(roles, expected):
    _, tok = make_tiny_chat()
    tok.chat_template = STRICT
    messages = [Message(r, f"{r} {i}") for i, r in enumerate(roles)]
    segments = render(tok, "Be brief.", messages, add_generation_prompt=True)
    text = tok.decode(token_ids(segments))
    assert text.count("<|im_start|>system") == 1 and "Be brief." in text  # the system prompt stays first
    assert [line.split("\n")[0] for line in text.split("<|im_start|>")[2:-1]] == expected
    folded = messages[roles.index("system", 1)].content
    assert folded in text
    assert {s.turn for s in segments if s.role == "system" and s.turn >= 0} == {roles.index("system", 1)}


def test_stop_ends_a_long_replay_within_one_chunk_and_the_conversation_stays_consistent(monkeypatch):
    model, tok = make_tiny_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=4)
    for i in range(3):
        "".join(session.send(f"Message {i}: " + "words " * 60))
    history = session.history
    session.close()  # the cache is freed: the next turn replays ~1,200 tokens, 5 chunks of 256
    chunks = []
    slow = timeline_mod.Timeline._forward

    def forward(self, x):
        chunks.append(x.shape[1])
        time.sleep(0.2)  # a slow prefill chunk (a real model on a CPU)
        return slow(self, x)

    monkeypatch.setattr(timeline_mod.Timeline, "_forward", forward)
    threading.Timer(0.3, session.stop).start()
    start = time.perf_counter()
    assert "".join(session.send("And now?")) == ""
    assert time.perf_counter() - start < 1.0 and 1 <= len(chunks) <= 3  # far from all of it
    assert session.history == history + [{"role": "user", "content": "And now?"}, {"role": "assistant", "content": ""}]
    monkeypatch.setattr(timeline_mod.Timeline, "_forward", slow)
    reply = "".join(session.send("Go on."))  # the next turn feeds the rest
    fresh = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=4)
    fresh.messages = [dict(m, pinned=False) for m in session.history[:-2]]
    assert "".join(fresh.send("Go on.")) == reply


def test_a_data_folder_that_cannot_be_written_never_fails_a_reply(tmp_path, caplog):
    model, tok = make_tiny_chat()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=5, data_dir=blocker / "data")
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        for i in range(3):
            assert "".join(session.send(f"Hello {i}"))
    assert session.save_error == "Not a directory" and str(tmp_path) not in session.save_error
    lines = [r for r in caplog.records if "not being saved" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path) not in lines[0].getMessage()  # one line, no path
    assert session.take_notices() == ["This chat is not being saved: the data folder cannot be written "
                                      "(Not a directory)."]


def test_a_restored_conversations_replay_stops_when_asked_and_the_next_turn_feeds_the_rest(tmp_path):
    model, tok = make_tiny_chat()
    session = ChatSession(model, tok, cache=CACHE, temperature=0, max_new_tokens=4, data_dir=tmp_path)
    for i in range(3):
        "".join(session.send(f"Message {i}: " + "words " * 60))
    saved_kv.flush()
    shutil.rmtree(store.kv_folder(tmp_path, session.id))  # no saved cache: it is replayed
    chunks = []
    restored = ChatSession.open(model, tok, session.id, tmp_path, on_progress=lambda done, total: chunks.append(done),
                                should_stop=lambda: len(chunks) >= 2)
    assert len(chunks) == 2 and len(restored.ledger) == chunks[-1] < len(session.ledger)  # two chunks, then stopped
    assert restored.history == session.history
    "".join(restored.send("Go on."))  # the next turn feeds the rest: the cache holds the whole rendering
    prompt = tok.apply_chat_template(restored.history[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert restored.ledger.vocab_ids[: len(prompt)] == prompt
