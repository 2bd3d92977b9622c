"""Replies streamed into the real page: the app in its own process, driven by Debian's chromium.

`bench panel` (panel.py) calls `page_speed`. The browser shares the machine's cores with the
decode, so the server's tokens/s here is what a user of this machine sees, not the decode's speed
alone: every update of the chat and of the live panel is redrawn by the page while the next token
is computed.

Per turn: the server's own decode tokens/s (the stats line once the reply has ended), the TTFT
and stream time as the page shows them (Enter -> first reply text -> the stats line final), and
the CPU time the browser's processes used meanwhile (a count, steadier than the speeds: what the
page's redraws cost).
"""

import json
import os
import re
import shutil
import time
from contextlib import contextmanager

from .common import REPO, app_server, wait_healthy

CHROMIUM = shutil.which("chromium")
WAIT_MS = 300_000
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Go on, in much more detail.",
           "What happened to the lighthouse after that?", "Describe the keeper's family.",
           "Now tell it from the ship's point of view."]
LAST_REPLY = ("() => { const b = document.querySelectorAll('#chat .bot-row'); "
              "return b.length ? b[b.length - 1].innerText : ''; }")
REPLY_ENDED = ("() => { const t = document.querySelector('#stats').innerText; "
               "return t.includes('tokens/s') && !t.includes('streaming') && !t.includes('waiting'); }")


def page_speed(model, budget, turns, new_tokens, app_dir=None):
    """Rows {turn, server_tokens_per_s, page_ttft_s, page_stream_s, browser_cpu_s} for `turns` greedy
    replies of at most `new_tokens` in one chat, or None when chromium or Playwright is missing.
    app_dir: run the app from that checkout (a git worktree of an older commit, to compare)."""
    if not can_drive():
        return None
    flags = ["--budget", str(budget)] + (["--model", model] if model else [])
    with app_server(flags, checkout=app_dir or REPO) as (url, app):
        wait_healthy(url, app)
        with chromium_page(url) as page:
            set_greedy(page, new_tokens)
            return [one_turn(page, PROMPTS[t % len(PROMPTS)], t + 1) for t in range(turns)]


def can_drive():
    """Playwright is installed and Debian's chromium is there (it never downloads a browser)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return CHROMIUM is not None


@contextmanager
def chromium_page(url):
    """A headless chromium page at 1280 x 900 on the app at `url`, its first load done."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(url + "/")
            page.wait_for_function("() => (document.querySelector('#stats') || {}).innerText?.includes('Send a')")
            yield page
        finally:
            browser.close()


def set_greedy(page, new_tokens):
    """Temperature 0 and the reply length, through the Settings fields as a user sets them."""
    page.get_by_text("Generation").first.click()
    apply_settings(page, "#apply-sampling", {"#temperature input[type=number]": "0", "#max-new-tokens input": str(new_tokens)})
    page.wait_for_function(f"() => document.querySelector('#max-new-tokens input').value === '{new_tokens}'")


def apply_settings(page, button, typed, tries=5):
    """Type into settings fields ({selector: number as text}) and press the Apply `button` until
    Apply sends what was typed (the browser tests use it too). Gradio mounts a closed accordion's
    fields when it first opens, and for some milliseconds after that it can put the loaded value
    back over text typed into them: in CI, Apply then sent budget 48 with 600 in the box. A person
    cannot type that soon after opening it; a script can. What Apply sent is read from its request."""
    wanted = [float(text) for text in typed.values()]
    for _ in range(tries):
        for selector, text in typed.items():
            page.locator(selector).fill(text)
        with page.expect_request(lambda r: "/queue/join" in r.url) as request:
            page.click(button)
        sent = json.loads(request.value.post_data)["data"]
        if all(v in sent for v in wanted):
            return
        page.wait_for_timeout(500)  # let the Apply that sent the old values answer before typing again
    raise RuntimeError(f"Apply never sent {typed} (it sent {sent})")


def browser_cpu_s():
    """CPU seconds (user + system) used so far by every chromium process on this machine."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"chromium" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def one_turn(page, text, turn):
    n_replies = page.evaluate("() => document.querySelectorAll('#chat .bot-row').length")
    box = page.locator("#message textarea")
    box.fill(text)
    sent, cpu_before = time.perf_counter(), browser_cpu_s()
    box.press("Enter")
    page.wait_for_function("([n]) => { const b = document.querySelectorAll('#chat .bot-row'); "
                           "return b.length > n && b[b.length - 1].innerText.trim().length > 0; }",
                           arg=[n_replies], polling=10)
    first = time.perf_counter()
    page.wait_for_function(REPLY_ENDED, polling=20)
    ended, browser_cpu = time.perf_counter(), browser_cpu_s() - cpu_before
    speed = re.search(r"([\d.]+) tokens/s", page.inner_text("#stats"))
    return {"turn": turn, "server_tokens_per_s": float(speed.group(1)) if speed else None,
            "page_ttft_s": round(first - sent, 3), "page_stream_s": round(ended - first, 3),
            "reply_chars": len(page.evaluate(LAST_REPLY)), "browser_cpu_s": round(browser_cpu, 2)}
