"""The chat template, as token segments: what the model sees of a conversation.

    render(tokenizer, system_prompt, messages, add_generation_prompt=False, open_reply=False, known=None,
           tools=None)
      -> [Segment(ids, role, turn, text)]   turn: index into messages, -1 for the system prompt;
                                            text: the message's own words (not the template's)
    turn_ranges(segments, turns) -> [(start, end)]   what a pin of those messages covers
    template_ranges(tokenizer, segments) -> [(start, end)]   the template's control tokens (keep_template)

Message texts are tokenized on their own with special tokens split, so a user typing
"<|im_end|>" gets plain text, never a control token; the template's own text is tokenized
normally. Both meet at the template's fixed separators: the template is rendered with a
placeholder per message, and split there.

System messages may come anywhere (frontends put an author's note, a continue nudge or an
impersonation prompt after the history); ChatML and most templates take them where they are. A
template that refuses one (it raises, or drops its text) gets it folded into a user turn: the next
one, else the user turn before it, else a user turn of its own; if it still refuses, the system
prompt is folded the same way.

Tools (OpenAI's function tools) go to the template as they are; an assistant message's tool
calls go with it (their arguments as objects, as templates expect), a tool result with the id of
the call it answers. A template may drop the text of a message that carries calls (Llama 3.1
shows only the call), and may write a tool result as a JSON string (Llama 3.1 again): its text
is then the JSON string, still tokenized as text.

`known` (a KnownTokens) gives the token ids a reply was generated as: the model draws tokens that
BPE would often split differently, and a reply rendered from its text would then no longer match
what the cache holds, so every turn would compute the previous reply again.
"""

import itertools
import json
import os
import threading
from typing import NamedTuple

import torch
from jinja2 import TemplateError

from .ledger import tensor_text, text_tensor

PLACEHOLDER = "\x00h2o-content-{}\x00"
FOLD_SEPARATOR = "\n\n"  # between a folded system message and the user text it joins
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


def render(tokenizer, system_prompt, messages, add_generation_prompt=False, open_reply=False, known=None, tools=None):
    """The segments of the whole history as the chat template lays it out. messages: objects
    with .role and .content (and .tool_calls, .tool_call_id). With open_reply a last reply is left
    open (no end-of-turn), as it is right after generating it; otherwise add_generation_prompt
    opens a new one. tools: OpenAI's function tools, for a template that shows them."""
    open_last = open_reply and messages and messages[-1].role == "assistant"
    shown = messages[:-1] if open_last else messages
    add_generation_prompt = add_generation_prompt or open_last
    keys = (["s"] if system_prompt else []) + list(range(len(shown)))
    roles = {k: "system" if k == "s" else shown[k].role for k in keys}
    extras = {k: template_fields(shown[k]) for k in keys if k != "s"}
    for k, fields in extras.items():
        if "tool_calls" in fields and not shown[k].content:  # only calls: the template sees no text at all
            fields["content"] = ""
    text = _apply(tokenizer, keys, roles, add_generation_prompt, extras, tools)
    segments, turn = [], -1 if system_prompt else 0
    for key in keys:
        content, role = (system_prompt, "system") if key == "s" else (shown[key].content, shown[key].role)
        head, content, text = _split(text, key, content)
        segments += [Segment(tokenize(tokenizer, head, template=True), role, turn),
                     Segment(content_ids(tokenizer, content, role, known), role, turn, text=True)]
        turn += 1
    tail = len(shown)
    if open_last:
        segments += [Segment(tokenize(tokenizer, text, template=True), "assistant", tail),
                     Segment(content_ids(tokenizer, messages[-1].content, "assistant", known), "assistant", tail,
                             text=True)]
    elif add_generation_prompt:
        segments.append(Segment(tokenize(tokenizer, text, template=True), "assistant", tail))
    else:  # the last message's end-of-turn
        segments.append(Segment(tokenize(tokenizer, text, template=True), "template", tail - 1))
    return [s for s in segments if s.ids]


def template_fields(message):
    """What the template reads of a message besides its text: an assistant's tool calls (their
    JSON arguments as objects), a tool result's call id. Keys only where they hold something
    (Llama 3.1's template asks whether "tool_calls" is in a message at all)."""
    out = {}
    if getattr(message, "tool_calls", None):
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": json_or_text(call["function"]["arguments"])}}
                             for call in message.tool_calls]
    if getattr(message, "tool_call_id", None) is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def json_or_text(arguments):
    """A tool call's arguments as the object their JSON text holds (templates index into them),
    or the text itself when it holds none."""
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


def _split(text, key, content):
    """(the template's text before message `key`, the message's text as shown, the rest): its
    placeholder as written, or as the JSON string a template made of it, or nowhere (a template
    that shows only a message's calls)."""
    mark = PLACEHOLDER.format(key)
    quoted = json.dumps(mark, ensure_ascii=False)
    if mark in text:
        head, rest = text.split(mark, 1)
        return head, content, rest
    if quoted in text:
        head, rest = text.split(quoted, 1)
        return head, json.dumps(content, ensure_ascii=False), rest
    return "", "", text


def _apply(tokenizer, keys, roles, add_generation_prompt, extras=None, tools=None):
    """The template's text with a placeholder per message: system messages where they are if the
    template takes them, else folded (late ones first, then the system prompt too). extras: the
    template fields of each message (template_fields); a message with tool calls may have no
    text (no placeholder), and its text may be left out by the template."""
    if not keys:
        return ""
    extras = extras or {}
    first_turn = next((i for i, k in enumerate(keys) if roles[k] != "system"), len(keys))
    late = [k for k in keys[first_turn:] if roles[k] == "system"]
    attempts = [[[roles[k], [k]] for k in keys]]
    if late:
        attempts.append(fold(keys, roles, set(late)))
    if any(roles[k] == "system" for k in keys):
        attempts.append(fold(keys, roles, {k for k in keys if roles[k] == "system"}))
    needed = [k for k in keys if "tool_calls" not in extras.get(k, {})]
    for i, groups in enumerate(attempts):
        chat = [{"role": role, "content": FOLD_SEPARATOR.join(PLACEHOLDER.format(k) for k in group),
                 **(extras.get(group[0], {}) if len(group) == 1 else {})} for role, group in groups]
        try:
            text = tokenizer.apply_chat_template(chat, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            if i == len(attempts) - 1:
                raise ValueError(f"the model's chat template refuses this conversation: {e}") from None
            continue
        if all(PLACEHOLDER.format(k) in text or json.dumps(PLACEHOLDER.format(k)) in text for k in needed):
            return text
    raise ValueError("the model's chat template drops some of the messages, even with system messages folded "
                     "into user turns")


def fold(keys, roles, folded):
    """[[role, [keys]]]: each run of `folded` system messages joins the user message after it, else
    the one before it, else becomes a user message of its own (message order is kept)."""
    groups, i = [], 0
    while i < len(keys):
        if keys[i] not in folded:
            groups.append([roles[keys[i]], [keys[i]]])
            i += 1
            continue
        j = i
        while j < len(keys) and keys[j] in folded:
            j += 1
        run = keys[i:j]
        if j < len(keys) and roles[keys[j]] == "user":
            groups.append(["user", run + [keys[j]]])
            j += 1
        elif groups and groups[-1][0] == "user":
            groups[-1][1] += run
        else:
            groups.append(["user", run])
        i = j
    return groups


def content_ids(tokenizer, content, role, known=None):
    """A message's text as tokens: a reply as it was generated (when `known` has it), else tokenized."""
    if known is not None and role == "assistant":
        ids = known.ids(content)
        if ids is not None:
            return ids
    return tokenize(tokenizer, content, template=False)


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


def template_ranges(tokenizer, segments):
    """Absolute [start, end) of the chat template's control tokens in `segments`, merged where they
    touch: in the template's own segments (never a message's words), each special token with the
    rest of its line (SmolLM2's "<|im_end|>", "\n", "<|im_start|>", "user", "\n"). A default system
    prompt the template writes is text between them, not control: it is left out."""
    special, ranges, pos = set(tokenizer.all_special_ids), [], 0
    for s in segments:
        in_line = False  # inside a special token's line: from it to the first newline
        for i, token in enumerate(s.ids):
            if not s.text and token in special:
                in_line = True
            if in_line:
                if ranges and ranges[-1][1] == pos + i:
                    ranges[-1] = (ranges[-1][0], pos + i + 1)
                else:
                    ranges.append((pos + i, pos + i + 1))
                in_line = token in special or "\n" not in tokenizer.decode([token])
        pos += len(s.ids)
    return ranges


MAX_REPLIES = 1024  # replies a session remembers the tokens of (its whole conversation, in practice)


class KnownTokens:
    """The token ids replies were generated (and fed) as, by their text: `ids(text)` gives them
    back for that text, for a start of it (the client trimmed its end) or for a text that goes on
    after it (a continued reply), the rest tokenized after them. Every reply the conversation
    still shows must keep rendering as it was fed, however old, or the cache would diverge there
    and replay everything after it: so all of them are kept (up to MAX_REPLIES), and a text that
    only shares a few first characters with a reply (a greeting that starts like one) is not
    matched to it, which could change as replies are added.

    template: the texts hold the template's special tokens as written (a text completion's
    prompt, one growing text: there the longest shared start is always the one to use)."""

    def __init__(self, tokenizer, template=False, keep=MAX_REPLIES):
        self.tokenizer, self.template, self.keep = tokenizer, template, keep
        self.replies = {}  # text -> (ids, length of the text the ids decode to), oldest first

    def remember(self, text, ids):
        """ids: tokens whose text is a prefix of `text` (the rest of it is tokenized when asked)."""
        covered = self._decode(ids)
        if not text.startswith(covered) and text.startswith(covered.rstrip("\ufffd")):
            # a reply cut inside a character: its text drops the partial bytes its last tokens
            # decode to (U+FFFD), but the model wrote them and the cache holds them, so they stay;
            # without them the cache would diverge there and the whole reply be computed again
            covered = covered.rstrip("\ufffd")
        if text and ids and text.startswith(covered):
            self.replies.pop(text, None)
            self.replies[text] = (list(ids), len(covered))
            while len(self.replies) > self.keep:
                self.replies.pop(next(iter(self.replies)))

    def export(self):
        """The replies as tensors for a saved state (chat/saved_kv.py): their texts joined
        (`text`, UTF-8) with each one's length in characters, their ids joined with each one's
        count, and how much of each text the ids cover (`covered`), oldest first."""
        texts, rows = list(self.replies), list(self.replies.values())
        return {"text": text_tensor("".join(texts)),
                "text_lengths": torch.tensor([len(t) for t in texts], dtype=torch.int64),
                "ids": torch.tensor([i for ids, _ in rows for i in ids], dtype=torch.int64),
                "id_counts": torch.tensor([len(ids) for ids, _ in rows], dtype=torch.int64),
                "covered": torch.tensor([done for _, done in rows], dtype=torch.int64)}

    def load(self, tensors, vocab_size):
        """Remember the replies `export` gave (after those remembered now), checked first: ValueError
        when they do not add up or hold ids outside the vocabulary, and nothing is remembered."""
        names = ("text", "text_lengths", "ids", "id_counts", "covered")
        text, lengths, ids, counts, covered = (tensors.get(k) for k in names)
        if any(t is None or t.dim() != 1 for t in (text, lengths, ids, counts, covered)):
            raise ValueError("its replies are incomplete")
        if not lengths.numel() == counts.numel() == covered.numel() or int(counts.sum()) != ids.numel():
            raise ValueError("its replies do not add up")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError("its replies hold tokens outside the vocabulary")
        text = tensor_text(text, "its replies' text")
        ends = list(itertools.accumulate(lengths.tolist()))
        if (ends[-1] if ends else 0) != len(text) or (lengths.numel() and int(lengths.min()) < 0):
            raise ValueError("its replies' text does not add up")
        id_ends = list(itertools.accumulate(counts.tolist()))
        ids = ids.tolist()
        replies = [(text[a:b], ids[c:d], done) for a, b, c, d, done in
                   zip([0, *ends], ends, [0, *id_ends], id_ends, covered.tolist())]
        if any(not 0 <= done <= len(t) for t, _, done in replies):
            raise ValueError("its replies' coverage is out of range")
        for t, reply_ids, done in replies:
            self.replies.pop(t, None)
            self.replies[t] = (reply_ids, done)
        while len(self.replies) > self.keep:
            self.replies.pop(next(iter(self.replies)))

    def ids(self, text):
        """`text` as tokens, starting with the most of a remembered reply's ids that it repeats;
        None when it repeats none of them."""
        if not text:
            return None
        if text in self.replies:
            ids, done = self.replies[text]
        else:
            best = None
            for known, (ids, done) in self.replies.items():
                same = len(os.path.commonprefix([known, text]))
                usable = same >= done or same == len(text) or (self.template and same > 0)
                if usable and (best is None or same > best[0]):
                    best = (same, ids, done)
            if best is None:
                return None
            same, ids, done = best
            if same < done:  # the text stops inside what the tokens cover: the most of them that it holds
                ids, done = self._longest_prefix(ids, text[:same])
        return ids + tokenize(self.tokenizer, text[done:], template=self.template) if ids else None

    def _longest_prefix(self, ids, text):
        """The most of `ids` that decodes to a start of `text`: (ids[:k], len of their text)."""
        low, high, found = 0, len(ids), (0, 0)
        while low <= high:  # decoding a longer prefix gives a longer text: binary search
            k = (low + high) // 2
            piece = self._decode(ids[:k])
            if text.startswith(piece):
                found, low = (k, len(piece)), k + 1
            else:
                high = k - 1
        return ids[: found[0]], found[1]

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=not self.template) if ids else ""
