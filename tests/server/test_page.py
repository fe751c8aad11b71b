"""The chat page in a real browser: headless Chromium (the system's, Debian's ``chromium``)
driven by Playwright against a qfserve on the bundled test model.

Every test records the browser console and every request the page makes: an error in the
console, or a request to anywhere but the server, fails it. Without a browser or Playwright
the tests skip, naming what is missing. ``QFSERVE_SCREENSHOT=<path>`` saves the shaded
conversation the budget test ends with (the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server, stop_server

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is missing")
expect = playwright.expect
BROWSER = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
if BROWSER is None:
    pytest.skip(
        "no Chromium on this machine (Debian: apt install chromium)", allow_module_level=True
    )

LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 14
WATCH = """() => {
  window.seen = [];
  const list = document.getElementById('messages');
  new MutationObserver(() => {
    const all = list.querySelectorAll('.message.assistant .content');
    if (all.length) window.seen.push(all[all.length - 1].textContent);
  }).observe(list, {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox will not start. The test
        # runner preloads OpenBLAS into itself (and so its children): not into the browser.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        b = p.chromium.launch(
            executable_path=BROWSER,
            headless=True,
            args=["--no-sandbox", "--disable-gpu"],
            env=env,
        )
        yield b
        b.close()


class Watched:
    """A fresh page (its own storage) whose console errors and outside requests are kept."""

    def __init__(self, browser: Any, server: Server) -> None:
        self.base = f"http://127.0.0.1:{server.port}"
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.outside: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on(
            "request",
            lambda r: (
                (r.url.startswith(self.base) or r.url.startswith("data:"))
                or self.outside.append(r.url)
            ),
        )

    def open(self) -> Any:
        self.page.goto(self.base + "/")
        expect(self.page.locator("#model")).to_have_text(MODEL_NAME, timeout=30_000)
        return self.page

    def clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.outside == [], self.outside
        self.context.close()


@pytest.fixture
def watched(browser, server) -> Iterator[Watched]:
    w = Watched(browser, server)
    yield w
    w.clean()


def send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_answered(page: Any) -> None:
    page.wait_for_selector("#send:not([disabled])", timeout=120_000)


def sees_a_streamed_answer(page: Any) -> str:
    """Send a message; the answer must arrive in pieces, then stand whole."""
    page.evaluate(WATCH)
    send(page, "Hello, who are you?")
    wait_answered(page)
    final = page.locator(".message.assistant .content").last.inner_text()
    steps = {s for s in page.evaluate("window.seen") if s}
    assert final.strip(), "no answer shown"
    assert len(steps) >= 3, f"the answer did not stream: {len(steps)} states"
    assert page.locator("#error").is_hidden(), page.locator("#error").inner_text()
    return final


def settings(page: Any, **values: str) -> None:
    """Open the settings and fill them; greedy decoding unless told (a sampled answer of
    the random test model may end at once)."""
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")
    for name, value in {"temperature": "0", **values}.items():
        page.fill(f"#{name}", value)


def test_a_message_gets_a_streamed_answer_kept_in_the_browser(watched):
    page = watched.open()
    settings(page, max_tokens="160")  # long enough to arrive over many reads
    sees_a_streamed_answer(page)
    assert page.locator(".message").count() == 2
    page.reload()  # the conversation is in the browser's storage
    expect(page.locator(".message")).to_have_count(2)
    assert "Hello, who are you?" in page.locator(".message.user").first.inner_text()


def test_broken_streaming_is_caught(watched):
    """A server that sends the whole answer at once (no stream) fails the check."""
    page = watched.open()
    whole = (
        'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":"all at once, '
        'never streamed"},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=whole
        ),
    )
    with pytest.raises(AssertionError, match="did not stream"):
        sees_a_streamed_answer(page)


def test_a_budget_lowers_the_kept_share_and_shades_what_was_dropped(watched):
    page = watched.open()
    settings(page, max_tokens="12")
    send(page, "Hi")
    wait_answered(page)
    assert page.inner_text("#kept-share") == "100%"  # auto: the full cache while it fits
    full = page.locator(".message.user .kept").first.get_attribute("data-count")
    settings(page, qfilters_budget="24", qfilters_recent="4")
    page.select_option("#kv_method", "qfilters")
    send(page, LONG)
    wait_answered(page)
    share = int(page.inner_text("#kept-share").rstrip("%"))
    assert share < 50, share
    counts = [
        int(c) for c in page.eval_on_selector_all(".kept", "e => e.map(x => x.dataset.count)")
    ]
    assert counts and min(counts) == 0 and max(counts) <= int(full or 0), counts
    assert page.locator(".message.user .content").last.inner_text().strip() == LONG.strip()
    if os.environ.get("QFSERVE_SCREENSHOT"):
        page.screenshot(path=os.environ["QFSERVE_SCREENSHOT"])


def test_keyboard_alone_sends_stops_and_opens_the_settings(watched):
    page = watched.open()

    def tab_to(selector: str) -> None:
        for _ in range(40):
            if page.evaluate("s => document.activeElement.matches(s)", selector):
                return
            page.keyboard.press("Tab")
        raise AssertionError(f"Tab never reached {selector}")

    tab_to("#settings summary")
    page.keyboard.press("Enter")
    assert page.locator("#settings").get_attribute("open") is not None
    for field, value in (("#temperature", "0"), ("#max_tokens", "1500")):
        tab_to(field)
        page.keyboard.press("Control+A")
        page.keyboard.type(value)
    tab_to("#input")
    page.keyboard.type("Tell me a long story.")
    page.keyboard.press("Enter")
    expect(page.locator(".message.assistant .content")).not_to_have_text("")
    # The memory figures follow the answer while it streams (GET /v1/status).
    expect(page.locator("#m-seen")).not_to_have_text("–", timeout=10_000)
    page.keyboard.press("Escape")
    wait_answered(page)
    assert page.locator(".message.assistant .note").inner_text() == "stopped"


def test_the_page_has_no_level_a_accessibility_violations(watched):
    axe = pytest.importorskip("axe_playwright_python.sync_playwright", reason="axe-core missing")
    page = watched.open()
    settings(page, max_tokens="8", qfilters_budget="16", qfilters_recent="2")
    send(page, LONG)
    wait_answered(page)
    results = axe.Axe().run(
        page, options={"runOnly": {"type": "tag", "values": ["wcag2a", "wcag21a"]}}
    )
    violations = results.response["violations"]
    assert violations == [], [(v["id"], v["help"], len(v["nodes"])) for v in violations]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "keyed.log"
    srv = start_server(tiny_model_dir, log, "--api-key", "sesame")
    yield srv
    stop_server(srv)


def test_with_an_api_key_the_page_asks_once_and_keeps_it_for_the_tab(browser, keyed):
    w = Watched(browser, keyed)
    page = w.page
    page.goto(w.base + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key", "sesame")
    page.press("#key", "Enter")
    expect(page.locator("#model")).to_have_text(MODEL_NAME)
    settings(page, max_tokens="8")
    send(page, "Hello")
    wait_answered(page)
    assert page.locator(".message.assistant .content").inner_text().strip()
    assert page.evaluate("sessionStorage.getItem('qfserve.key')") == "sesame"
    stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
    assert "sesame" not in stored
    w.clean()


def test_escape_in_the_key_dialog_says_why_instead_of_hanging(browser, keyed):
    w = Watched(browser, keyed)
    page = w.page
    page.goto(w.base + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.keyboard.press("Escape")
    expect(page.locator("#error")).to_contain_text("API key")
    assert page.locator("#key-dialog[open]").count() == 0
    w.clean()


def test_an_answer_streaming_into_one_conversation_stays_out_of_another(watched):
    page = watched.open()
    settings(page, max_tokens="8")
    send(page, "Hi")
    wait_answered(page)
    before = page.locator(".message.assistant .content").last.inner_text()
    page.click("#new-chat")
    settings(page, max_tokens="1500")
    send(page, "Tell me a long story.")
    expect(page.locator(".message.assistant .content")).not_to_have_text("")
    page.locator("#conversations button.open").nth(1).click()  # back to the first
    page.wait_for_timeout(600)  # tokens keep arriving for the other conversation
    expect(page.locator(".message")).to_have_count(2)
    assert page.locator(".message.assistant .content").last.inner_text() == before
    page.click("#stop")
    wait_answered(page)


def test_shading_follows_characters_beyond_the_basic_plane(watched):
    """Runs count code points (the server's characters); an emoji is two UTF-16 units in
    the page, and must not shift the shading after it."""
    page = watched.open()
    text = "fox 🦊 and dog 🐶 ran"
    runs = [[4, 4], [1, 2], [0, 8], [3, 2], [2, 3]]  # [count, code points]
    final = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
        "kv_cache_detail": {"tokens": 9, "layer_heads": 4, "kept": [[4, 9]], "messages": [runs]},
    }
    delta = {"index": 0, "delta": {"content": "ok"}, "logprobs": None, "finish_reason": None}
    first = {**final, "choices": [delta]}
    del first["kv_cache_detail"]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in (first, final)) + "data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=body
        ),
    )
    send(page, text)
    wait_answered(page)
    spans = page.locator(".message.user .kept")
    shown = [
        (int(spans.nth(i).get_attribute("data-count")), spans.nth(i).text_content())
        for i in range(spans.count())
    ]
    chars, at, expected = list(text), 0, []
    for count, n in runs:
        expected.append((count, "".join(chars[at : at + n])))
        at += n
    assert shown == expected
    held = page.locator(".message.user .held").inner_text()
    assert held.startswith("the cache holds ") and "%" in held


def test_on_a_server_that_keeps_every_row_the_page_does_not_ask_for_the_detail(
    browser, tiny_model_dir, tmp_path
):
    srv = start_server(tiny_model_dir, tmp_path / "full.log", "--kv-method", "full")
    try:
        w = Watched(browser, srv)
        page = w.open()
        settings(page, max_tokens="8")
        send(page, "Hello")
        wait_answered(page)
        assert page.locator("#error").is_hidden(), page.locator("#error").inner_text()
        assert page.locator(".message.assistant .content").inner_text().strip()
        w.clean()
    finally:
        stop_server(srv)
