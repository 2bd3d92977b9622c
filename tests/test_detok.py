"""detok: incremental detokenizing equals decoding the whole reply, stop strings cut exactly
there and are never shown, and the work per token stays bounded."""

import random

import pytest

from h2o_chat.chat.detok import Detokenizer, StopStrings, cut_at_stop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STOPS = ["\nUser:", "###", "ab"]


def stream(tokenizer, ids, stop=()):
    detok = Detokenizer(tokenizer, stop)
    pieces = []
    for t in ids:
        pieces.append(detok.push(t))
        if detok.stopped:
            break
    else:
        pieces.append(detok.finish())
    return pieces, detok


def full_decode(tokenizer, ids, stop=()):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text[:cut] if cut >= 0 else text.rstrip("\ufffd")  # a last character cut in its bytes is not text


def random_replies(vocab_size, n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def test_tiny_tokenizer_pieces_equal_the_full_decode(tiny_chat):
    _, tok = tiny_chat
    for ids in random_replies(len(tok), 200, seed=0):
        pieces, detok = stream(tok, ids)
        assert "".join(pieces) == full_decode(tok, ids) == detok.text


def test_a_reply_cut_in_the_middle_of_a_character_ends_before_it(tiny_model_dir):
    # issue 25, 7: max new tokens ran out inside "é" and the reply was saved with a trailing U+FFFD
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # byte-level: "é" is two tokens
    ids = tok("café au lait", add_special_tokens=False).input_ids[:4]  # c, a, f and the first byte of é
    pieces, detok = stream(tok, ids)
    assert "".join(pieces) == detok.text == "caf"


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_tokenizer_pieces_equal_the_full_decode(embedded_model):
    # byte-level BPE: random ids split multi-byte characters across tokens, and special tokens
    # (skipped) fall in between
    _, tok = embedded_model
    texts = ["Hello 👋🏽 world, 你好 世界, naïve café — שלום", "  indented\n\tcode() {}\n", "🇺🇦🏴󠁧󠁢󠁳󠁣󠁴󠁿 e\u0301"]
    cases = [tok(t, add_special_tokens=False).input_ids for t in texts] + random_replies(len(tok), 100, seed=1)
    for ids in cases:
        pieces, _ = stream(tok, ids)
        assert "".join(pieces) == full_decode(tok, ids)
    for text, ids in zip(texts, cases):
        assert "".join(stream(tok, ids)[0]) == text


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_cut_the_reply_and_are_never_shown(tiny_chat, seed):
    _, tok = tiny_chat
    rng = random.Random(seed)
    for _ in range(100):
        words = [rng.choice(["a", "b", "#", "\n", "User", ":", "x y", "ab", "##"]) for _ in range(rng.randint(1, 30))]
        ids = tok("".join(words), add_special_tokens=False).input_ids
        pieces, detok = stream(tok, ids, STOPS)
        expected = full_decode(tok, ids, STOPS)
        assert "".join(pieces) == expected
        assert detok.stopped == any(s in tok.decode(ids) for s in STOPS)
        shown = ""
        for piece in pieces:  # at no moment does the screen hold a stop string
            shown += piece
            assert not any(s in shown for s in STOPS)


def test_a_stop_string_split_over_tokens_is_held_back_then_dropped(tiny_chat):
    _, tok = tiny_chat
    detok = Detokenizer(tok, ["###"])
    shown = [detok.push(t) for t in tok("ok##", add_special_tokens=False).input_ids]
    assert "".join(shown) == "ok"  # "##" could still become "###": not shown yet
    assert detok.push(tok.convert_tokens_to_ids("#")) == "" and detok.stopped and detok.text == "ok"
    detok = Detokenizer(tok, ["###"])
    shown = [detok.push(t) for t in tok("ok##!", add_special_tokens=False).input_ids]
    assert "".join(shown) == "ok##!"  # it did not: shown as soon as it could not


@pytest.mark.embedded
@pytest.mark.slow
def test_work_per_token_is_bounded(embedded_model):
    # decoding the whole reply at every token is quadratic: count the ids decoded
    _, tok = embedded_model
    decoded = [0]

    class Counting:
        def decode(self, ids, **kwargs):
            decoded[0] += len(ids)
            return tok.decode(ids, **kwargs)

    ids = tok("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False).input_ids
    detok = Detokenizer(Counting(), ["never appears"])
    text = "".join(detok.push(t) for t in ids) + detok.finish()
    assert text == tok.decode(ids)
    assert len(ids) > 300 and decoded[0] <= 4 * len(ids)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_stop_strings_over_any_split_give_the_text_before_the_first_stop(split):
    """The one matcher the chat, the API and the evaluations share: pieces of any size give the
    text before the earliest stop string, and nothing of a stop string is ever handed out."""
    text = "Once upon a time ##\nUser: more ab the end"
    cut = StopStrings(STOPS)
    shown = []
    for i in range(0, len(text), split):
        cut.feed(text[i : i + split])
        shown.append(cut.take())
    shown.append(cut.take(final=True))
    assert "".join(shown) == cut.text == cut_at_stop(text, STOPS) == "Once upon a time ##"
    assert cut.hit and cut_at_stop(text, ()) == text and cut_at_stop("no stop", STOPS) == "no stop"
