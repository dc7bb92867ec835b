"""Events on the dashboard in a real browser (headless Chromium, as tests/api/test_dashboard.py): a real camera
pipeline (the trained people-fall detector) over the crossing video queues sightings, events and a fall; the
server's worker captions them; each event card shows its frames as a strip in time order with the kind badge,
the person, the span and the frame count; a sighting carries its badge, a fall its alert badge and its lead-up
strip; a camera's newest summary shows on its card."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
from playwright.sync_api import expect

from jobqueue.contract import summaries_stream
from pipeline.detector import PEOPLE_FALL
from pipeline.runner import CameraPipeline, PipelineConfig
from tests.api.test_dashboard import browser, page, redis_url, server, wait_until_loaded  # noqa: F401 (fixtures)


@pytest.mark.timeout(300)
def test_event_strips_kind_badges_and_the_newest_summary(server, redis_url, page, tmp_path,  # noqa: F811
                                                         sample_maker, people_fall_weights):
    video = sample_maker.write_crossing_video(tmp_path / "crossing.mp4")
    page.goto(server.url)
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    stats = CameraPipeline(PipelineConfig(source=str(video), camera_id="lane", redis_url=redis_url,
                                          detector=PEOPLE_FALL, event_frame_size=256)).run()
    assert stats["events"] == 3 and stats["falls"] == 1
    with httpx.Client(base_url=server.url, timeout=60) as http:
        deadline = time.monotonic() + 240
        while len(captions := http.get("/v1/captions", params={"camera": "lane"}).json()["data"]) < stats["jobs"]:
            assert time.monotonic() < deadline, "captions did not arrive"
            time.sleep(0.2)
    events = [c for c in captions if c["kind"] == "event"]
    assert len(events) == 3

    for event in events:
        card = page.locator(f".caption-card[data-id='{event['id']}']")
        expect(card).to_be_visible()
        expect(card.locator(".badge-kind.kind-event")).to_have_text("event")
        span = f"{event['end_ts'] - event['start_ts']:.1f} s"
        expect(card.locator(".meta")).to_contain_text(f"person {event['track_id']} · {span} · "
                                                      f"{event['frame_count']} frames")
        strip = card.locator(".frame-strip img")
        expect(strip).to_have_count(event["frame_count"])
        for index in range(event["frame_count"]):
            expect(strip.nth(index)).to_have_attribute("alt", f"Frame {index + 1} of {event['frame_count']}")
            wait_until_loaded(strip.nth(index))
    sighting = next(c for c in captions if c["kind"] == "sighting")
    expect(page.locator(f".caption-card[data-id='{sighting['id']}'] .badge-kind.kind-sighting")).to_have_text(
        "sighting")
    fall = next(c for c in captions if c["kind"] == "fall")
    fall_card = page.locator(f".caption-card.fall[data-id='{fall['id']}']")
    expect(fall_card.locator(".badge-fall")).to_have_text("fall")
    expect(fall_card.locator(".frame-strip img")).to_have_count(fall["frame_count"])

    # The newest periodic summary (as `vlmcap serve --summary-every` appends it) shows on the camera's card.
    answer = {"object": "camera.summary", "camera_id": "lane", "start": time.time() - 60, "end": time.time(),
              "captions": len(captions), "empty": False, "created_at": time.time(),
              "summary": {"title": "Two people crossed", "summary": "One of them lay down in the middle.",
                          "notable_events": [], "threat_level": 2}}
    client = redis.Redis.from_url(redis_url)
    client.xadd(summaries_stream("lane"), {"answer": json.dumps({**answer, "summary": {**answer["summary"],
                                                                                       "title": "Older"}})})
    client.xadd(summaries_stream("lane"), {"answer": json.dumps(answer)})
    client.close()
    camera = page.locator("#cameras .camera").filter(has_text="lane")
    expect(camera.locator(".camera-summary b")).to_have_text("Two people crossed")
    expect(camera.locator(".camera-summary")).to_contain_text("threat 2")
    expect(camera.locator(".camera-summary .caption-text")).to_have_text("One of them lay down in the middle.")
