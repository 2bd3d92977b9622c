"""Conversation: plain data with one declaration of every setting, a JSON round trip, titles,
forks; and ChatSession reads its settings from it (no second set of defaults)."""

import inspect
import json
from dataclasses import asdict

import pytest

from h2o_chat import CHOICES, CacheConfig, ChatSession, Conversation, Message, Sampling, Settings
from h2o_chat.cache.config import POLICIES, SCORES
from h2o_chat.chat.conversation import cache_config, sampling


def a_conversation():
    settings = Settings(CacheConfig(policy="sink", budget=40, n_sink=3, n_recent=20, score="mean"),
                        Sampling(temperature=0.3, top_k=7, seed=9, stop=("zz",)), "Be brief.")
    return Conversation(messages=[Message("user", "Tell me about lighthouses, please, in detail"),
                                  Message("assistant", "They guide ships.", pinned=True)],
                        settings=settings, title="", revision=3)


def test_the_json_round_trip_is_exact():
    conversation = a_conversation()
    record = json.loads(json.dumps(conversation.record()))  # through real JSON text
    assert Conversation.from_record(record, conversation.id) == conversation


def test_defaults_are_declared_once():
    # a new conversation, a session given nothing, and a saved file that names nothing agree
    assert Conversation().settings == Settings() and Settings.from_record({}) == (Settings(), [])
    assert Settings().cache == CacheConfig() and Settings().sampling == Sampling()
    # ChatSession declares no sampling default of its own: its settings are the dataclass's
    assert not {"temperature", "top_p", "max_new_tokens"} & set(inspect.signature(ChatSession).parameters)


def test_a_session_with_no_settings_runs_on_the_defaults(tiny_chat):
    assert ChatSession(*tiny_chat).settings == Settings()


def test_settings_are_checked_where_they_are_declared():
    with pytest.raises(ValueError, match="unknown setting 'temprature'"):
        sampling({"temprature": 1})
    with pytest.raises(ValueError, match="unknown cache setting 'budgett'"):
        cache_config({"budgett": 1})
    with pytest.raises(ValueError, match="temperature must be from 0 to 5"):
        Sampling(temperature=9)
    assert sampling({"top_k": 3}, base=Sampling(temperature=0.1)) == Sampling(temperature=0.1, top_k=3)


def test_the_title_is_the_first_words_until_one_is_given():
    conversation = a_conversation()
    assert conversation.display_title == "Tell me about lighthouses, please, in detail"
    conversation.messages[0].content = "one two three four five six seven eight nine ten"
    assert conversation.display_title == "one two three four five six seven eight ..."
    assert Conversation().display_title == "New chat"
    conversation.title = "Lighthouses"
    assert conversation.summary().title == "Lighthouses" and conversation.summary().n_messages == 2


def test_a_fork_is_a_new_unsaved_conversation_with_the_same_text():
    conversation = a_conversation()
    old_id, messages, settings = conversation.id, conversation.messages, conversation.settings
    assert conversation.become_fork() is conversation
    assert conversation.id != old_id and conversation.forked_from == old_id and conversation.revision == 0
    assert conversation.messages is messages and conversation.settings == settings
    assert conversation.title == "Tell me about lighthouses, please, in detail (copy)"


@pytest.mark.parametrize("value", [None, "hi", {"role": "function", "content": "x"}, {"role": "user"},
                                   {"role": "user", "content": 5}])
def test_a_message_must_be_a_role_and_text(value):
    with pytest.raises(ValueError, match="a message is a dict with a role"):
        Message.of(value)


def test_the_choices_come_from_the_session_layer():
    assert CHOICES["policy"] == POLICIES and CHOICES["score"] == SCORES
    assert ChatSession.choices is CHOICES
    assert asdict(Settings())["cache"]["policy"] in CHOICES["policy"]
