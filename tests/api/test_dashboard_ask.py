"""The dashboard's "Ask the cameras" box in a real browser (headless Chromium, as tests/api/test_dashboard.py)
on a real server (tiny model, embedded Redis, an API key) over a camera memory written through the store's API
(tests/camera_memory_support.py): the question goes to POST /v1/cameras/ask streamed, with the key, the camera
chosen in the page's filter and the time range; the answer shows as the same text the route answers unstreamed;
the events it was given are links to their event pages with their first frames; a caption full of HTML shows
as text."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from camera_memory_support import frames, known_events, seed
from playwright.sync_api import Page, expect

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from memory import Event
from tests.api.test_dashboard import browser, page, wait_until_loaded  # noqa: F401 (fixtures)

KEY = "s3cret"
HOSTILE = '<img src=x onerror="window.hacked=1"><script>window.hacked=2</script><b id="bold">bold</b> parcel'
OLD = time.time() - 3 * 86400


def extra_events() -> list[Event]:
    """A caption full of HTML at gate 3, and a bicycle at gate 1 three days ago."""
    return [
        Event(id="html", camera_id="gate-3", kind="sighting", start_ts=OLD + 86400, end_ts=OLD + 86400,
              finished_at=OLD + 86401, caption=HOSTILE, track_id=7, person_count=1, frames=frames(OLD, 1, 90)),
        Event(id="bicycle", camera_id="gate-1", kind="sighting", start_ts=OLD, end_ts=OLD, finished_at=OLD + 1,
              caption="a cyclist leans a bicycle on the fence", track_id=8, person_count=1,
              frames=frames(OLD, 2, 150)),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_redis_url) -> Iterator[BackgroundServer]:
    data_dir = seed(tmp_path_factory.mktemp("dashboard-ask") / "data", known_events() + extra_events())
    settings = ServerSettings(engine=EngineConfig(model="tiny"), data_dir=str(data_dir), redis_url=module_redis_url,
                              api_key=KEY)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def open_with_key(tab: Page, url: str) -> None:
    tab.goto(url)
    expect(tab.locator("#key-dialog")).to_be_visible()
    tab.fill("#key-input", KEY)
    tab.click("#key-save")
    expect(tab.locator("#events > li")).to_have_count(6)  # the search panel's newest events, with the key


def ask_on_page(tab: Page, question: str, camera: str = "", since: str = "") -> None:
    tab.fill("#ask-question", question)
    tab.select_option("#camera-filter", camera)
    tab.select_option("#ask-since", since)
    tab.click("#ask-send")
    expect(tab.locator("#ask-answer")).to_have_attribute("data-state", "done", timeout=300_000)


def unstreamed(http: httpx.Client, **body) -> dict:
    answer = http.post("/v1/cameras/ask", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def given_ids(tab: Page) -> list[str]:
    return tab.locator("#ask-events > li").evaluate_all("items => items.map((item) => item.dataset.id)")


@pytest.mark.timeout(600)
def test_the_ask_box_answers_and_links_the_events_it_used(server, http, page):  # noqa: F811
    open_with_key(page, server.url)
    question = "did anyone fall in the warehouse?"
    ask_on_page(page, question)
    whole = unstreamed(http, question=question)
    assert not whole["empty"] and "fall" in whole["event_ids"]
    # Greedy on the same prompt: the streamed text on the page is the route's answer.
    assert page.locator("#ask-answer").text_content() == whole["answer"]
    assert given_ids(page) == whole["event_ids"]
    cited = page.locator("#ask-events > li.cited").evaluate_all("items => items.map((item) => item.dataset.id)")
    assert cited == [i for i in whole["event_ids"] if i in whole["cited_event_ids"]]
    fall = page.locator("#ask-events > li[data-id='fall']")
    reference = next(e["reference"] for e in whole["events"] if e["id"] == "fall")
    expect(fall.locator(".ask-reference")).to_have_text(f"[{reference}]")
    expect(fall.locator(".caption-text")).to_have_text("a worker slips and lies on the warehouse floor")
    expect(fall.locator("a")).to_have_attribute("href", "#event=fall")
    wait_until_loaded(fall.locator(".event-thumb img"))

    fall.locator("a").click()  # the link opens the event's page
    expect(page.locator("#event-dialog")).to_be_visible()
    expect(page.locator("#event-title")).to_have_text("Fall at gate-2")
    expect(page.locator("#event-frames img")).to_have_count(3)
    page.click("#event-close")
    expect(page.locator("#event-dialog")).to_be_hidden()

    # The camera chosen in the filter and the time range go with the question.
    ask_on_page(page, "a bicycle?", camera="gate-1")
    assert set(given_ids(page)) == {"red-coat", "dog", "bicycle"}
    ask_on_page(page, "a bicycle?", camera="gate-1", since="86400")
    assert set(given_ids(page)) == {"red-coat", "dog"}


@pytest.mark.timeout(600)
def test_html_in_a_caption_and_the_answer_is_shown_as_text(server, http, page):  # noqa: F811
    open_with_key(page, server.url)
    ask_on_page(page, "who carried a parcel?", camera="gate-3")
    assert given_ids(page) == ["html"]
    item = page.locator("#ask-events > li[data-id='html']")
    expect(item.locator(".caption-text")).to_have_text(HOSTILE)
    assert page.locator("#ask-events img[src='x'], #bold, #ask-events script, #ask-answer *").count() == 0
    assert page.evaluate("window.hacked") is None
    whole = unstreamed(http, question="who carried a parcel?", cameras=["gate-3"])
    assert page.locator("#ask-answer").text_content() == whole["answer"]
    wait_until_loaded(item.locator(".event-thumb img"))
