"""panel: what the live panel shows, from a real session's ledger and cache."""

import re

import pytest

from h2o_chat import ChatSession, panel

TURNS = ["Hello <b>there</b>!", "Tell me a story about a lighthouse.", "Make it shorter.", "Who is the hero?"]


@pytest.fixture
def session(tiny_chat):
    model, tok = tiny_chat
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
    page = panel.token_map(session.ledger, ret)
    shown = shown_indices(page)
    assert shown == sorted(shown) and len(shown) + folded_count(page) == len(session.ledger)
    assert folded_count(page) > 0  # a chat 4x the budget has long evicted runs
    for status in ("sink", "heavy", "recent", "evicted"):
        assert f"st-{status}" in page
    assert "&lt;" in page and "<b>" not in page  # user text is escaped, never markup


def test_head_selector_shows_that_heads_exact_set(session):
    ret = session.ledger.retention(session.cache)
    for layer in range(2):
        for head in range(2):
            page = panel.token_map(session.ledger, ret, layer=layer, head=head)
            kept_shown = {int(m) for m in re.findall(r'class="tok st-(?!evicted)[a-z]+" data-i="(\d+)"', page)}
            assert kept_shown == set(session.cache.token_ids(layer)[0, head].tolist())


def test_hover_title_says_index_turn_score_and_heads(session):
    ret = session.ledger.retention(session.cache)
    page = panel.token_map(session.ledger, ret)
    title = re.search(r'data-i="0"[^>]*title="([^"]*)"', page).group(1)
    assert title.startswith("token 0 · turn 0 · user · sink · kept by 4/4 heads · score")


def test_top_heavy_hitters_are_heavy_and_sorted(session):
    ret = session.ledger.retention(session.cache)
    rows = panel.top_heavy(session.ledger, ret, k=5)
    assert len(rows) == 5 and [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)
    assert all(ret["status"][r["index"]] == "heavy" for r in rows)


def test_memory_rows_and_stats(session):
    rows = panel.memory_rows(session.turn_stats)
    h2o = [r for r in rows if r["series"] == "H2O cache"]
    full = [r for r in rows if r["series"] == "full cache"]
    assert len(h2o) == len(full) == len(TURNS) * 3
    assert h2o[-1]["slots"] == 48 and full[-1]["slots"] == session.stats["tokens_seen"]
    text = panel.stats_markdown(session.stats, session.ledger.retention(session.cache))
    assert f"{session.stats['tokens_seen']:,}** tokens seen" in text and "saved" in text
    assert "heavy hitters" in panel.legend_html()


def test_the_map_shows_the_tokens_its_retention_was_read_for(session):
    # a tab re-renders its panel while a reply streams in another thread: the ledger grows
    # between reading the cache and drawing the map, and the map draws what was read
    ret = session.ledger.retention(session.cache)
    n = len(session.ledger)
    session.ledger.append([1, 2, 3], ["a", "b", "c"], "assistant", 99)
    page = panel.token_map(session.ledger, ret)
    shown = shown_indices(page)
    assert len(shown) + folded_count(page) == n and max(shown) < n
