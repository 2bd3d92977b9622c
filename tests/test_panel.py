"""panel: what the live panel shows, from a real session's ledger and cache."""

import copy
import re

import pytest

from h2o_chat import ChatSession
from h2o_chat.ui import draw
from tests.conftest import make_tiny_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TURNS = ["Hello <b>there</b>!", "Tell me a story about a lighthouse.", "Make it shorter.", "Who is the hero?"]


@pytest.fixture(scope="module")
def session():
    model, tok = make_tiny_chat()
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16),
                    temperature=0, max_new_tokens=20)
    for text in TURNS * 3:
        "".join(s.send(text))
    return s


def shown_indices(page):
    return [int(i) for i in re.findall(r'data-i="(\d+)"', page)]


def folded_count(page):
    return sum(int(n.replace(",", "")) for n in re.findall(r"⋯ ([\d,]+) evicted tokens ⋯", page))


def test_every_token_is_shown_or_folded_in_order(session):
    ret = session.ledger.retention(session.cache)
    page = draw.token_map(session.ledger, ret)
    shown = shown_indices(page)
    assert shown == sorted(shown) and len(shown) + folded_count(page) == len(session.ledger)
    assert folded_count(page) > 0  # a chat 4x the budget has long evicted runs
    for status in ("sink", "heavy", "recent", "evicted"):
        assert f"st-{status}" in page
    assert "&lt;" in page and "<b>" not in page  # user text is escaped, never markup


def test_a_view_of_many_heads_draws_the_newest_tokens_and_counts_the_earlier(session, monkeypatch):
    """All heads together can keep most of a long story: that view is bounded (MAP_NEWEST); one
    head's view keeps at most its budget and is drawn whole."""
    ret = session.ledger.retention(session.cache)
    n = len(session.ledger)
    monkeypatch.setattr(draw, "MAP_NEWEST", n // 4)
    for layer in (None, 0):
        page = draw.token_map(session.ledger, ret, layer=layer)
        shown = shown_indices(page)
        earlier = n - n // 4
        kept_earlier = sum(status != "evicted" for status, _ in draw.token_statuses(ret, layer)[:earlier])
        assert f"⋯ {earlier:,} earlier tokens, {kept_earlier:,} of them kept" in page and kept_earlier > 0
        assert shown[0] == earlier and len(shown) + folded_count(page) == n // 4
    one_head = draw.token_map(session.ledger, ret, layer=0, head=0)
    assert "earlier tokens" not in one_head and len(shown_indices(one_head)) + folded_count(one_head) == n


def test_head_selector_shows_that_heads_exact_set(session):
    ret = session.ledger.retention(session.cache)
    for layer in range(2):
        for head in range(2):
            page = draw.token_map(session.ledger, ret, layer=layer, head=head)
            kept_shown = {int(m) for m in re.findall(r'class="tok st-(?!evicted)[a-z]+" data-i="(\d+)"', page)}
            assert kept_shown == set(session.cache.token_ids(layer)[0, head].tolist())


def test_hover_title_says_index_turn_score_and_heads(session):
    ret = session.ledger.retention(session.cache)
    page = draw.token_map(session.ledger, ret)
    title = re.search(r'data-i="0"[^>]*title="([^"]*)"', page).group(1)
    assert title.startswith("token 0 · turn 0 · user · sink · kept by 4/4 heads · score")


def test_top_heavy_hitters_are_heavy_and_sorted(session):
    ret = session.ledger.retention(session.cache)
    rows = draw.top_heavy(session.ledger, ret, k=5)
    assert len(rows) == 5 and [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)
    assert all(ret["status"][r["index"]] == "heavy" for r in rows)


def test_memory_rows_and_stats(session):
    rows = draw.memory_rows(session.stats, 48)
    this = [(r["tokens seen"], r["slots per head"]) for r in rows if r["cache"] == "this cache"]
    full = [(r["tokens seen"], r["slots per head"]) for r in rows if r["cache"] == "a full cache"]
    n = session.stats["tokens_seen"]
    assert this == [(0, 0), (48, 48), (n, 48)] and full == [(0, 0), (48, 48), (n, n)]  # the knee at the budget
    text = draw.stats_markdown(session.stats, session.ledger.retention(session.cache))
    assert f"{session.stats['tokens_seen']:,}** tokens seen" in text and "saved" in text
    assert "heavy hitters" in draw.legend_html("h2o") and ">kept<" in draw.legend_html("h2o")


def chart(session, column):
    """{series: [(tokens seen, value)]} of the panel's chart rows."""
    rows = draw.panel(session, maps=False)["memory"]
    return {name: [(r["tokens seen"], r[column]) for r in rows if r["cache"] == name] for name in draw.SERIES}


@pytest.mark.parametrize("turns", [1, 12])
def test_the_charts_show_the_knee_at_the_budget_from_the_first_reply(tiny_chat, turns):
    # issue 25, 4: one point per reply drew a straight line from (0, 0) to the first reply, and
    # flattened at ~350 tokens instead of the budget after 13 turns
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), temperature=0,
                    max_new_tokens=40)
    for text in (TURNS * 3)[:turns]:
        "".join(s.send(text))
    n, stats = s.stats["tokens_seen"], s.stats
    assert n > 48
    assert chart(s, "slots per head") == {"this cache": [(0, 0), (48, 48), (n, 48)],
                                          "a full cache": [(0, 0), (48, 48), (n, n)]}
    per_token = stats["full_kv_bytes"] / n
    memory = chart(s, "KV MiB")
    assert memory["this cache"][1] == (48, round(48 * per_token / 2**20, 3))  # the knee, in memory too
    assert memory["this cache"][2] == (n, round(stats["kv_bytes"] / 2**20, 3))  # now: what the cache holds
    assert memory["a full cache"][2] == (n, round(stats["full_kv_bytes"] / 2**20, 3))


def test_layers_of_their_own_budgets_draw_a_knee_each(tiny_chat):
    # a pyramid's 2 layers hold 77 and 19 slots (48 each stated): the mean slots per head bend at
    # 19 (the top layer full) and at 77 (the bottom one full), then stay at 48, the stated budget
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16, budget_shape="pyramid"),
                    temperature=0, max_new_tokens=40)
    for text in TURNS * 2:
        "".join(s.send(text))
    n, stats = s.stats["tokens_seen"], s.stats
    assert n > 77 and s.cache.limits.layers == (77, 19)
    assert chart(s, "slots per head")["this cache"] == [(0, 0), (19, 19), (77, 48), (n, 48)]
    per_token = stats["full_kv_bytes"] / n
    assert stats["kv_bytes"] == 48 * per_token  # the stated total: 77 + 19 slots = 2 layers x 48
    assert chart(s, "KV MiB")["this cache"][2] == (77, round(48 * per_token / 2**20, 3))


def test_a_replay_redraws_the_whole_history(tiny_chat):
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), temperature=0,
                    max_new_tokens=30)
    for text in TURNS:
        "".join(s.send(text))
    n = s.stats["tokens_seen"]
    s.configure(cache=dict(policy="sink", budget=32, n_sink=2, n_recent=16))  # replayed through a new cache
    assert chart(s, "slots per head")["this cache"] == [(0, 0), (32, 32), (n, 32)]  # from the start, not from now
    s.undo()
    m = s.stats["tokens_seen"]
    assert chart(s, "slots per head")["this cache"] == [(0, 0), (32, 32), (m, 32)]


def test_one_point_has_a_readable_scale():
    rows = draw.memory_rows({"tokens_seen": 57, "kv_bytes": 2.504883 * 2**20, "full_kv_bytes": 3 * 2**20,
                             "slots_used": 48}, 48)
    assert draw.chart_limits(rows, "tokens seen") == [0, pytest.approx(57 * 1.15)]
    assert rows[4]["KV MiB"] == 2.505  # rounded, not 2.504883 as a raw tick
    assert rows[0]["tokens seen"] == 0 and rows[0]["KV MiB"] == 0  # a line from the origin, not a lone point


@pytest.mark.parametrize("policy, absent", [("sink", "H2O keeps"), ("window", "heavy hitters"), ("full", "evicts")])
def test_every_sentence_fits_the_policy(policy, absent):
    legend = draw.legend_html(policy)
    assert absent not in legend
    if policy != "h2o":
        assert "st-heavy" not in legend  # no colour for a status this policy never shows


def test_a_layer_with_all_heads_shows_that_layers_union(session):
    ret = session.ledger.retention(session.cache)
    page = draw.token_map(session.ledger, ret, layer=1)
    kept_shown = {int(m) for m in re.findall(r'class="tok st-(?!evicted)[a-z]+" data-i="(\d+)"', page)}
    ids = session.cache.token_ids(1)[0]
    assert kept_shown == set(ids.flatten().tolist())  # every token some head of layer 1 keeps, no other
    assert "Layer 1, all" in page


def test_counts_and_heavy_table_follow_the_view(session):
    ret = session.ledger.retention(session.cache)
    one = draw.slot_counts(ret, layer=0, head=1)
    assert sum(one.values()) == 48  # exactly one head's slots
    rows = draw.top_heavy(session.ledger, ret, layer=0, head=1, k=50)
    held = set(session.cache.token_ids(0)[0, 1].tolist())
    assert rows and all(r["index"] in held and r["heads"] == "1/1" for r in rows)
    assert "In layer 0, head 1:" in draw.stats_markdown(session.stats, ret, 0, 1)


def test_the_summary_does_not_call_every_token_heavy(session):
    ret = session.ledger.retention(session.cache)
    statuses = draw.token_statuses(ret)
    share = ret["kept"].float().mean(dim=(0, 1))
    for t, (status, _) in enumerate(statuses):
        if status == "heavy":
            assert share[t] >= 0.5  # most heads agree; a token a few heads hold shows as "kept"


def test_the_retention_map_has_one_row_per_layer_and_shows_the_pattern(session):
    from io import BytesIO

    from PIL import Image

    ret = session.ledger.retention(session.cache)
    image = Image.open(BytesIO(draw.retention_png(ret)))
    n_layers, _, n = ret["kept"].shape
    assert image.size == (min(n, draw.MAP_COLUMNS), n_layers * draw.MAP_ROW_PX)
    pixels = image.convert("RGB").load()
    width = image.size[0]
    # sinks and the recent window: kept by every head, so drawn in the token map's own colours, whole
    assert pixels[0, 0] == draw._hex_to_rgb(draw.COLORS["sink"])
    assert pixels[width - 1, 0] == draw._hex_to_rgb(draw.COLORS["recent"])
    assert (255, 255, 255) in {pixels[x, 0] for x in range(width)}  # somewhere evicted by every head (white)
    # issue 34: blue meant "recent" in the token map and "kept by all heads" here; now a colour is one status
    assert "the colours are the token map's" in draw.retention_map_html(ret)
    assert "layer 0 → " in draw.retention_map_html(ret) and "token position 0 → " in draw.retention_map_html(ret)


def test_the_map_shows_the_tokens_its_retention_was_read_for(session):
    # a tab re-renders its panel while a reply streams in another thread: the ledger grows
    # between reading the cache and drawing the map, and the map draws what was read
    ret = session.ledger.retention(session.cache)
    n = len(session.ledger)
    ledger = copy.deepcopy(session.ledger)
    ledger.append([1, 2, 3], ["a", "b", "c"], "assistant", 99)
    page = draw.token_map(ledger, ret)
    shown = shown_indices(page)
    assert len(shown) + folded_count(page) == n and max(shown) < n


def test_a_chat_opened_without_a_reply_since_shows_no_timing(tiny_chat, tmp_path):
    # reopened after a reload or restart: the replay is no reply, so there is no TTFT to show
    # (it used to read "TTFT -0 ms · 0.0 tokens/s")
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), temperature=0,
                    max_new_tokens=5, data_dir=str(tmp_path))
    "".join(s.send("Hello there"))
    reopened = ChatSession.open(model, tok, s.id, str(tmp_path))
    assert reopened.stats["ttft_s"] is None and reopened.stats["tokens_per_s"] is None
    text = draw.stats_markdown(reopened.stats, reopened.ledger.retention(reopened.cache))
    assert "no reply yet since it was opened" in text and "TTFT" not in text
    assert "TTFT" in draw.stats_markdown(s.stats, s.ledger.retention(s.cache))


def test_the_stats_say_when_a_reply_is_still_streaming(session):
    # the browser shows no progress of its own while a reply streams: the stats line says it
    ret = session.ledger.retention(session.cache)
    assert "waiting for the first token" in draw.stats_markdown(session.stats, ret, live=(None, None))
    assert "· streaming" in draw.stats_markdown(session.stats, ret, live=(0.2, 12.5))
    assert "streaming" not in draw.stats_markdown(session.stats, ret)  # the finished turn


def test_the_stats_call_a_pin_never_evicted_only_when_every_head_holds_it(tiny_chat):
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=80, n_sink=2, n_recent=16, score="mean"),
                    temperature=0, max_new_tokens=20)
    for text in TURNS:
        "".join(s.send(text))
    s.pin(0)
    stats = draw.panel(s, maps=False)["stats"]
    assert stats.endswith(" · pinned (never evicted): message 1")
    s.messages[2].pinned = True  # pinned behind the session's back: no replay brought its evicted tokens back
    s.cache.set_pins(s._pins(s._segments()))
    stats = draw.panel(s, maps=False)["stats"]
    assert " · pinned (never evicted): message 1 · pinned, not whole: message 3 (" in stats


def union_of_kept(session):
    """The tokens some layer and KV head of the cache holds, read off the cache itself."""
    return set().union(*(set(session.cache.token_ids(layer)[0].flatten().tolist())
                         for layer in range(len(session.cache.layers))))


def test_the_stats_of_every_head_add_up_to_the_budget_and_say_what_they_count(tiny_chat):
    # issue 34: "4 sink, 103 pinned, 4 heavy, 48 recent, 576 kept" with budget 192 counted tokens
    # some head keeps; now a head's slots by status (they add up to its slots), and the tokens apart
    model, tok = tiny_chat  # score "mean": on this tiny model the heads then keep different tokens
    session = ChatSession(model, tok, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="mean"),
                          temperature=0, max_new_tokens=20)
    for text in TURNS * 2:
        "".join(session.send(text))
    ret = session.ledger.retention(session.cache)
    slots = draw.slot_counts(ret)
    assert slots == {"sink": 2, "heavy": 30, "recent": 16}  # budget 48: 2 sinks, 16 recent, the rest heavy
    assert sum(slots.values()) == session.stats["slots_used"] == 48
    some, none = draw.kept_anywhere(ret)
    assert some == len(union_of_kept(session)) and some + none == len(session.ledger)
    assert some > 48  # the heads keep different heavy hitters: the union is more than one head's slots
    text = draw.stats_markdown(session.stats, ret)
    assert (f"In all layers and heads: each KV head's 48 slots hold on average 2 sink · 30 heavy · 16 recent; "
            f"{some:,} tokens are kept by at least one head, {none:,} by none") in text
    one = draw.stats_markdown(session.stats, ret, 1, 0)
    assert f"In layer 1, head 0: its 48 slots hold 2 sink · 30 heavy · 16 recent; {len(session.ledger) - 48:,} " \
           "tokens evicted" in one


def test_pinned_slots_are_counted_as_pinned(tiny_chat):
    model, tok = tiny_chat
    s = ChatSession(model, tok, cache=dict(policy="h2o", budget=80, n_sink=2, n_recent=16), temperature=0,
                    max_new_tokens=20)
    for text in TURNS:
        "".join(s.send(text))
    s.pin(0)
    slots = draw.slot_counts(s.ledger.retention(s.cache))
    assert slots["pinned"] == len(TURNS[0]) and sum(slots.values()) == 80  # the message's characters, in every head


def test_apportion_keeps_the_total():
    assert draw.apportion({"a": 1.5, "b": 1.5, "c": 45.0}) in ({"a": 2, "b": 1, "c": 45}, {"a": 1, "b": 2, "c": 45})
    assert draw.apportion({"a": 0.2, "b": 47.8}) == {"b": 48}
