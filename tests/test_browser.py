"""The real UI in a real browser (Debian's chromium, driven by Playwright): type, see the reply
stream in, see coloured tokens in the panel, pick one layer and head and see exactly its slots.
Skipped where chromium is not installed (`.ci/run` installs it)."""

import shutil
import socket

import pytest

from h2o_chat.ui import CSS, build
from tests.conftest import make_tiny_chat

CHROMIUM = shutil.which("chromium")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model, tok = make_tiny_chat()
    # score "mean": on this tiny model the heads then keep different tokens, so one head's view differs
    # from the summary over all heads
    demo = build(model, tok, dict(policy="h2o", budget=48, n_sink=2, n_recent=16, score="mean", positions="rolling"),
                 str(tmp_path_factory.mktemp("data")), chat_defaults=dict(temperature=0, max_new_tokens=256))
    demo.queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture
def page(app):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(app)
        yield page
        browser.close()


def pick(page, selector, value):
    page.click(f"{selector} input")
    listbox = page.get_attribute(f"{selector} input", "aria-controls")  # this dropdown's own list
    page.locator(f"#{listbox}").get_by_role("option", name=value, exact=True).click()


def test_chat_and_panel_in_the_browser(page, app, tmp_path):
    page.fill("#message textarea", "Hello there, tell me a story")
    page.click("#send")
    page.wait_for_selector("#token-map .tok.st-evicted", timeout=60_000)  # the reply outgrew the budget
    page.get_by_text("Hello there, tell me a story").first.wait_for()
    assert page.locator(".message").count() >= 2  # the question and its streamed answer
    settled = ""
    while settled != page.inner_text("#stats"):  # until the reply has finished streaming
        settled = page.inner_text("#stats")
        page.wait_for_timeout(1500)
    for status in ("sink", "heavy", "recent"):
        assert page.locator(f"#token-map .tok.st-{status}").count() > 0
    assert "tokens seen" in page.inner_text("#stats")
    # the summary shows every token some (layer, head) keeps: more than one head's 48 slots
    assert page.locator("#token-map .tok:not(.st-evicted)").count() > 48

    pick(page, "#layer", "1")
    pick(page, "#head", "0")
    page.wait_for_function(
        "() => document.querySelectorAll('#token-map .tok:not(.st-evicted)').length === 48", timeout=30_000)
    page.screenshot(path=str(tmp_path / "browser.png"), full_page=True)
