"""The camera memory end to end on a clip: the real camera pipeline (the trained people-fall detector over
samples/make_sample_video.py's crossing clip: two people made of real photos crossing, one of whom then lies on
the ground) sends its jobs into a real Redis; a real server (tiny random model, its in-process queue worker, the
SQLite event store in a data directory of its own) captions them; then, over HTTP only: every job the pipeline
sent is in the store exactly once, found by its camera, a time range around it and a word of its own caption;
the fall is what `fall=true` finds and `fall=false` does not; each event's own frames make it the first of its
similar events (`GET /v1/events/{id}/similar`), and a one-frame event is also first by an upload of its frame.

A redelivered job kept once is tests/api/test_events_api.py's `test_a_redelivered_job_is_kept_once` (the same
job re-added to the stream, as here its jobs would be)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from queue_support import stream_jobs, wait_for

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.contract import Job
from pipeline.detector import PEOPLE_FALL
from pipeline.runner import CameraPipeline, PipelineConfig

CAMERA = "hall-2"
WORD = re.compile(r"[^\W_]+")  # the store's words: everything but letters and digits separates them


def all_events(http: httpx.Client, **params) -> list[dict]:
    """Every page of a search, following its cursor."""
    events: list[dict] = []
    cursor = None
    while True:
        answer = http.get("/v1/events", params={**params, "limit": 200, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        page = answer.json()
        events += page["data"]
        cursor = page["next_cursor"]
        if cursor is None:
            return events


def found_ids(http: httpx.Client, **params) -> list[str]:
    return [event["id"] for event in all_events(http, **params)]


def job_span(job: Job) -> tuple[float, float]:
    times = [frame.ts for frame in job.frames] or [job.frame_ts]
    return min(times), max(times)


@pytest.fixture(scope="module")
def redis_url(module_redis_url: str) -> str:
    return module_redis_url


@pytest.fixture(scope="module")
def sent(redis_url, sample_maker, people_fall_weights, tmp_path_factory) -> list[Job]:
    """The jobs the camera pipeline sent for the crossing clip, as they lie on the stream (before any server reads
    them)."""
    clip = sample_maker.write_crossing_video(tmp_path_factory.mktemp("clip") / "crossing.mp4")
    camera = CameraPipeline(PipelineConfig(source=str(clip), camera_id=CAMERA, redis_url=redis_url,
                                           detector=PEOPLE_FALL, event_frame_size=320))
    stats = camera.run()
    jobs = stream_jobs(redis_url)
    assert len(jobs) == stats["jobs"] and stats["falls"] == 1
    return jobs


@pytest.fixture(scope="module")
def http(sent, redis_url, tmp_path_factory) -> Iterator[httpx.Client]:
    """A server that captioned every job the pipeline sent and kept each as an event."""
    data_dir = tmp_path_factory.mktemp("memory") / "data"
    settings = ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=6, redis_url=redis_url,
                              data_dir=str(data_dir))
    with BackgroundServer(create_app(settings)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        def captioned() -> bool:
            answers = [client.get(f"/v1/captions/{job.job_id}") for job in sent]
            return all(a.status_code == 200 and a.json()["status"] in ("done", "failed") for a in answers)

        wait_for(captioned, "every job captioned", timeout=300, interval=0.5)
        for job in sent:
            result = client.get(f"/v1/captions/{job.job_id}").json()
            assert result["status"] == "done", result  # a failed job is not kept: none may fail here
        wait_for(lambda: len(all_events(client, camera=CAMERA)) >= len(sent), "every job kept as an event",
                 timeout=120, interval=0.2)
        yield client


def test_the_clip_has_several_people_and_a_fall(sent):
    kinds = Counter(job.job_kind for job in sent)
    assert kinds["event"] >= 3 and kinds["sighting"] >= 2 and kinds["fall"] == 1, kinds
    assert len({job.track_id for job in sent}) >= 3  # the walker, the faller, the faller lying down
    assert len({job.job_id for job in sent}) == len(sent)


@pytest.mark.timeout(600)
def test_every_job_the_pipeline_sent_is_one_event_found_by_camera_time_and_a_word(sent, http):
    stored = all_events(http, camera=CAMERA)
    assert Counter(e["id"] for e in stored) == Counter(job.job_id for job in sent), "each job once, nothing else"
    assert all_events(http) == stored  # no event of another camera, none twice under another id
    words_checked = 0
    for job in sent:
        event = http.get(f"/v1/events/{job.job_id}").json()
        start, end = job_span(job)
        assert (event["camera_id"], event["kind"], event["fall"], event["track_id"]) == \
            (CAMERA, job.job_kind, job.fall, job.track_id)
        assert (event["start_ts"], event["end_ts"]) == pytest.approx((start, end), abs=1e-3)
        assert event["frame_count"] == min(4, max(1, len(job.frames)))  # --events-frames (4) of the job's
        assert event["caption"] == http.get(f"/v1/captions/{job.job_id}").json()["caption"]
        around = {"camera": CAMERA, "since": start - 0.5, "until": end + 0.5}
        assert job.job_id in found_ids(http, **around)
        assert job.job_id not in found_ids(http, camera="other-camera", since=start - 0.5, until=end + 0.5)
        assert job.job_id not in found_ids(http, camera=CAMERA, since=end + 0.5)  # a range after it
        words = WORD.findall(event["caption"])
        for word in words[:2]:
            by_word = found_ids(http, q=word, **around)
            assert job.job_id in by_word, (word, event["caption"])
            assert set(by_word) <= {j.job_id for j in sent}
        words_checked += bool(words)
    assert words_checked >= len(sent) - 1, "the captions have words (the random model's, nonsense but words)"


def test_the_fall_is_found_by_fall_true_and_only_it(sent, http):
    [fall] = [job for job in sent if job.fall]
    assert found_ids(http, camera=CAMERA, fall="true") == [fall.job_id]
    assert found_ids(http, fall="true") == [fall.job_id]
    assert sorted(found_ids(http, camera=CAMERA, fall="false")) == sorted(j.job_id for j in sent if not j.fall)
    start, end = job_span(fall)
    assert found_ids(http, camera=CAMERA, fall="true", kind="fall", since=start, until=end) == [fall.job_id]


def test_an_events_own_frames_make_it_first_of_its_similar(sent, http):
    for job in sent:
        answer = http.get(f"/v1/events/{job.job_id}/similar", params={"limit": 200})
        assert answer.status_code == 200, answer.text
        found = answer.json()["data"]
        assert found[0]["id"] == job.job_id, [(f["id"], f["score"]) for f in found[:3]]
        assert found[0]["score"] == pytest.approx(1.0, abs=1e-4)
        assert len(found) == len(sent)  # every event has an embedding, so every one is found
        scores = [f["score"] for f in found]
        assert scores == sorted(scores, reverse=True)
        limited = http.get(f"/v1/events/{job.job_id}/similar", params={"limit": 1}).json()["data"]
        assert [f["id"] for f in limited] == [job.job_id]  # first even where another event's frames are its own
        if not job.frames:  # a one-image job's vector is its image's: an upload of the image as sent finds it
            frame = job.image
            by_upload = http.post("/v1/events/similar", params={"camera": CAMERA},
                                  files={"image": ("frame.jpg", frame, "image/jpeg")})
            assert by_upload.status_code == 200, by_upload.text
            top = by_upload.json()["data"][0]
            assert top["score"] == pytest.approx(1.0, abs=1e-4)
            twins = {f["id"] for f in found if f["score"] >= top["score"] - 1e-6}  # events of the same frame
            assert job.job_id in twins and top["id"] in twins

