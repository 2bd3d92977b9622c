"""The real UI in a real browser (Debian's chromium, driven by Playwright), used as a person
uses it: type and press Enter, type while a reply streams, reload, restart the server, edit and
pin through the Chatbot's own buttons, pick a layer and head, restore a saved conversation.
Replies are greedy (temperature 0); every wait has a deadline. Skipped where chromium is not
installed (`.ci/run` installs it)."""

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from h2o_chat import ChatSession, Conversation, Message
from h2o_chat.bench.page import apply_settings
from h2o_chat.cache.config import CacheConfig
from h2o_chat.chat import store
from h2o_chat.chat.conversation import Sampling, Settings
from h2o_chat.ui.chat import OnePerClick
from tests.conftest import make_tiny_chat
from tests.live import deadline, free_port, live_app, never_ending

CHROMIUM = shutil.which("chromium")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"),
              pytest.mark.browser, pytest.mark.live, pytest.mark.slow]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
CACHE = dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="mean", positions="rolling")
WAIT_MS = 120_000  # generous: the CI machine may be busy
RELOAD_S = 30  # how long a page whose server restarted is given to reload itself (Gradio does it)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


def new_context(browser):
    """Every Playwright action in it waits up to WAIT_MS, not its default 30 s: while a reply
    streams into a long token map on a busy machine, the page can take longer to answer (CI saw
    the Stop button's click event wait out 30 s)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    return context


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A model that never ends its replies on its own: each runs to max_new_tokens (5000), so a
    reply is reliably still streaming while the test types, scrolls or picks."""
    model, tok = never_ending(*make_tiny_chat())
    # score "mean": on this tiny model the heads then keep different tokens, so one head's view differs
    with live_app(tmp_path_factory.mktemp("data"), model, tok, cache=CACHE, temperature=0,
                  max_new_tokens=5000) as (url, _):
        yield url


@pytest.fixture
def page(browser, app):
    context = new_context(browser)
    page = context.new_page()
    page.goto(app)
    page.wait_for_selector("#message textarea", timeout=WAIT_MS)
    wait_for_the_page_load(page)
    yield page
    context.close()


def wait_for_the_page_load(page):
    """Until the page's load event has filled every field from its conversation: a setting typed
    before that lands is overwritten by it (a busy machine delays it by seconds)."""
    # the stats start empty; the load writes them: a new chat's invitation, or a reopened chat's figures
    page.wait_for_function("() => { const t = (document.querySelector('#stats') || {}).innerText || ''; "
                           "return t.includes('Send a message') || t.includes('tokens seen'); }", timeout=WAIT_MS)


def box(page):
    return page.locator("#message textarea")


def bot_text(page):
    """The last reply's text, read in one go (the Chatbot re-renders while it streams)."""
    return page.evaluate("() => { const b = document.querySelectorAll('#chat .bot-row'); "
                         "return b.length ? b[b.length - 1].innerText : ''; }")


def wait_for_more(page, than, chars=20):
    """Until the last reply has grown `chars` characters past `than`."""
    try:
        page.wait_for_function(
            "([n]) => { const b = document.querySelectorAll('#chat .bot-row'); "
            "return b.length && b[b.length - 1].innerText.length >= n; }", arg=[len(than) + chars], timeout=WAIT_MS)
    except playwright.Error:
        page.screenshot(path="/tmp/shots/fail.png")
        raise AssertionError(f"the reply stopped at {len(bot_text(page))} characters (waited for {len(than) + chars}); "
                             f"stats: {page.inner_text('#stats')!r}") from None


def stop_and_settle(page):
    # a click event on the button, not a pointer click: while tokens stream the page reflows every
    # few frames, so Playwright can wait out its 30 s for the button to hold still and never click
    page.locator("#stop").dispatch_event("click")
    # the reply is over when the stats line is the finished turn's: while one streams it says
    # "waiting for the first token" or "streaming" (the Chatbot shows no progress of its own here)
    try:
        page.wait_for_function("() => { const t = document.querySelector('#stats').innerText; "
                               "return !t.includes('waiting for the first token') && !t.includes('streaming'); }",
                               timeout=WAIT_MS)
    except playwright.Error:
        raise AssertionError(f"the reply did not end after Stop; stats: {page.inner_text('#stats')!r}") from None
    settled = None
    for _ in range(50):  # bounded: until two reads of the reply agree
        now = bot_text(page)
        if now == settled:
            return now
        settled = now
        page.wait_for_timeout(300)
    raise AssertionError("the reply kept changing after Stop")


def send(page, text):
    box(page).fill(text)
    box(page).press("Enter")
    page.get_by_text(text).first.wait_for(timeout=WAIT_MS)


SHOWN_OR_BACK = """(text) => [...document.querySelectorAll('#chat .user-row')].some(r => r.innerText.includes(text))
    || (document.querySelector('#message textarea') || {}).value === text"""


def send_across_a_restart(page, text):
    """`send`, on a page whose server restarted. Gradio reloads such a page when it meets the new
    server: a person types into the page once it is there again (typing into a page mid-reload
    reaches no handler), so this waits, a bounded while, for that reload and the page's load. A
    message sent just before the reload was never taken: it is back in the box, never lost
    (test_a_message_the_server_never_took_is_back_in_the_box_after_a_reload), and is sent again."""
    deadline = time.monotonic() + RELOAD_S
    while page.evaluate("() => window.h2oBeforeRestart === true") and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    page.wait_for_selector("#message textarea", timeout=WAIT_MS)
    wait_for_the_page_load(page)
    box(page).fill(text)
    box(page).press("Enter")
    page.wait_for_function(SHOWN_OR_BACK, arg=text, timeout=WAIT_MS)
    if box(page).input_value() == text:
        box(page).press("Enter")
    page.get_by_text(text).first.wait_for(timeout=WAIT_MS)


def test_enter_sends_and_shift_enter_makes_a_new_line(page):
    field = box(page)
    assert "Enter sends, Shift+Enter: new line" in field.get_attribute("placeholder")
    field.click()
    field.type("line one")
    page.keyboard.press("Shift+Enter")
    field.type("line two")
    assert field.input_value() == "line one\nline two"  # Shift+Enter: a new line, nothing sent
    assert page.locator("#chat .user-row").count() == 0
    page.keyboard.press("Enter")
    page.locator("#chat .user-row").first.wait_for(timeout=WAIT_MS)
    assert page.locator("#chat .user-row").first.inner_text().strip() == "line one\nline two"
    assert field.input_value() == ""  # cleared when sent
    stop_and_settle(page)


def test_text_typed_while_a_reply_streams_stays_in_the_box(page):
    box(page).fill("Tell me a long story")
    box(page).press("Enter")
    box(page).type("typed before the first token")  # the reply is starting: no token yet
    page.locator("#chat .bot-row").first.wait_for(timeout=WAIT_MS)
    wait_for_more(page, bot_text(page))
    box(page).type(", and more while it streams")
    wait_for_more(page, bot_text(page))  # several updates later
    assert box(page).input_value() == "typed before the first token, and more while it streams"
    assert page.locator("#chat .user-row").first.inner_text().strip() == "Tell me a long story"  # only what was sent
    stop_and_settle(page)


def test_the_live_view_follows_new_tokens_and_lets_the_user_scroll_back(page):
    page.get_by_text("Cache (changing it replays the chat)").click()
    apply_settings(page, "#apply-cache", {"#budget input": "600"})  # a map longer than its box
    try:
        page.wait_for_function("() => document.querySelector('#budget input').value === '600'", timeout=WAIT_MS)
    except playwright.Error:
        raise AssertionError(f"Apply did not take: budget {page.locator('#budget input').input_value()!r}, "
                             f"page: {page.inner_text('body')[-1500:]!r}") from None
    box(page).fill("Stream a long reply after this long message:" + " word" * 300)  # the map overflows at once
    box(page).press("Enter")
    page.wait_for_selector("#token-map .token-map", timeout=WAIT_MS)
    at_end = ("() => { const m = document.querySelector('#token-map .token-map'); "
              "return m && m.scrollHeight > m.clientHeight + 50 && m.scrollHeight - m.scrollTop - m.clientHeight < 30; }")
    page.wait_for_function(at_end, timeout=WAIT_MS)  # overflowing, and showing its end
    wait_for_more(page, bot_text(page), chars=60)
    page.wait_for_function(at_end, timeout=WAIT_MS)  # still the end after new tokens came in
    # issue 34: its first line was cut in half; the box and the map are whole numbers of lines, so
    # the end (where it follows the reply) shows whole lines only
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900})
        wait_for_more(page, bot_text(page))
        lines = page.evaluate("() => { const m = document.querySelector('#token-map .token-map'); "
                              "const line = parseFloat(getComputedStyle(m).lineHeight); "
                              "return [m.clientHeight / line, m.scrollHeight / line]; }")
        assert all(abs(n - round(n)) < 0.05 for n in lines), (width, lines)
    page.set_viewport_size({"width": 1280, "height": 900})
    page.evaluate("() => { const m = document.querySelector('#token-map .token-map'); m.scrollTop = 0; "
                  "m.dispatchEvent(new Event('scroll')); }")  # the user scrolls back
    wait_for_more(page, bot_text(page), chars=60)
    assert page.evaluate("() => document.querySelector('#token-map .token-map').scrollTop") < 30  # stays there
    stop_and_settle(page)


def test_a_reload_shows_the_same_conversation(page):
    send(page, "Remember me after a reload")
    reply = stop_and_settle(page)
    page.reload()
    page.get_by_text("Remember me after a reload").first.wait_for(timeout=WAIT_MS)
    page.wait_for_function("([r]) => { const b = document.querySelectorAll('#chat .bot-row'); "
                           "return b.length && b[b.length - 1].innerText.trim() === r.trim(); }", arg=[reply],
                           timeout=WAIT_MS)
    assert "tokens seen" in page.inner_text("#stats")  # replayed: the panel shows its cache


def test_edit_and_pin_through_the_chatbots_own_controls(page):
    send(page, "The first message")
    stop_and_settle(page)
    page.locator("#chat .user-row").first.hover()
    page.locator("#chat button[aria-label='Edit']").first.click()
    page.locator("#chat textarea.edit-textarea").fill("The edited message")
    page.locator("#chat button[aria-label='Submit']").click()
    page.wait_for_function("() => document.querySelector('#chat .user-row').innerText.includes('The edited message')",
                           timeout=WAIT_MS)
    page.wait_for_function("() => document.querySelector('#token-map').innerText.includes('edited')", timeout=WAIT_MS)

    page.locator("#chat .user-row").first.hover()
    page.locator("#chat .extra-feedback > button").first.click()
    page.locator("#chat .extra-feedback-option", has_text="Pin (never evict)").first.click()
    page.wait_for_selector("#token-map .tok.st-pinned", timeout=WAIT_MS)
    page.wait_for_function("() => document.querySelector('#stats').innerText.includes('pinned (never evicted): message 1')",
                           timeout=WAIT_MS)
    page.locator("#chat .user-row").first.hover()
    page.locator("#chat .extra-feedback > button").first.click()
    page.locator("#chat .extra-feedback-option", has_text="Unpin").first.click()
    page.wait_for_function("() => !document.querySelector('#token-map .tok.st-pinned')", timeout=WAIT_MS)


def pick(page, selector, value):
    page.click(f"{selector} input")
    listbox = page.get_attribute(f"{selector} input", "aria-controls")  # this dropdown's own list
    page.locator(f"#{listbox}").get_by_role("option", name=value, exact=True).click()


def test_the_panel_views_and_the_charts_legends(page, tmp_path):
    send(page, "Hello there, tell me a story")
    page.wait_for_selector("#token-map .tok.st-evicted", timeout=WAIT_MS)  # the reply outgrew the budget
    stop_and_settle(page)
    for status in ("sink", "recent"):
        assert page.locator(f"#token-map .tok.st-{status}").count() > 0
    assert page.locator("#retention-map img").count() == 1
    for chart in ("#memory-chart", "#slots-chart"):
        text = page.inner_text(chart)
        assert "tokens seen" in text
        for series in ("this cache", "a full cache"):  # the legend names both series, inside the chart's box
            try:  # the charts are redrawn when the reply ends (not while it streams): wait for the drawing
                page.wait_for_function(
                    "([chart, name]) => { const c = document.querySelector(chart).getBoundingClientRect(); "
                    "const t = [...document.querySelectorAll(chart + ' .role-legend-label text')]"
                    ".find(e => e.textContent === name); if (!t) return false; const r = t.getBoundingClientRect(); "
                    "return r.height > 0 && r.top >= c.top && r.bottom <= c.bottom && r.left >= c.left "
                    "&& r.right <= c.right; }", arg=[chart, series], timeout=WAIT_MS)
            except playwright.Error:
                raise AssertionError(f"{chart}: legend entry {series!r} missing or clipped") from None
    assert "KV memory (MiB)" in page.inner_text("#memory-chart")
    for chart in ("#memory-chart", "#slots-chart"):  # each series drawn from the origin to the reply's end,
        try:  # on number axes (an empty first value once made them categories; a value once showed a reply late)
            page.wait_for_function(
                "([chart]) => { const lines = [...document.querySelectorAll(chart + ' .mark-line path')]; "
                "const axes = [...document.querySelectorAll(chart + ' .role-axis[aria-label]')]; "
                "return lines.length === 2 && lines.every(l => (l.getAttribute('d') || '').includes('L')) "
                "&& axes.length === 2 && axes.every(a => a.getAttribute('aria-label').includes('linear scale')); }",
                arg=[chart], timeout=WAIT_MS)
        except playwright.Error:
            raise AssertionError(f"{chart} is not drawn: {page.inner_html(chart)[:2000]}") from None
    # the summary shows every token some (layer, head) keeps: at least one head's 48 slots
    assert page.locator("#token-map .tok:not(.st-evicted)").count() >= 48

    pick(page, "#layer", "1")
    page.wait_for_function("() => document.querySelector('#stats').innerText.includes('In layer 1:')", timeout=WAIT_MS)
    assert page.locator("#retention-map .rmap-mark").count() == 1
    pick(page, "#head", "0")
    page.wait_for_function("() => document.querySelector('#stats').innerText.includes('In layer 1, head 0:')",
                           timeout=WAIT_MS)
    page.wait_for_function(
        "() => document.querySelectorAll('#token-map .tok:not(.st-evicted)').length === 48", timeout=WAIT_MS)
    page.screenshot(path=str(tmp_path / "browser.png"), full_page=True)


def field(page, elem_id):
    return page.locator(f"#{elem_id} input, #{elem_id} textarea").first.input_value()


def test_restore_brings_back_the_saved_settings_and_the_fields_show_them(page):
    page.get_by_text("Cache (changing it replays the chat)").click()
    page.get_by_text("Generation").first.click()
    # the page's load fills every field from its conversation: typing before that would be overwritten
    page.wait_for_function("() => document.querySelector('#max-new-tokens input')?.value === '5000'", timeout=WAIT_MS)
    send(page, "Restore me with my settings")
    stop_and_settle(page)
    # each Apply's answer fills every field from the conversation, so the next fields are typed only
    # once it has landed (it shows: the chat is replayed, and the stats change with it)
    apply_settings(page, "#apply-cache", {"#budget input": "40"})
    page.wait_for_function("() => document.querySelector('#stats').innerText.includes('40 slots per head')",
                           timeout=WAIT_MS)  # the cache the chat now runs on
    stats_before = page.inner_text("#stats")
    page.locator("#max-new-tokens input").fill("500")
    page.locator("#system-prompt textarea").fill("You are a lighthouse keeper.")
    page.click("#apply-sampling")
    page.wait_for_function("(before) => document.querySelector('#stats').innerText !== before", arg=stats_before,
                           timeout=WAIT_MS)  # a new system prompt replays the chat: more tokens seen

    page.click("#new-chat")
    page.wait_for_function("() => document.querySelectorAll('#chat .user-row').length === 0", timeout=WAIT_MS)
    page.wait_for_function("() => document.querySelector('#budget input').value === '48'", timeout=WAIT_MS)
    assert field(page, "max-new-tokens") == "5000" and field(page, "system-prompt") == ""  # the new chat's own settings

    page.get_by_text("Saved conversations and export").click()
    pick_saved = page.locator("#saved input")
    pick_saved.click()
    listbox = pick_saved.get_attribute("aria-controls")
    page.locator(f"#{listbox}").get_by_role("option").filter(has_text="Restore me with my settings").first.click()
    page.click("#restore")
    page.get_by_text("Restore me with my settings").first.wait_for(timeout=WAIT_MS)
    page.wait_for_function("() => document.querySelector('#budget input').value === '40'", timeout=WAIT_MS)
    assert field(page, "max-new-tokens") == "500" and field(page, "system-prompt") == "You are a lighthouse keeper."
    assert "40 slots per head" in page.inner_text("#stats")


def test_after_a_server_restart_the_same_page_shows_the_conversation(browser, tmp_path):
    model, tok = make_tiny_chat()
    data, port = tmp_path / "data", free_port()
    context = new_context(browser)
    page = context.new_page()
    try:
        with live_app(data, model, tok, cache=CACHE, port=port, temperature=0, max_new_tokens=24) as (url, _):
            page.goto(url)
            page.wait_for_selector("#message textarea", timeout=WAIT_MS)
            wait_for_the_page_load(page)
            send(page, "Survive a restart")
            page.locator("#chat .bot-row").first.wait_for(timeout=WAIT_MS)
            reply = stop_and_settle(page)
            page.evaluate("() => { window.h2oBeforeRestart = true; }")  # gone once Gradio reloads the page
        # the server is gone; a new one starts on the same port and data folder
        with live_app(data, model, tok, cache=CACHE, port=port, temperature=0, max_new_tokens=24) as (url, _):
            send_across_a_restart(page, "Still the same chat?")  # the same page: the conversation goes on
            page.wait_for_function("() => document.querySelectorAll('#chat .bot-row').length === 2", timeout=WAIT_MS)
            page.reload()
            page.get_by_text("Survive a restart").first.wait_for(timeout=WAIT_MS)
            page.get_by_text("Still the same chat?").first.wait_for(timeout=WAIT_MS)
            assert page.locator("#chat .bot-row").first.inner_text().strip() == reply.strip()
    finally:
        context.close()


def test_a_message_the_server_never_took_is_back_in_the_box_after_a_reload(page):
    # the send's request fails (a server going down), then the page loads again: the message was
    # never taken, so it is in the box, not lost; sent from there, it is answered
    page.route("**/gradio_api/queue/join*", lambda route: route.abort())
    box(page).fill("Do not lose me")
    box(page).press("Enter")
    page.wait_for_function("() => document.querySelector('#message textarea').value === ''", timeout=WAIT_MS)
    page.unroute("**/gradio_api/queue/join*")
    page.reload()
    wait_for_the_page_load(page)
    page.wait_for_function("() => document.querySelector('#message textarea').value === 'Do not lose me'",
                           timeout=WAIT_MS)
    assert page.locator("#chat .user-row").count() == 0
    box(page).press("Enter")
    page.locator("#chat .bot-row").first.wait_for(timeout=WAIT_MS)
    stop_and_settle(page)
    assert "Do not lose me" in page.locator("#chat .user-row").first.inner_text()
    page.reload()  # taken: a later load leaves the box empty
    wait_for_the_page_load(page)
    page.locator("#chat .user-row").first.wait_for(timeout=WAIT_MS)
    assert box(page).input_value() == ""


def test_two_tabs_stream_at_once_in_one_batch(browser, tmp_path):
    """--concurrency 2: two people in two tabs both get their replies streaming at the same time
    (their decode steps share one batched forward), and Stop in one leaves the other streaming."""
    model, tok = never_ending(*make_tiny_chat())
    with live_app(tmp_path / "data", model, tok, cache=CACHE, concurrency=2, temperature=0,
                  max_new_tokens=5000) as (url, demo):
        contexts = [new_context(browser) for _ in range(2)]
        try:
            pages = [c.new_page() for c in contexts]
            for page in pages:
                page.goto(url)
                page.wait_for_selector("#message textarea", timeout=WAIT_MS)
                wait_for_the_page_load(page)
            for page, text in zip(pages, ("First tab here", "Second tab here")):
                send(page, text)
            for page in pages:
                wait_for_more(page, "")
            assert demo.batcher.largest_batch == 2
            stopped = stop_and_settle(pages[0])
            streaming = bot_text(pages[1])
            wait_for_more(pages[1], streaming)  # the other tab goes on
            assert bot_text(pages[0]) == stopped
            stop_and_settle(pages[1])
        finally:
            for c in contexts:
                c.close()


# --- issue 25: the story writer's promises ------------------------------------------------------------------

SHOTS = os.environ.get("H2O_CHAT_SHOTS")  # a folder to keep the screenshots in (else the test's tmp_path)


def shot(page, name, tmp_path, full_page=False):
    """A screenshot, kept where H2O_CHAT_SHOTS says (to be looked at) and in tmp_path."""
    for folder in filter(None, (SHOTS, str(tmp_path))):
        os.makedirs(folder, exist_ok=True)
        page.screenshot(path=os.path.join(folder, f"{name}.png"), full_page=full_page)


@pytest.fixture(scope="module")
def short_app(tmp_path_factory):
    """Replies of at most 30 tokens (greedy): (url, demo)."""
    with live_app(tmp_path_factory.mktemp("data"), cache=CACHE, temperature=0, max_new_tokens=30) as (url, demo):
        yield url, demo


def open_page(browser, url, width=1280, height=900):
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#message textarea", timeout=WAIT_MS)
    wait_for_the_page_load(page)
    return context, page


def settled(page):
    """Until the reply has ended (the stats are the finished turn's) and the chat has its text."""
    page.wait_for_function("() => { const t = document.querySelector('#stats').innerText; return t.includes("
                           "'tokens seen') && !t.includes('waiting for the first token') && !t.includes('streaming'); }",
                           timeout=WAIT_MS)
    page.wait_for_timeout(300)


def send_and_settle(page, text):
    send(page, text)
    settled(page)


def users(page):
    return page.evaluate("() => [...document.querySelectorAll('#chat .user-row')].map(e => e.innerText.trim())")


def toasts(page, text):
    """How many toasts showing `text` the page holds now."""
    return page.evaluate("(t) => [...document.querySelectorAll('.toast-wrap .toast-item')]"
                         ".filter(e => e.innerText.includes(t)).length", text)


def feedback_menu(page, row):
    """Hover the message's flag: its Pin / Unpin menu opens; (menu box, chat box)."""
    page.locator("#chat .message-row").nth(row).hover()
    buttons = page.locator("#chat .message-buttons").nth(row)  # each message's buttons sit after it
    buttons.locator(".extra-feedback > button").hover()
    menu = buttons.locator(".extra-feedback-options")
    menu.wait_for(state="visible", timeout=WAIT_MS)
    return menu.bounding_box(), page.locator("#chat").bounding_box()


def inside(inner, outer):
    return (inner["x"] >= outer["x"] and inner["y"] >= outer["y"] and inner["x"] + inner["width"] <= outer["x"]
            + outer["width"] and inner["y"] + inner["height"] <= outer["y"] + outer["height"])


def test_one_click_is_one_event_the_menu_fits_and_undo_gives_the_message_back(browser, short_app, monkeypatch):
    # issue 25, 3 and 7: one click on Pin sent the pin twice (a "changed elsewhere" warning and a
    # "(copy)" fork, refusals shown twice); the menu was cut off at the chat's edge; Undo lost the message
    calls = []
    for name in ("pin", "undo", "edit", "regenerate"):
        original = getattr(ChatSession, name)
        monkeypatch.setattr(ChatSession, name, lambda self, *a, _f=original, _n=name, **k: calls.append(_n) or
                            _f(self, *a, **k))
    context, page = open_page(browser, short_app[0])
    try:
        send_and_settle(page, "The keeper is Ada.")
        feedback_menu(page, 0)
        page.locator("#chat .message-buttons").first.locator(".extra-feedback-option", has_text="Pin (never evict)").click()
        page.wait_for_function("() => document.querySelector('#stats').innerText.includes('pinned (never evicted): "
                               "message 1')", timeout=WAIT_MS)
        page.wait_for_timeout(1000)  # a second copy of the event would have landed by now
        assert calls == ["pin"] and toasts(page, "changed elsewhere") == 0
        send_and_settle(page, "A message far too long to be pinned beside the recent window of this cache.")
        calls.clear()
        feedback_menu(page, 2)
        page.locator("#chat .message-buttons").nth(2).locator(".extra-feedback-option", has_text="Pin (never evict)").click()
        page.wait_for_function("() => [...document.querySelectorAll('.toast-wrap .toast-item')].some(e => "
                               "e.innerText.includes('raise the budget or lower the recent window'))", timeout=WAIT_MS)
        page.wait_for_timeout(1000)
        assert calls == ["pin"] and toasts(page, "raise the budget or lower the recent window") == 1  # said once
        for width, height in ((1280, 900), (390, 844)):
            page.set_viewport_size({"width": width, "height": height})
            for row in (0, 1):  # the user's message (at the right edge) and the reply (at the left)
                menu, chat = feedback_menu(page, row)
                assert inside(menu, chat), (width, row, menu, chat)  # "Pin (neve": cut off no more
        page.set_viewport_size({"width": 1280, "height": 900})
        calls.clear()
        page.locator("#chat .user-row").first.hover()  # message 1 is pinned: an edit it no longer fits is refused
        page.locator("#chat .message-buttons").first.locator("button[aria-label='Edit']").click()
        longer = "The keeper is Ada, and her brother Tom is lost at sea."
        page.locator("#chat textarea.edit-textarea").fill(longer)
        page.locator("#chat button[aria-label='Submit']").click()
        page.wait_for_function("(t) => document.querySelector('#message textarea').value === t", arg=longer,
                               timeout=WAIT_MS)  # refused: what was typed in the edit is in the box, not lost
        assert calls == ["edit"] and users(page)[0] == "The keeper is Ada."
        box(page).fill("")
        calls.clear()
        page.locator("#chat .bot-row").last.hover()
        page.locator("#chat .message-buttons").last.locator("button[aria-label='Retry']").click()
        settled(page)
        page.locator("#chat .bot-row").last.hover()
        page.locator("#chat .message-buttons").last.locator("button[aria-label='Undo']").click()
        page.wait_for_function("() => document.querySelectorAll('#chat .user-row').length === 1", timeout=WAIT_MS)
        assert calls == ["regenerate", "undo"]
        page.wait_for_function("() => document.querySelector('#message textarea').value.startsWith('A message far')",
                               timeout=WAIT_MS)  # the undone message is back in the box, to edit and send again
    finally:
        context.close()


def test_the_picked_view_survives_a_reload(browser, short_app):
    context, page = open_page(browser, short_app[0])
    try:
        send_and_settle(page, "Remember my view")
        pick(page, "#layer", "1")
        page.wait_for_function("() => document.querySelector('#stats').innerText.includes('In layer 1:')",
                               timeout=WAIT_MS)
        pick(page, "#head", "0")
        page.wait_for_function("() => document.querySelector('#stats').innerText.includes('In layer 1, head 0:')",
                               timeout=WAIT_MS)
        page.reload()
        page.wait_for_selector("#message textarea", timeout=WAIT_MS)
        page.wait_for_function("() => document.querySelector('#stats').innerText.includes('In layer 1, head 0:')",
                               timeout=WAIT_MS)
        assert (page.locator("#layer input").input_value(), page.locator("#head input").input_value()) == ("1", "0")
    finally:
        context.close()


def line_points(page, chart):
    """Each drawn line of a chart as its points [(x, y)] in SVG pixels (y grows downwards)."""
    paths = page.evaluate(f"() => [...document.querySelectorAll('{chart} .mark-line path')].map(p => "
                          "p.getAttribute('d'))")
    return [[tuple(map(float, xy.split(","))) for xy in re.findall(r"[-\d.]+,[-\d.]+", d)] for d in paths]


def knee(points):
    """The line rises to a knee, then runs flat: the knee's x, else None."""
    if len(points) == 3 and abs(points[1][1] - points[2][1]) < 0.5 and points[1][1] < points[0][1] - 5:
        return points[1][0]
    return None


@pytest.mark.parametrize("width, height", [(1280, 900), (390, 844)])
def test_the_charts_show_the_knee_at_the_budget_after_1_and_after_12_replies(browser, tmp_path, width, height):
    # issue 25, 4: one point per reply drew no knee after one reply and flattened at ~350 tokens
    # after 13; the charts now run per token seen, the knee at the budget (48) from the first reply
    with live_app(tmp_path / "data", cache=CACHE, temperature=0, max_new_tokens=30) as (url, _):
        context, page = open_page(browser, url, width, height)
        try:
            for n in range(1, 13):
                send_and_settle(page, f"Reply {n}, tell me more of the story.")
                if n not in (1, 12):
                    continue
                seen = int(re.search(r"([\d,]+)\s*tokens seen", page.inner_text("#stats")).group(1).replace(",", ""))
                assert seen > 48
                page.locator("#slots-chart").scroll_into_view_if_needed()
                for chart in ("#slots-chart", "#memory-chart"):
                    page.wait_for_function(f"() => document.querySelectorAll('{chart} .mark-line path').length === 2",
                                           timeout=WAIT_MS)
                    page.wait_for_timeout(500)  # the second drawing (Tab.charts_after)
                    knees = [knee(points) for points in line_points(page, chart)]
                    assert sum(k is not None for k in knees) == 1, (chart, n, line_points(page, chart))
                shot(page, f"charts-{width}-after-{n}-repl{'y' if n == 1 else 'ies'}", tmp_path, full_page=True)
        finally:
            context.close()


def test_a_v1_story_is_listed_picked_and_watched_while_it_streams(browser, tmp_path):
    # issue 25: a story sent through /v1 by the openai client is in the page's list, and its panel
    # follows the client's reply while it streams
    import threading

    import openai

    model, tok = never_ending(*make_tiny_chat())
    with live_app(tmp_path / "data", model, tok, cache=CACHE, api=True, concurrency=2, temperature=0,
                  max_new_tokens=5000) as (url, demo):
        client = openai.OpenAI(base_url=url + "v1", api_key="x", default_headers={"User-Agent": "SillyTavern/1.12"})
        chunks, done = [], threading.Event()

        def story():
            try:
                for chunk in client.chat.completions.create(
                        model="h2o-chat", stream=True, max_tokens=30000, temperature=0,
                        messages=[{"role": "system", "content": "You tell stories."},
                                  {"role": "user", "content": "Ada keeps the lighthouse.\nTell me her story."}]):
                    chunks.append(chunk)
            finally:
                done.set()

        threading.Thread(target=story, daemon=True).start()
        context, page = open_page(browser, url)
        try:
            page.get_by_text("Saved conversations and export").click()
            for _ in deadline(60):
                if chunks:
                    break
            picker = page.locator("#saved input")
            picker.click()
            listbox = picker.get_attribute("aria-controls")
            option = page.locator(f"#{listbox}").get_by_role("option").filter(has_text="live /v1").first
            assert option.inner_text().strip() == "● live /v1 · SillyTavern · Ada keeps the lighthouse."
            option.click()
            page.click("#restore")
            page.get_by_text("Ada keeps the lighthouse.").first.wait_for(timeout=WAIT_MS)  # its chat, in the column
            page.wait_for_function("() => document.querySelector('#chat').innerText.includes('read-only')",
                                   timeout=WAIT_MS)
            counts = []
            for _ in deadline(120):
                found = re.search(r"([\d,]+)\s*tokens seen", page.inner_text("#stats"))
                if found and (not counts or int(found.group(1).replace(",", "")) != counts[-1]):
                    counts.append(int(found.group(1).replace(",", "")))
                if len(counts) >= 3:
                    break
            assert not done.is_set(), "the client's reply ended before the page saw it grow"
            assert counts == sorted(counts) and len(set(counts)) == 3  # the token count grows while it streams
            assert "streaming" in page.inner_text("#stats")
            assert page.locator("#token-map .tok").count() > 0 and page.locator("#retention-map img").count() == 1
            shot(page, "watch-v1-1280", tmp_path)
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_timeout(1500)
            shot(page, "watch-v1-390", tmp_path, full_page=True)
            page.set_viewport_size({"width": 1280, "height": 900})
            # issue 34: read-only, and it shows: the box, Send, Stop and Continue are disabled, and no
            # message offers edit, retry, undo or its pin flag (copy stays: reading is what it is for)
            assert box(page).is_disabled() and "Read-only" in box(page).get_attribute("placeholder")
            assert [page.locator(b).is_disabled() for b in ("#send", "#stop", "#continue")] == [True] * 3
            assert writing_buttons(page) == {"copy": 2, "edit": 0, "retry": 0, "undo": 0, "flag": 0}
            page.click("#new-chat")  # back to writing: everything is offered again
            page.wait_for_function("() => !document.querySelector('#message textarea').disabled", timeout=WAIT_MS)
            assert not any(page.locator(b).is_disabled() for b in ("#send", "#stop", "#continue"))
            for session, _ in demo.router.pool.watchable():
                session.stop()  # the tiny model's reply would outrun what follows
            send(page, "Now I write here")
            stop_and_settle(page)
            offered = writing_buttons(page)
            assert offered["edit"] == offered["flag"] == 2 and offered["retry"] == offered["undo"] == 1, offered
        finally:
            context.close()
            for session, _ in demo.router.pool.watchable():
                session.stop()
            done.wait(timeout=60)


def writing_buttons(page):
    """How many of each message button the chat shows (visible ones)."""
    return page.evaluate("""() => { const seen = (sel) => [...document.querySelectorAll('#chat ' + sel)]
        .filter(e => e.offsetParent !== null).length;
      return {copy: seen("button[aria-label='Copy message']"), edit: seen("button[aria-label='Edit']"),
              retry: seen("button[aria-label='Retry']"), undo: seen("button[aria-label='Undo']"),
              flag: seen('.extra-feedback > button')}; }""")


def test_two_tabs_show_every_message_after_reloads_and_a_server_restart(browser, tmp_path):
    # issue 25, 6: a second tab's message vanished from view after a reload (it was in a fork),
    # and a new tab after a restart did not show the conversation
    model, tok = make_tiny_chat()
    data, port = tmp_path / "data", free_port()
    everything = ["From the first tab", "From the second tab", "The first tab again"]
    context = new_context(browser)  # one browser: its tabs share what it remembers
    try:
        with live_app(data, model, tok, cache=CACHE, port=port, temperature=0, max_new_tokens=12) as (url, _):
            first = context.new_page()
            first.goto(url)
            wait_for_the_page_load(first)
            send_and_settle(first, "From the first tab")
            second = context.new_page()  # a new tab: the conversation this browser showed last
            second.goto(url)
            wait_for_the_page_load(second)
            assert users(second) == ["From the first tab"]
            send_and_settle(second, "From the second tab")
            send_and_settle(first, "The first tab again")  # it catches up, then sends after the second's message
            for page in (first, second):
                page.reload()
                wait_for_the_page_load(page)
                page.get_by_text("The first tab again").first.wait_for(timeout=WAIT_MS)
                assert users(page) == everything
            assert len(store.list_ids(data)) == 1  # one conversation: no fork
        with live_app(data, model, tok, cache=CACHE, port=port, temperature=0, max_new_tokens=12) as (url, _):
            third = context.new_page()  # a new tab after the restart: the same conversation
            third.goto(url)
            wait_for_the_page_load(third)
            third.get_by_text("The first tab again").first.wait_for(timeout=WAIT_MS)
            assert users(third) == everything
    finally:
        context.close()


# --- issue 34: one live session per conversation, Delete, pins as state, a page that tells the truth -------------

STORY_TURNS = 12  # ~600 characters each way: ~7,000 tokens of the tiny model (one token a character)


def long_story(data_dir):
    """A story of thousands of tokens, saved as a person would have written it: its id."""
    words = "the keeper lit the lamp and watched the ships pass through the storm while gulls cried".split()
    messages = []
    for turn in range(STORY_TURNS):
        messages.append(Message("user", f"Chapter {turn}: " + " ".join(words[(turn + i) % len(words)] for i in range(50))))
        messages.append(Message("assistant", " ".join(words[(turn * 3 + i) % len(words)] for i in range(60))))
    settings = Settings(CacheConfig(**CACHE), Sampling(temperature=0, max_new_tokens=5000))  # replies run until stopped
    conversation = Conversation(settings=settings, messages=messages)
    store.write(data_dir, conversation)
    return conversation.id


def slowed(model, seconds):
    """Every forward of `model` takes `seconds` longer: the tiny model's replay then lasts as long as
    a real one does, long enough to see its progress bar (and a reply streams for a while)."""
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


# a progress bar is drawn by a component's status tracker, with its percentage ("Replaying the
# conversation - 7.3%"): one tracker per bar shown (a tracker without one is Gradio's plain "pending")
VISIBLE_BARS = ("() => [...document.querySelectorAll('[data-testid=\"status-tracker\"]')]"
                ".filter(t => t.offsetParent !== null && t.getBoundingClientRect().width > 0 "
                "&& getComputedStyle(t).opacity !== '0' && getComputedStyle(t).visibility !== 'hidden' "
                "&& /\\d%/.test(t.innerText))"
                ".map(t => !!t.closest('#chat'))")


def bars_until(page, done_js, seconds=120):
    """Poll the progress bars the page shows until `done_js` holds: [(how many, all in the chat)]."""
    seen = []
    for _ in deadline(seconds):
        bars = page.evaluate(VISIBLE_BARS)
        seen.append((len(bars), all(bars)))
        if page.evaluate(done_js):
            return seen
    return seen


def chat_ends_with(text):
    return f"() => {{ const b = document.querySelectorAll('#chat .bot-row'); " \
           f"return b.length && b[b.length - 1].innerText.trim().endsWith({text!r}); }}"


def pick_saved(page, has_text):
    picker = page.locator("#saved input")
    picker.click()
    page.locator(f"#{picker.get_attribute('aria-controls')}").get_by_role("option").filter(has_text=has_text).first.click()


def test_a_long_story_reloads_without_a_replay_and_two_tabs_share_its_one_session(browser, tmp_path):
    data = tmp_path / "data"
    story = long_story(data)
    model, tok = never_ending(*make_tiny_chat())
    with live_app(data, slowed(model, 0.03), tok, cache=CACHE, concurrency=2, temperature=0,
                  max_new_tokens=5000) as (url, demo):
        live = demo.h2o_app.live
        context = new_context(browser)  # one browser: its tabs share what it remembers
        try:
            first = context.new_page()
            first.goto(url)
            wait_for_the_page_load(first)
            first.get_by_text("Saved conversations and export").click()
            pick_saved(first, "Chapter 0")
            first.click("#restore")
            last = store.read(data, story).messages[-1].content[-30:]
            seen = bars_until(first, chat_ends_with(last))
            shot(first, "story-replay-1280", tmp_path)
            # issue 34: "Replaying the conversation" was drawn five times; now once, over the chat
            assert max(n for n, _ in seen) == 1 and all(inside for n, inside in seen if n), seen
            first.wait_for_function("() => document.querySelector('#stats').innerText.includes('tokens seen')",
                                    timeout=WAIT_MS)
            session = live.get(story)
            processed = session.timeline.tokens_processed
            assert session.stats["tokens_seen"] > 5000 and processed >= session.stats["tokens_seen"]

            started = time.monotonic()
            first.reload()
            seen = bars_until(first, chat_ends_with(last))
            reload_s = time.monotonic() - started
            assert max(n for n, _ in seen) == 0, seen  # no replay, so no progress bar
            assert live.get(story) is session and session.timeline.tokens_processed == processed  # no token computed
            assert reload_s < 20, reload_s  # generous for a busy machine; the replay alone took longer

            second = context.new_page()  # a new tab opens what the browser showed last: the same session
            second.goto(url)
            second.wait_for_function(chat_ends_with(last), timeout=WAIT_MS)
            assert live.get(story) is session and session.timeline.tokens_processed == processed
            for _ in deadline(30):
                if live.tabs(story) == 2:
                    break

            # one session, one reply at a time: a send from the second tab while the first tab's reply
            # streams is refused with a sentence, and the text stays in the box
            send(first, "Go on with the story")
            wait_for_more(first, bot_text(first))
            box(second).fill("A message from the second tab")
            box(second).press("Enter")
            second.wait_for_function("() => [...document.querySelectorAll('.toast-wrap .toast-item')].some(e => "
                                     "e.innerText.includes('A reply is being written in this conversation'))",
                                     timeout=WAIT_MS)
            second.wait_for_function("() => document.querySelector('#message textarea').value === "
                                     "'A message from the second tab'", timeout=WAIT_MS)
            shot(second, "story-second-tab-refused-1280", tmp_path)
            stop_and_settle(first)
            box(second).press("Enter")  # once the reply has ended it goes, after the first tab's exchange
            second.wait_for_function("() => document.querySelector('#message textarea').value === ''",
                                     timeout=WAIT_MS)
            second.wait_for_function(f"() => document.querySelectorAll('#chat .user-row').length === "
                                     f"{STORY_TURNS + 2}", timeout=WAIT_MS)
            assert users(second)[-2:] == ["Go on with the story", "A message from the second tab"]
            stop_and_settle(second)
            assert live.get(story) is session and [m.content for m in session.messages if m.role == "user"][-2:] == \
                users(second)[-2:]

            first.close()  # closing one tab leaves the session the other tab shows
            for _ in deadline(30):
                if live.tabs(story) == 1:
                    break
            assert live.get(story) is session
            second.set_viewport_size({"width": 390, "height": 844})
            second.wait_for_timeout(1000)
            shot(second, "story-second-tab-390", tmp_path)
        finally:
            context.close()


def menu_of(page, row):
    """The message's flag: (its title, the options its menu shows)."""
    page.locator("#chat .message-row").nth(row).hover()
    buttons = page.locator("#chat .message-buttons").nth(row)
    flag = buttons.locator(".extra-feedback > button")
    flag.hover()
    buttons.locator(".extra-feedback-options").wait_for(state="visible", timeout=WAIT_MS)
    return flag.get_attribute("title"), buttons.locator(".extra-feedback-option:visible").all_inner_texts()


def test_pin_is_named_and_shown_as_the_message_state(browser, short_app, tmp_path, monkeypatch):
    # issue 34: Pin lived behind a button titled "Feedback" whose menu offered Pin and Unpin whatever
    # the state; now the flag says what it does, the menu offers the one action that applies, and a
    # pinned message carries a mark
    context, page = open_page(browser, short_app[0])
    pinned_rows = "() => [...document.querySelectorAll('#chat .message-row')].map(r => r.classList.contains('pinned'))"
    try:
        send_and_settle(page, "The keeper is Ada.")
        assert menu_of(page, 0) == ("Pin: never evict this message", ["Pin (never evict)"])
        page.locator("#chat .message-buttons").first.locator(".extra-feedback-option:visible").click()
        page.wait_for_function("() => document.querySelector('#chat .message-row').classList.contains('pinned')",
                               timeout=WAIT_MS)
        assert page.evaluate(pinned_rows) == [True, False]
        assert "pinned · never evicted" in page.evaluate(
            "() => getComputedStyle(document.querySelector('#chat .message-row.pinned .message-content'), '::after')"
            ".content")
        assert menu_of(page, 0) == ("Pinned: never evicted (open for Unpin)", ["Unpin"])
        assert menu_of(page, 1)[1] == ["Pin (never evict)"]  # the reply is not pinned
        shot(page, "pinned-1280", tmp_path)
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(500)
        shot(page, "pinned-390", tmp_path)
        page.set_viewport_size({"width": 1280, "height": 900})
        page.reload()
        wait_for_the_page_load(page)
        page.wait_for_function(f"() => JSON.stringify(({pinned_rows})()) === '[true,false]'", timeout=WAIT_MS)
        page.locator("#chat .message-buttons").first.locator(".extra-feedback > button").hover()
        page.locator("#chat .message-buttons").first.locator(".extra-feedback-option:visible").click()  # Unpin
        page.wait_for_function(f"() => JSON.stringify(({pinned_rows})()) === '[false,false]'", timeout=WAIT_MS)
        assert menu_of(page, 0) == ("Pin: never evict this message", ["Pin (never evict)"])
        assert "pinned (never evicted)" not in page.inner_text("#stats")
        # a pin refused (no room) leaves the menu offering Pin, and Pin asked again is a pin again
        # (the Chatbot, remembering the last click, sends it as "no choice": never as an Unpin)
        send_and_settle(page, "A message far too long to be pinned beside the recent window of this cache.")
        asked = []
        original = ChatSession.pin
        monkeypatch.setattr(ChatSession, "pin", lambda self, turn, pinned=True: asked.append((turn, pinned)) or
                            original(self, turn, pinned))
        for times in (1, 2):
            page.wait_for_timeout(1000 * OnePerClick.WINDOW_S + 100)  # sooner, a click is taken for the last one's copy
            assert menu_of(page, 2)[1] == ["Pin (never evict)"]
            page.locator("#chat .message-buttons").nth(2).locator(".extra-feedback-option:visible").click()
            for _ in deadline(60):
                if len(asked) >= times:
                    break
            page.wait_for_function("() => [...document.querySelectorAll('.toast-wrap .toast-item')].some(e => "
                                   "e.innerText.includes('raise the budget or lower the recent window'))",
                                   timeout=WAIT_MS)
        assert asked == [(2, True), (2, True)]  # each click a pin (its copy dropped), never an unpin
        assert page.evaluate(pinned_rows) == [False, False, False, False]
    finally:
        context.close()


def test_delete_asks_first_then_removes_the_conversation_and_leaves_a_new_chat(browser, short_app, tmp_path):
    url, demo = short_app
    data = demo.h2o_app.data_dir
    context, page = open_page(browser, url)
    try:
        send_and_settle(page, "Delete me afterwards")
        (doomed,) = [i for i in store.list_ids(data) if store.read(data, i).messages[0].content == "Delete me afterwards"]
        page.get_by_text("Saved conversations and export").click()
        page.click("#delete")  # nothing picked in the list: the open conversation
        page.locator("#confirm-delete").wait_for(state="visible", timeout=WAIT_MS)
        assert "Delete Delete me afterwards" in page.inner_text("#confirm-delete")
        page.locator("#confirm-delete").scroll_into_view_if_needed()
        shot(page, "delete-confirm-1280", tmp_path)
        page.click("#cancel-delete")  # changed my mind: nothing happens
        page.locator("#confirm-delete").wait_for(state="hidden", timeout=WAIT_MS)
        assert doomed in store.list_ids(data) and users(page) == ["Delete me afterwards"]
        page.set_viewport_size({"width": 390, "height": 844})
        page.click("#delete")
        page.locator("#confirm-delete").wait_for(state="visible", timeout=WAIT_MS)
        page.locator("#confirm-delete").scroll_into_view_if_needed()
        shot(page, "delete-confirm-390", tmp_path)
        page.click("#confirm-delete-btn")
        page.wait_for_function("() => document.querySelectorAll('#chat .message-row').length === 0", timeout=WAIT_MS)
        page.wait_for_function("() => document.querySelector('#stats').innerText.includes('Send a message')",
                               timeout=WAIT_MS)
        assert doomed not in store.list_ids(data) and not list(Path(data).glob(f".{doomed}.*"))
        assert demo.h2o_app.live.get(doomed) is None
        picker = page.locator("#saved input")
        page.locator("#message textarea").click()
        picker.click()
        options = page.locator(f"#{picker.get_attribute('aria-controls')}").get_by_role("option").all_inner_texts()
        assert not any("Delete me afterwards" in o for o in options)
        page.reload()  # the browser forgot it too: a reload shows a new chat, not an error
        wait_for_the_page_load(page)
        assert users(page) == [] and toasts(page, "no saved session") == 0
    finally:
        context.close()


def test_the_saved_list_shows_a_new_live_v1_story_without_a_reload(browser, tmp_path):
    # issue 34: the list never showed a new live /v1 story on an open page, only after a reload
    import openai

    with live_app(tmp_path / "data", cache=CACHE, api=True, temperature=0, max_new_tokens=8) as (url, demo):
        context, page = open_page(browser, url)
        try:
            page.get_by_text("Saved conversations and export").click()
            picker = page.locator("#saved input")
            picker.click()  # the list is open, and stays open while the story starts elsewhere
            listbox = page.locator(f"#{picker.get_attribute('aria-controls')}")
            assert not any("live /v1" in o for o in listbox.get_by_role("option").all_inner_texts())
            client = openai.OpenAI(base_url=url + "v1", api_key="x", default_headers={"User-Agent": "SillyTavern/1.12"})
            client.chat.completions.create(model="h2o-chat", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Ada keeps the lighthouse."}])
            listbox.get_by_role("option").filter(has_text="● live /v1 · SillyTavern · Ada keeps the lighthouse.") \
                .first.wait_for(timeout=30_000)  # within a few seconds, no reload, the list still open
        finally:
            context.close()


def test_the_page_fits_at_390_px(browser, short_app, tmp_path):
    # issue 34: at 390 px the heavy-hitter table's last column was cut and the box's placeholder
    # wrapped with its second line cut
    context, page = open_page(browser, short_app[0], 390, 844)
    try:
        width, room = page.evaluate("""() => { const t = document.querySelector('#message textarea');
            const s = getComputedStyle(t), c = document.createElement('canvas').getContext('2d'); c.font = s.font;
            return [c.measureText(t.placeholder).width,
                    t.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)]; }""")
        assert width <= room, (width, room)  # the placeholder is one whole line
        send_and_settle(page, "Tell me a story about the lighthouse keeper and her long nights.")
        page.locator("#heavy").scroll_into_view_if_needed()
        cut = page.evaluate("""() => { const box = document.querySelector('#heavy').getBoundingClientRect();
            return [...document.querySelectorAll('#heavy th, #heavy td')].filter(c => {
              const r = c.getBoundingClientRect(); return r.width && (r.right > box.right + 0.5 || r.left < box.left - 0.5
                || c.scrollWidth > c.clientWidth + 1); }).map(c => c.innerText); }""")
        assert cut == [], cut
        shot(page, "page-390", tmp_path, full_page=True)
    finally:
        context.close()



def test_keep_template_ticked_on_the_page_is_what_the_chat_runs_with(page):
    page.get_by_text("Cache (changing it replays the chat)").click()
    page.locator("#keep-template input").check()
    page.locator("#apply-cache").click()
    # the confirmation reads the chat's own cache settings back (settings.applied_cache)
    page.wait_for_function("() => document.body.innerText.includes('rolling positions, template tokens kept.')",
                           timeout=WAIT_MS)
    assert page.locator("#keep-template input").is_checked()
