"""POST /v1/cameras/ask on a real server (tiny random model) over a camera memory filled beforehand
(tests/camera_memory_support.py): the events a question retrieves (its words ranked over the captions, the newest
filling the rest, the cameras and the time range honoured), the frames it was given, the references it cites;
streamed as server-sent events with the same answer; bounded by the context (prompt tokens + max_tokens within
max_model_len, the lowest-ranked events and the frames left out first) and by the image limits; each key's
cameras only; hostile input answered 400 in OpenAI's error body."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from camera_memory_support import NOW, assert_error, frames, known_events, seed

from api.background import BackgroundServer
from api.routes_ask import MAX_ASK_FRAMES, question_terms
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig
from memory import Event


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[BackgroundServer]:
    data_dir = seed(tmp_path_factory.mktemp("ask") / "data", known_events())
    settings = ServerSettings(engine=EngineConfig(model="tiny"), data_dir=str(data_dir))
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def ask(http: httpx.Client, **body) -> dict:
    answer = http.post("/v1/cameras/ask", json={"max_tokens": 6, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_question_s_words_pick_the_events_and_frames(http):
    answer = ask(http, question="Who wore a red coat?", max_events=1)
    assert answer["object"] == "camera.answer" and not answer["empty"]
    assert answer["event_ids"] == ["red-coat"]
    assert answer["frames"] == [{"event_id": "red-coat", "index": 0, "ts": NOW}]
    assert answer["events"][0]["reference"] == "E1" and answer["events"][0]["caption"].startswith("a person")
    assert isinstance(answer["answer"], str) and answer["finish_reason"] in ("stop", "length")
    assert set(answer["cited_event_ids"]) <= set(answer["event_ids"])
    assert answer["usage"]["prompt_tokens"] > 0 and answer["usage"]["completion_tokens"] <= 6

    # More events: the matches first in rank (and so in frames), the newest fill the rest; the prompt gives them
    # oldest first.
    answer = ask(http, question="did anyone fall in the warehouse?", max_events=3, max_frames=3)
    assert set(answer["event_ids"]) == {"fall", "dog", "van"}  # the match, then the two newest
    assert answer["event_ids"] == ["van", "fall", "dog"], "oldest first, as the prompt lists them"
    framed = [f["event_id"] for f in answer["frames"]]
    assert framed.count("fall") >= 1 and len(framed) == 3
    # The best-ranked event gets the first frame; each event one frame a round.
    assert {f["event_id"] for f in answer["frames"]} == {"fall", "dog", "van"}


def test_cameras_and_time_range_are_honoured(http):
    answer = ask(http, question="what happened?", cameras=["gate-2"])
    assert answer["event_ids"] == ["van", "fall"]
    answer = ask(http, question="what happened?", since=NOW + 150, until=NOW + 250)
    assert answer["event_ids"] == ["fall"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 250))
    assert ask(http, question="what happened?", since=iso)["event_ids"] == ["dog"]
    empty = ask(http, question="anything?", cameras=["nowhere"])
    assert empty["empty"] and empty["event_ids"] == [] and empty["usage"]["prompt_tokens"] == 0
    assert ask(http, question="a dog?", max_frames=0)["frames"] == []


def test_streamed_like_the_chat_route_with_the_same_answer(http):
    body = {"question": "where was the delivery van?", "max_events": 2, "max_tokens": 6}
    whole = ask(http, **body)
    chunks = []
    with http.stream("POST", "/v1/cameras/ask", json={**body, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert all(c["object"] == "camera.answer.chunk" and c["id"] == parsed[0]["id"] for c in parsed)
    assert parsed[0]["event_ids"] == whole["event_ids"] and parsed[0]["frames"] == whole["frames"]
    assert "".join(c["delta"] for c in parsed) == whole["answer"]  # greedy: the same prompt, the same text
    assert parsed[-1]["finish_reason"] == whole["finish_reason"]
    assert parsed[-1]["usage"] == whole["usage"] and parsed[-1]["cited_event_ids"] == whole["cited_event_ids"]


def test_hostile_input_is_a_400_naming_the_field(http):
    for body, param in [
        ({"question": ""}, "question"),
        ({"question": "x" * 2001}, "question"),
        ({"question": "who?", "max_events": 0}, "max_events"),
        ({"question": "who?", "max_events": 51}, "max_events"),
        ({"question": "who?", "max_frames": MAX_ASK_FRAMES + 1}, "max_frames"),
        ({"question": "who?", "cameras": ["../etc"]}, "camera"),
        ({"question": "who?", "cameras": ["c"] * 65}, "cameras"),
        ({"question": "who?", "since": "yesterday"}, "since"),
        ({"question": "who?", "since": NOW + 10, "until": NOW}, "until"),
        ({"question": "who?", "max_tokens": 10**6}, "max_tokens"),
        ({"question": "who?", "max_tokens": 0}, "max_tokens"),
        ({"question": "who?", "tools": []}, "tools"),
        ({"question": ["who?"]}, "question"),
    ]:
        assert_error(http.post("/v1/cameras/ask", json=body), 400, param)
    assert_error(http.post("/v1/cameras/ask", content=b"{", headers={"content-type": "application/json"}), 400)


def test_question_terms_leave_out_stop_words_and_query_syntax():
    assert question_terms('Did anyone FALL in the "warehouse" last night? OR NEAR(x)') == \
        ["fall", "warehouse", "near"]
    assert question_terms("the a an?") == []


# -- bounds and keys -----------------------------------------------------------------------------------------
CONTEXT = 1024
MANY = 30


def many_events() -> list[Event]:
    return [Event(id=f"walk-{i:02d}", camera_id="gate-1" if i % 2 else "gate-2", kind="event",
                  start_ts=NOW + 10 * i, end_ts=NOW + 10 * i + 4, finished_at=NOW + 10 * i + 5,
                  caption=f"person {i} walks slowly along the fence, looks at the parked cars and then leaves "
                          "through the side door carrying a backpack", track_id=i, frames=frames(NOW + 10 * i, 3, i))
            for i in range(MANY)]


@pytest.fixture(scope="module")
def tight(tmp_path_factory) -> Iterator[BackgroundServer]:
    data_dir = seed(tmp_path_factory.mktemp("ask-tight") / "data", many_events())
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_model_len=CONTEXT), data_dir=str(data_dir),
                              api_keys={"alice": "key-a", "bob": "key-b"}, events_key_cameras=("alice:gate-1",),
                              limits=Limits(max_images_per_request=2))
    with BackgroundServer(create_app(settings)) as running:
        yield running


def test_the_prompt_stays_within_the_context_and_the_image_limit(tight):
    with httpx.Client(base_url=tight.url, timeout=120, headers={"Authorization": "Bearer key-b"}) as http:
        http.headers["Authorization"] = "Bearer key-a"
        answer = ask(http, question="who carried a backpack?", max_events=50, max_frames=8, max_tokens=16)
        assert answer["usage"]["prompt_tokens"] + 16 <= CONTEXT
        assert 0 < len(answer["event_ids"]) < MANY // 2, "the lowest-ranked events were left out"
        assert answer["dropped"]["events"] > 0
        assert len(answer["frames"]) <= 2, "--max-images-per-request holds for the frames"
        assert all(int(i.split("-")[1]) % 2 for i in answer["event_ids"]), "alice sees gate-1's events only"
        assert ask(http, question="anything?", cameras=["gate-2"])["empty"]

        http.headers["Authorization"] = "Bearer key-b"  # bob: a key without cameras sees no events
        bob = ask(http, question="who carried a backpack?")
        assert bob["empty"] and bob["event_ids"] == []
        http.headers["Authorization"] = "Bearer wrong"
        assert_error(http.post("/v1/cameras/ask", json={"question": "who?"}), 401)


# -- chats stay stall-free while a question runs ------------------------------------------------------------
BUDGET = 32  # tokens a step: the question's prompt (captions and frames) takes many steps


@pytest.mark.timeout(300)
def test_chats_decode_in_every_step_while_the_question_s_prompt_prefills(tmp_path_factory):
    """Two chats stream over HTTP; a question about the cameras (four events' captions and four of their frames)
    is asked beside them. The engine's own schedule, recorded step by step: every step that carries a piece of the
    question's prompt (a chunk of it, or its frames' tower work) also carries one decode token of each chat. No
    timing: the steps are counted, not measured."""
    data_dir = seed(tmp_path_factory.mktemp("ask-stall") / "data", known_events())
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=BUDGET, max_num_seqs=8),
                              data_dir=str(data_dir))
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        engine = server.state.bridge.engine
        steps: list = []
        schedule = engine.scheduler.schedule

        def recorded():
            out = schedule()
            steps.append(out)
            return out

        engine.scheduler.schedule = recorded
        model = http.get("/v1/models").json()["data"][0]["id"]
        started = [threading.Event() for _ in range(2)]
        done = threading.Event()
        tokens = [0, 0]

        def chat(index: int) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": f"Tell me story {index} about buses."}],
                    "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.Client(base_url=server.url, timeout=120) as own, \
                    own.stream("POST", "/v1/chat/completions", json=body) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        tokens[index] += 1
                        started[index].set()
                    if done.is_set():
                        return

        threads = [threading.Thread(target=chat, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        try:
            for event in started:
                assert event.wait(120), "a chat did not start streaming"
            mark = len(steps)
            chats = {c.request_id for c in steps[mark - 1].chunks if c.start >= c.num_prompt_tokens}
            assert len(chats) == 2, "both chats decode when the question comes"
            answer = ask(http, question="did anyone fall in the warehouse?", max_events=4, max_frames=4, max_tokens=4)
        finally:
            done.set()
        for thread in threads:
            thread.join(60)
        during = steps[mark:]
        asked = {c.request_id for out in during for c in out.chunks if c.request_id not in chats}
        assert len(asked) == 1, asked
        [question] = asked
        prefill = [out for out in during
                   if any(c.request_id == question and c.start < c.num_prompt_tokens for c in out.chunks)
                   or any(w.request_id == question for w in out.encoder_work)]
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert len(answer["frames"]) == 4 and len(answer["event_ids"]) == 4
        assert prompt_tokens > 5 * BUDGET and len(prefill) >= prompt_tokens // BUDGET
        assert any(out.encoder_work for out in prefill), "its frames went through the tower in these steps"
        for number, out in enumerate(prefill):
            decodes = [c for c in out.chunks if c.request_id in chats]
            assert sorted(c.request_id for c in decodes) == sorted(chats), f"step {number}: a chat skipped"
            assert all(c.num_tokens == 1 and c.start >= c.num_prompt_tokens for c in decodes)
            assert out.num_tokens <= BUDGET
        assert all(tokens), "the chats streamed their tokens"
