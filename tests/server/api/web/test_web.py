"""The page at `/`, in a real browser (Debian's headless Chromium driven by Selenium through Debian's
chromium-driver) against a real `linserve serve`: streaming, the latency chart, abort, sessions, API keys,
escaping, and the screenshot in docs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from linserve.model.loading import DEFAULT_CHECKPOINT
from tests.helpers import ServerProcess, require_program

pytestmark = pytest.mark.slow

SCREENSHOT = Path(__file__).resolve().parents[4] / "docs" / "web-page.png"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = require_program("chromium", "chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(require_program("chromedriver", "chromium-driver")))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("web") / "serve.log", "--num-slots", "4")
    yield process
    process.stop()


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def click_row(driver, session_id: str) -> None:
    """Open a session from the list, again if the list was drawn anew between the find and the click (it is after
    every turn: a row found just before is then stale)."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> bool:
        try:
            driver.find_element("css selector", f"tr[data-id='{session_id}'] button").click()
        except StaleElementReferenceException:
            return False
        return True

    wait_for(clicked, what=f"session {session_id}'s row")


def fill(driver, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def metric(base: str, line_start: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


def status(driver) -> str:
    return driver.find_element("id", "status").text


def alert(driver):
    """The page's open prompt, or None."""
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return None


def test_the_page_streams_a_completion_and_charts_every_token(browser, served):
    page = httpx.get(served.base + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert "<script>" not in page.text and "http" not in page.text.split("<body>")[1]  # nothing inline, nothing remote
    browser.get(served.base + "/")
    fill(browser, "prompt", "ROMEO.")
    fill(browser, "max-tokens", "30")
    fill(browser, "seed", "7")
    browser.find_element("id", "generate").click()
    wait_for(lambda: status(browser) in ("done",) or status(browser).startswith("error"), what="the stream")
    assert status(browser) == "done"
    want = httpx.post(f"{served.base}/v1/completions", timeout=60, json={
        "prompt": "ROMEO.", "max_tokens": 30, "seed": 7, "temperature": 0.8, "top_p": 1, "top_k": 0}).json()
    assert browser.find_element("id", "output").get_property("textContent") == "ROMEO." + want["choices"][0]["text"]
    points = int(browser.find_element("id", "itl-chart").get_attribute("data-points"))
    assert points == want["usage"]["completion_tokens"] - 1  # one latency between each two tokens
    assert "tokens/s" in browser.find_element("id", "itl-stats").text
    drawn = browser.execute_script(  # read in one go: a redraw replaces the chart's nodes
        "drawChart(); return {labels: [...document.querySelectorAll('#itl-chart text')].map("
        "t => [t.getAttribute('class'), t.textContent]), highest: chart.highest, "
        "top: Math.max(histogramQuantile(0.99) * 1.5, 1e-3)}")
    ticks = [text for kind, text in drawn["labels"] if "tick" in kind]
    assert len(ticks) == 3 and all(t.endswith(" ms") for t in ticks) and ticks[0].startswith("0")  # a y scale
    names = [text for _, text in drawn["labels"][-2:]]
    assert names == ["token 2", f"token {want['usage']['completion_tokens']}"]  # the last token is named
    clipped = [text for kind, text in drawn["labels"] if "clipped" in kind]  # said whenever it happens
    assert bool(clipped) == (drawn["highest"] > drawn["top"])


def test_stop_aborts_the_stream_and_the_server_frees_its_slot(browser, served):
    browser.get(served.base + "/")
    browser.find_element("id", "long-run").click()
    wait_for(lambda: int(browser.find_element("id", "itl-chart").get_attribute("data-points") or 0) > 5,
             what="tokens to arrive")
    assert metric(served.base, 'linserve_state_pool_bytes{kind="in_use"}') > 0  # the stream holds a slot
    browser.find_element("id", "stop").click()
    wait_for(lambda: status(browser) == "stopped", what="the page to stop")
    wait_for(lambda: metric(served.base, "linserve_requests_running") == 0
             and metric(served.base, 'linserve_state_pool_bytes{kind="in_use"}') == 0, what="the slot to be freed")
    assert metric(served.base, 'linserve_requests_finished_total{reason="abort"}') >= 1


def test_sessions_are_created_continued_and_rewound_through_the_page(browser, served):
    browser.get(served.base + "/")
    browser.find_element("css selector", "nav button[data-tab=sessions]").click()
    fill(browser, "new-session-prompt", "JULIET.")
    browser.find_element("id", "new-session").click()
    session_id = wait_for(lambda: browser.find_element("id", "session-title").text, what="the new session")
    first = httpx.get(f"{served.base}/v1/sessions/{session_id}").json()["tokens"]
    assert browser.find_element("css selector", f"tr[data-id='{session_id}']")
    fill(browser, "session-input", " Wherefore art thou")
    fill(browser, "session-max-tokens", "5")
    browser.find_element("id", "session-continue").click()
    wait_for(lambda: len(browser.find_elements("css selector", "#turns li")) == 2, what="the second turn")
    longer = httpx.get(f"{served.base}/v1/sessions/{session_id}").json()
    assert longer["tokens"] > first
    state = f"state {longer['state_bytes']:,} bytes"
    assert state in browser.find_element("id", "session-info").text  # the same bytes at any length
    browser.find_elements("css selector", "#turns li button")[0].click()  # rewind to the first turn
    wait_for(lambda: len(browser.find_elements("css selector", "#turns li")) == 1, what="the rewind")
    assert httpx.get(f"{served.base}/v1/sessions/{session_id}").json()["tokens"] == first
    assert state in browser.find_element("id", "session-info").text


def test_each_session_shows_its_own_text_from_the_server(browser, served):
    """Open A, then B, then A again: each shows the text the server keeps for it, never the other's."""
    browser.get(served.base + "/")
    browser.find_element("css selector", "nav button[data-tab=sessions]").click()
    made = {}
    for name, first, second in (("A", "JULIET.\nO Romeo,", " wherefore"), ("B", "HAMLET.\nTo be,", " or not")):
        fill(browser, "new-session-prompt", first)
        browser.find_element("id", "new-session").click()
        wait_for(lambda: browser.find_element("id", "session-title").text not in ("", *made.values()),  # noqa: B023
                 what="the new session")
        made[name] = browser.find_element("id", "session-title").text
        fill(browser, "session-input", second)
        fill(browser, "session-max-tokens", "4")
        browser.find_element("id", "session-continue").click()
        wait_for(lambda: len(browser.find_elements("css selector", "#turns li")) == 2, what="the second turn")
    for name in ("A", "B", "A"):
        click_row(browser, made[name])
        wait_for(lambda wanted=made[name]: browser.find_element("id", "session-title").text == wanted,
                 what=f"session {name}")
        turns = httpx.get(f"{served.base}/v1/sessions/{made[name]}/turns").json()
        expected = "".join(t["prompt"] + t["completion"] for t in turns)
        shown = wait_for(lambda: browser.find_element("id", "session-output").text, what="its text")
        assert shown.split() == expected.split(), (shown, expected)  # as rendered: whitespace is layout
        other = "HAMLET" if name == "A" else "JULIET"
        assert other not in shown and ("JULIET" if name == "A" else "HAMLET") in shown
    browser.find_element("id", "session-fork").click()  # a fork shows the text it started from
    wait_for(lambda: browser.find_element("id", "session-title").text not in ("", *made.values()), what="the fork")
    assert "JULIET" in wait_for(lambda: browser.find_element("id", "session-output").text, what="the fork's text")
    assert browser.find_elements("css selector", "#turns li")  # its inherited turn is listed


def test_with_api_keys_the_page_loads_and_its_calls_carry_the_typed_key(browser, tiny_checkpoint, tmp_path):
    keyed = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--num-slots", "2", "--api-key", "page-key")
    try:
        browser.get(keyed.base + "/")  # the page itself needs no key
        browser.execute_script("sessionStorage.clear()")
        browser.get(keyed.base + "/")
        fill(browser, "max-tokens", "5")
        browser.find_element("id", "generate").click()
        wait_for(lambda: alert(browser), what="the page asking for a key").dismiss()  # no key given: the 401 shows
        wait_for(lambda: status(browser).startswith("error"), what="the refusal")
        assert "401" in status(browser)
        browser.find_element("css selector", "nav button[data-tab=sessions]").click()
        asked = wait_for(lambda: alert(browser), what="the page asking for a key")
        asked.send_keys("wrong-key")
        asked.accept()  # a wrong key: the list shows the error, not an empty table
        error = wait_for(lambda: browser.find_element("id", "sessions-error").text, what="the error line")
        assert "401" in error
        fill(browser, "api-key", "page-key")
        browser.find_element("id", "refresh-sessions").click()
        wait_for(lambda: not browser.find_element("id", "sessions-error").is_displayed(), what="the listing")
        browser.find_element("css selector", "nav button[data-tab=playground]").click()
        browser.find_element("id", "generate").click()
        wait_for(lambda: status(browser) == "done", what="the keyed stream")
        assert browser.execute_script("return sessionStorage.getItem('linserve-api-key')") == "page-key"
        browser.execute_script("sessionStorage.clear(); document.getElementById('api-key').value = ''")
        browser.find_element("id", "generate").click()
        asked = wait_for(lambda: alert(browser), what="the page asking again")
        asked.send_keys("page-key")
        asked.accept()  # the key typed into the prompt is kept for the tab and the request goes through
        wait_for(lambda: status(browser) == "done", what="the stream after the prompt")
        assert browser.execute_script("return sessionStorage.getItem('linserve-api-key')") == "page-key"
    finally:
        keyed.stop()


def test_streamed_and_typed_text_is_shown_as_text_never_run(browser, served):
    hostile = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    browser.get(served.base + "/")
    fill(browser, "prompt", hostile)
    fill(browser, "max-tokens", "3")
    browser.find_element("id", "generate").click()
    wait_for(lambda: status(browser) == "done", what="the stream")
    assert browser.find_element("id", "output").get_property("textContent").startswith(hostile)
    assert browser.find_elements("css selector", "#output script, #output img") == []
    assert browser.execute_script("return window.pwned === undefined")


def test_the_server_view_reads_the_servers_own_metrics(browser, served):
    httpx.post(f"{served.base}/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 20}, timeout=60)
    httpx.post(f"{served.base}/v1/completions", json={"prompt": "a b c a b c a b c a b", "max_tokens": 24,  # drafts
                                                      "temperature": 0, "speculative": {"method": "ngram"}}, timeout=60)
    drafted = metric(served.base, "linserve_spec_draft_tokens_total")
    accepted = metric(served.base, "linserve_spec_accepted_tokens_total")
    assert drafted > 0
    browser.get(served.base + "/")
    browser.find_element("css selector", "nav button[data-tab=server]").click()
    cell = wait_for(lambda: browser.find_elements("css selector", "tr[data-context='0-1k'] td"), what="the table")
    served_count = metric(served.base, 'linserve_inter_token_latency_seconds_count{context="0-1k"}')
    assert served_count >= 19 and float(cell[1].text) == served_count
    facts = {dd.get_attribute("data-fact"): dd.text for dd in browser.find_elements("css selector", "#server-facts dd")}
    assert facts["device"] == "cpu" and facts["slots in use"].endswith("of 4") and facts["running"] == "0"
    assert facts["speculative acceptance"] == (f"{100 * accepted / drafted:.1f}% ({accepted:,.0f} of {drafted:,.0f} "
                                               "drafted tokens)")


def test_a_long_run_is_charted_token_by_token_and_is_the_docs_screenshot(browser, tiny_checkpoint, tmp_path):
    """8,192 tokens streamed through the page: every inter-token latency is charted. With
    LINSERVE_WEB_SCREENSHOT set, the shipped model streams them and the page is saved as docs/web-page.png
    (README shows it); otherwise the tiny model does (the same page work, a quarter of the time)."""
    shoot = bool(os.environ.get("LINSERVE_WEB_SCREENSHOT"))
    served = ServerProcess(DEFAULT_CHECKPOINT if shoot else tiny_checkpoint, tmp_path / "serve.log", "--num-slots", "2")
    try:
        browser.get(served.base + "/")
        browser.find_element("id", "long-run").click()
        wait_for(lambda: status(browser) == "done", timeout=600, what="8,192 tokens")
        assert browser.find_element("id", "itl-chart").get_attribute("data-points") == "8191"
        assert len(browser.find_elements("css selector", "#itl-chart polyline.trend")) == 1
        shown = browser.find_element("id", "output").get_property("textContent")
        assert 0 < len(shown) <= 20_000  # the page keeps only the end of a long text
        target = SCREENSHOT if shoot else tmp_path / "page.png"
        browser.execute_script("document.getElementById('output').scrollTop = 1e9")  # the end of the stream
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1200, height + 140)  # the whole page, chart included
        browser.save_screenshot(str(target))
        browser.set_window_size(1200, 1000)
        assert target.stat().st_size > 10_000
    finally:
        served.stop()


def test_the_page_can_be_turned_off_and_unknown_files_are_404s(make_client):
    on = make_client()
    assert on.get("/web/app.js").headers["content-type"].startswith("text/javascript")
    assert on.get("/web/chart.js").headers["content-security-policy"].startswith("default-src 'none'")
    missing = on.get("/web/../settings.py")
    assert missing.status_code == 404 and "error" in missing.json()
    assert on.get("/web/nothing.js").json()["error"]["param"] == "name"
    icon = on.get("/favicon.ico")  # where browsers ask first: no 404 in every page load's log
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.content.startswith(b"<svg") and on.get("/web/favicon.svg").content == icon.content
    off = make_client(web_ui=False)
    assert off.get("/").status_code == 404 and off.get("/web/app.js").status_code == 404
    assert off.get("/v1/models").status_code == 200  # only the page is gone


def test_the_api_docs_render_from_this_server_alone(browser, served):
    """/docs draws Swagger UI from the files linserve serves itself (this machine reaches no CDN)."""
    browser.get(served.base + "/docs")
    title = wait_for(lambda: browser.find_elements("css selector", ".swagger-ui .info .title"), what="Swagger UI")
    assert "linserve" in title[0].text
    operations = wait_for(lambda: browser.find_elements("css selector", ".opblock-summary-path"), what="operations")
    assert any(o.text == "/v1/responses" for o in operations)
    browser.get(served.base + "/redoc")
    heading = wait_for(lambda: [h for h in browser.find_elements("css selector", "h1") if "linserve" in h.text],
                       what="ReDoc")
    assert heading
