"""The chat template, as token segments: what the model sees of a conversation.

    render(tokenizer, system_prompt, messages, add_generation_prompt=False, open_reply=False)
      -> [Segment(ids, role, turn, text)]   turn: index into messages, -1 for the system prompt;
                                            text: the message's own words (not the template's)
    turn_ranges(segments, turns) -> [(start, end)]   what a pin of those messages covers

Message texts are tokenized on their own with special tokens split, so a user typing
"<|im_end|>" gets plain text, never a control token; the template's own text is tokenized
normally. Both meet at the template's fixed separators: the template is rendered with a
placeholder per message, and split there.
"""

import threading
from typing import NamedTuple

PLACEHOLDER = "\x00h2o-content-{}\x00"
# A fast tokenizer's split_special_tokens is a flag set on the shared Rust tokenizer for the call:
# two conversations tokenizing at once (two tabs, two API clients) could each read the other's
# flag, and a template's <|im_start|> came out as 12 characters. One call at a time.
_TOKENIZER_LOCK = threading.Lock()


SYSTEM = -1  # the turn of the system prompt


class Segment(NamedTuple):
    ids: list
    role: str
    turn: int
    text: bool = False  # the message's own words; False: the template's (its heads, a default system prompt)


def render(tokenizer, system_prompt, messages, add_generation_prompt=False, open_reply=False):
    """The segments of the whole history as the chat template lays it out. messages: objects
    with .role and .content. With open_reply a last reply is left open (no end-of-turn), as
    it is right after generating it; otherwise add_generation_prompt opens a new one."""
    open_last = open_reply and messages and messages[-1].role == "assistant"
    shown = messages[:-1] if open_last else messages
    add_generation_prompt = add_generation_prompt or open_last
    keys = (["s"] if system_prompt else []) + list(range(len(shown)))
    chat = [{"role": "system" if k == "s" else shown[k].role, "content": PLACEHOLDER.format(k)} for k in keys]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt) \
        if chat else ""
    segments, turn = [], -1 if system_prompt else 0
    for key in keys:
        head, text = text.split(PLACEHOLDER.format(key), 1)
        content, role = (system_prompt, "system") if key == "s" else (shown[key].content, shown[key].role)
        segments += [Segment(tokenize(tokenizer, head, template=True), role, turn),
                     Segment(tokenize(tokenizer, content, template=False), role, turn, text=True)]
        turn += 1
    tail = len(shown)
    if open_last:
        segments += [Segment(tokenize(tokenizer, text, template=True), "assistant", tail),
                     Segment(tokenize(tokenizer, messages[-1].content, template=False), "assistant", tail, text=True)]
    elif add_generation_prompt:
        segments.append(Segment(tokenize(tokenizer, text, template=True), "assistant", tail))
    else:  # the last message's end-of-turn
        segments.append(Segment(tokenize(tokenizer, text, template=True), "template", tail - 1))
    return [s for s in segments if s.ids]


def tokenize(tokenizer, text, template):
    if not text:
        return []
    with _TOKENIZER_LOCK:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=not template).input_ids


def token_ids(segments):
    return [t for s in segments for t in s.ids]


def turn_ranges(segments, turns):
    """Absolute [start, end) of what pinning each of `turns` protects, in turn order (a turn with
    nothing rendered is skipped). A message: its own words only, never the template's tokens
    around them (SmolLM2's template puts its default system prompt before the first message).
    SYSTEM: everything before the first message's words: the system prompt, the one given or the
    one the template adds, with the template's opening."""
    ranges, pos, first_words = {}, 0, None
    for s in segments:
        if s.text and s.turn != SYSTEM and first_words is None:
            first_words = pos
        if s.text and s.turn in turns and s.turn != SYSTEM:
            ranges[s.turn] = (pos, pos + len(s.ids))
        pos += len(s.ids)
    if SYSTEM in turns and first_words:
        ranges[SYSTEM] = (0, first_words)
    return [ranges[t] for t in sorted(ranges)]
