"""keep_template: the chat template's control tokens (role markers, turn ends) pinned, never evicted,
counted against the budget; refused in words when the budget has no room for them."""

import json

import pytest

from h2o_chat import ChatSession
from h2o_chat.cache.config import CacheConfig, SettingError
from h2o_chat.chat.conversation import Message
from h2o_chat.chat.template import render, template_ranges, token_ids
from h2o_chat.serve import cli as server
from h2o_chat.serve.requests import ApiError, read_cache
from h2o_chat.ui import settings as ui_settings
from tests.conftest import CHATML

TURNS = ["Hello there!", "Tell me a story about a lighthouse.", "Make it shorter.", "Who is the hero?", "Thanks."]


def template_tokens(session):
    """The absolute indices of the template's control tokens in what the session has fed."""
    fed = session._fed
    return {t for start, end in template_ranges(session.tokenizer, session._segments()) for t in range(start, end)
            if t < len(fed)}


def missing(session, tokens):
    """(layer, KV head, token) of `tokens` some layer or KV head no longer holds."""
    cache = session.cache
    return [(layer, head, t) for layer in range(len(cache.layers))
            for head, ids in enumerate(cache.token_ids(layer)[0].tolist()) for t in sorted(tokens - set(ids))]


def test_template_ranges_are_the_control_tokens_and_nothing_a_message_or_a_default_prompt_says(tiny_chat):
    _, tok = tiny_chat
    tok.chat_template = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n" + CHATML  # a default prompt
    messages = [Message("user", "I type <|im_end|> myself"), Message("assistant", "Fine.\n"), Message("user", "Ok")]
    segments = render(tok, None, messages, add_generation_prompt=True)
    ids = token_ids(segments)
    shown = [tok.decode(ids[start:end]) for start, end in template_ranges(tok, segments)]
    assert shown == ["<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("keep", [True, False])
def test_kept_template_tokens_survive_eviction_and_others_do_not(tiny_chat, keep):
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=dict(policy="h2o", budget=128, n_sink=2, n_recent=16, keep_template=keep),
                          temperature=0, max_new_tokens=24)
    for text in TURNS:
        "".join(session.send(text))
    tokens = template_tokens(session)
    assert session.stats["tokens_seen"] > 2 * 128 and len(tokens) > 60  # evicting, with template tokens of 10 turns
    if keep:
        assert missing(session, tokens) == []
        assert pinned_count(session) == len(tokens - {0, 1})  # counted against the budget (less the sinks)
    else:  # without the setting H2O evicts some of them: the check above can fail
        assert missing(session, tokens) != [] and session.cache.pins == []


def pinned_count(session):
    return len({t for start, end in session.cache.pins for t in range(max(start, 2), end)})


def test_a_budget_with_no_room_for_the_template_is_refused_in_words_and_nothing_is_lost(tiny_chat):
    model, tok = tiny_chat
    session = ChatSession(model, tok, cache=dict(policy="h2o", budget=64, n_sink=2, n_recent=16, keep_template=True),
                          temperature=0, max_new_tokens=6)
    sent = []
    with pytest.raises(ValueError) as refused:
        for text in TURNS * 3:  # each turn adds ~16 template tokens; 46 slots are free of the recent window
            before = [(m.role, m.content) for m in session.messages]
            "".join(session.send(text))
            sent.append(text)
    assert "slots" in str(refused.value) and "are the chat template's tokens, which keep template tokens never " \
        "evicts: or turn that off" in str(refused.value)
    assert [(m.role, m.content) for m in session.messages] == before and len(sent) >= 2  # the refused turn left nothing
    session.configure(cache=dict(policy="h2o", budget=64, n_sink=2, n_recent=16))  # the way out it names
    assert "".join(session.send("Go on.")) is not None and session.cache.pins == []


def test_keep_template_is_one_setting_for_the_command_line_the_api_and_the_page():
    assert server.parse_args([]).keep_template is False and server.parse_args(["--keep-template"]).keep_template
    cache, _ = read_cache({"h2o": {"keep_template": True}}, {}, 0, 1)
    assert CacheConfig(**cache).keep_template is True
    with pytest.raises(ApiError, match="h2o.keep_template must be true or false, got 'yes'"):
        read_cache({"h2o": {"keep_template": "yes"}}, {}, 0, 1)
    with pytest.raises(SettingError, match="^keep template tokens must be true or false, got 1$"):
        CacheConfig(keep_template=1)
    field = next(f for f in CacheConfig.__dataclass_fields__.values() if f.name == "keep_template")
    box = ui_settings.field_for(field, True)
    assert type(box).__name__ == "Checkbox" and box.label == "Keep template tokens" and box.value is True


@pytest.mark.slow
def test_template_ppl_runs_a_story_file_and_scores_every_cache_on_the_same_chats(tmp_path):
    from h2o_chat.bench import evaluate
    from tests.live import save_tiny_chat

    folder = save_tiny_chat(tmp_path / "tiny")
    rows = [{"seed": seed, "policy": "full", "turn": turn, "text": f"Reply {turn} of story {seed}, a few words long."}
            for seed in (0, 1) for turn in (1, 2, 3)]
    (tmp_path / "story_turns.json").write_text(json.dumps({"rows": rows}))
    evaluate.main(["--model", str(folder), "--out", str(tmp_path), "template-ppl", "--stories",
                   str(tmp_path / "story_turns.json"), "--budgets", "0.1,0.5", "--chunk", "4", "--feed", "64"])
    table = json.loads((tmp_path / "template_ppl.json").read_text())["rows"]
    assert [(r["cache"], r["budget"]) for r in table] == [(c, b) for b in ("10%", "50%")
                                                         for c in ("full", "h2o", "h2o + template")]
    small, half = table[:3], table[3:]
    assert {r["chats"] for r in small} == {"0/2"} and {r["ppl"] for r in small} == {""}  # no room: none is run
    assert {r["chats"] for r in half} == {"2/2"} and len({r["tokens"] for r in half}) == 1  # the same chats
    assert all(r["ppl"] > 1 and r["ppl_replies"] > 1 for r in half) and half[2]["template_tokens"] > 0
