"""MQTT out against a real broker started by the tests (Debian's mosquitto when installed, else amqtt as a
subprocess): topics, payloads, retained last caption, QoS, Home Assistant discovery, the availability topic and
its last will, camera ids kept inside the prefix, the bounded queue while the broker is away, and alerts queued
while the broker is down reaching it when it is back. A small TCP gate between the publisher and the broker cuts
and restores the publisher's connection on cue, so that the subscriber, connected straight to the broker, is in
place before the publisher comes back."""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from jobqueue.contract import CaptionResult
from memory.mqtt import MqttPublisher, camera_topic_id, parse_mqtt_url, validate_prefix

WAIT_S = 30.0  # the most any condition below is waited for (a deadline, not a timing under test)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


class Broker:
    """A real MQTT broker on `port`, as a subprocess."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir, self.process = port, workdir, None

    def start(self) -> Broker:
        mosquitto = shutil.which("mosquitto")
        if mosquitto:
            config = self.workdir / "mosquitto.conf"
            config.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n")
            command = [mosquitto, "-c", str(config)]
        else:
            config = self.workdir / "amqtt.yaml"
            config.write_text(f"listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:{self.port}\n"
                              "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
                              "    allow_anonymous: true\n")
            command = [str(Path(sys.executable).with_name("amqtt")), "-c", str(config)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._accepts, f"the broker listens on {self.port}")
        return self

    def _accepts(self) -> bool:
        assert self.process.poll() is None, "the broker exited"
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.5).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


class Gate:
    """A TCP forwarder to `target`: `close()` cuts every connection through it (no MQTT DISCONNECT: the broker
    sees the client vanish) and refuses new ones until `open()`."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.is_open = True
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                if not self.is_open:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target), 2)
                    upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            self.is_open = False
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.sockets = []

    def open(self) -> None:
        with self.lock:
            self.is_open = True

    def shut(self) -> None:
        self.close()
        self.server.close()


class Subscriber:
    """A paho client subscribed to `topic` (QoS 1) on the broker, keeping every message it gets."""

    def __init__(self, port: int, topic: str = "#") -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{uuid.uuid4().hex[:8]}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *args: self.subscribed.set()
        self.client.on_connect = lambda client, *args: client.subscribe(topic, qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.subscribed.wait(WAIT_S), "the subscription was never acknowledged"

    def _on_message(self, client, userdata, message) -> None:
        with self.lock:
            self.messages.append(message)

    def on(self, topic: str) -> list[mqtt.MQTTMessage]:
        with self.lock:
            return [m for m in self.messages if m.topic == topic]

    def topics(self) -> set[str]:
        with self.lock:
            return {m.topic for m in self.messages}

    def wait_for(self, topic: str, count: int = 1, timeout: float = WAIT_S) -> list[mqtt.MQTTMessage]:
        wait_until(lambda: len(self.on(topic)) >= count, f"{count} message(s) on {topic} (got {self.topics()})",
                   timeout)
        return self.on(topic)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def result(job_id: str, camera: str = "gate-1", kind: str | None = "sighting", fall: bool = False,
           status: str = "done", caption: str | None = "a person in a red coat") -> CaptionResult:
    return CaptionResult(id=job_id, status=status, camera_id=camera, created_at=1764570000.0,
                         frame_ts=1764570000.0, person_count=1, caption=caption if status == "done" else None,
                         error=None if status == "done" else "boom", finished_at=1764570001.0, fall=fall,
                         kind=kind, track_id=3, frame_count=1 if kind != "event" else 4)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    server = Broker(free_port(), tmp_path_factory.mktemp("broker")).start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A prefix of the test's own, so retained messages of other tests on the module's broker do not mix in."""
    return f"vlmcap-{uuid.uuid4().hex[:6]}"


def publisher_to(port: int, prefix: str, **options) -> MqttPublisher:
    publisher = MqttPublisher(f"mqtt://127.0.0.1:{port}", prefix, "homeassistant", **options)
    publisher.start()
    return publisher


def test_topics_payloads_retained_caption_and_discovery(broker, prefix):
    publisher = publisher_to(broker.port, prefix)
    try:
        live = Subscriber(broker.port, f"{prefix}/#")
        publisher.notify(result("job-1", caption="first caption"))
        publisher.notify(result("job-2", caption="last caption"))
        publisher.notify(result("job-3", kind="event"))
        publisher.notify(result("job-4", kind="fall", fall=True))
        fall = live.wait_for(f"{prefix}/gate-1/fall")[0]
        assert (fall.qos, fall.retain) == (1, False)
        assert json.loads(fall.payload)["id"] == "job-4" and json.loads(fall.payload)["fall"] is True
        # The fall job was captioned: its caption is now the camera's last one.
        live.wait_for(f"{prefix}/gate-1/caption")

        late = Subscriber(broker.port, "#")
        caption = late.wait_for(f"{prefix}/gate-1/caption")
        # (amqtt may hand a new subscription its retained message twice: the same one)
        assert {m.payload for m in caption} == {caption[0].payload} and all(m.retain for m in caption), \
            "a later subscriber gets the last caption, retained"
        body = json.loads(caption[0].payload)
        assert (body["id"], body["camera_id"], body["kind"], body["status"]) == ("job-4", "gate-1", "fall", "done")
        assert late.wait_for(f"{prefix}/available")[-1].payload == b"online"
        assert not late.on(f"{prefix}/gate-1/event"), "events are not retained"
        assert not late.on(f"{prefix}/gate-1/fall"), "alerts are not retained"

        node = prefix  # already of Home Assistant's id characters
        sensor = json.loads(late.wait_for(f"homeassistant/sensor/{node}_gate-1_caption/config")[0].payload)
        binary = json.loads(late.wait_for(f"homeassistant/binary_sensor/{node}_gate-1_fall/config")[0].payload)
        for config in (sensor, binary):
            assert config["availability_topic"] == f"{prefix}/available"
            assert (config["payload_available"], config["payload_not_available"]) == ("online", "offline")
            assert config["device"]["identifiers"] == [f"{node}_gate-1"]
            assert config["device"]["manufacturer"] == "vlmcap"
        assert sensor["state_topic"] == f"{prefix}/gate-1/caption"
        assert sensor["unique_id"] != binary["unique_id"]
        assert binary["state_topic"] == f"{prefix}/gate-1/fall" and binary["device_class"] == "safety"
        assert "value_json.fall" in binary["value_template"] and "[:255]" in sensor["value_template"]
        late.close()

        events = live.wait_for(f"{prefix}/gate-1/event")
        assert [json.loads(m.payload)["id"] for m in events] == ["job-3"]
        live.close()
    finally:
        publisher.stop()


def test_a_failed_fall_is_still_an_alert_and_a_failed_caption_is_not_published(broker, prefix):
    live = Subscriber(broker.port, f"{prefix}/#")
    publisher = publisher_to(broker.port, prefix)
    try:
        publisher.notify(result("job-f", kind="sighting", status="failed"))
        publisher.notify(result("job-g", kind="fall", fall=True, status="failed"))
        alert = json.loads(live.wait_for(f"{prefix}/gate-1/fall")[0].payload)
        assert (alert["id"], alert["status"], alert["error"]) == ("job-g", "failed", "boom")
        assert not live.on(f"{prefix}/gate-1/caption")
    finally:
        publisher.stop()
        live.close()


HOSTILE = ["a/b", "+", "#", "gate/#", "x\x00y", "../../homeassistant/sensor/evil", "café 2", "\n", "gate_1",
           "a" * 200, "$SYS"]


def test_a_camera_id_cannot_publish_outside_its_prefix(broker, prefix):
    everything = Subscriber(broker.port, "#")
    publisher = publisher_to(broker.port, prefix)
    try:
        for index, camera in enumerate(HOSTILE):
            publisher.notify(result(f"job-{index}", camera=camera, kind="fall", fall=True))
        ids = {camera_topic_id(camera) for camera in HOSTILE}
        assert len(ids) == len(HOSTILE), "every camera has a topic of its own"
        assert camera_topic_id("gate_1") == "gate_1" and camera_topic_id("gate-1") == "gate-1"
        for topic_id in ids:
            assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", topic_id)
            everything.wait_for(f"{prefix}/{topic_id}/fall")
            everything.wait_for(f"homeassistant/binary_sensor/{prefix}_{topic_id}_fall/config")
        ours = re.compile(rf"^({re.escape(prefix)}/([A-Za-z0-9_-]+/(caption|event|fall)|available)"
                          rf"|homeassistant/(sensor|binary_sensor)/{re.escape(prefix)}_[A-Za-z0-9_-]+/config)$")
        others = re.compile(r"vlmcap-[0-9a-f]{6}")  # other tests' prefixes (their retained messages)
        mine = {t for t in everything.topics() if prefix in t or not others.search(t)}
        assert all(ours.match(t) for t in mine), sorted(t for t in mine if not ours.match(t))
        assert not any(t.startswith(("$SYS", "../", "homeassistant/sensor/evil")) for t in everything.topics())
        # The original camera id travels in the payload.
        payloads = [json.loads(m.payload)["camera_id"] for t in ids for m in everything.on(f"{prefix}/{t}/fall")]
        assert sorted(payloads) == sorted(HOSTILE)
    finally:
        publisher.stop()
        everything.close()


def test_options_are_checked():
    assert parse_mqtt_url("mqtt://broker").port == 1883
    assert parse_mqtt_url("mqtts://u:p%40ss@broker:9000") .password == "p@ss"
    assert parse_mqtt_url("mqtts://broker").tls and parse_mqtt_url("mqtts://broker").port == 8883
    with pytest.raises(ValueError, match="http://broker"):
        parse_mqtt_url("http://broker")
    with pytest.raises(ValueError, match=r"\*\*\*") as refused:
        parse_mqtt_url("mqtt://user:secret@broker:notaport")
    assert "secret" not in str(refused.value)
    assert validate_prefix("site/vlmcap") == "site/vlmcap"
    for bad in ("a/+/b", "#", "/vlmcap", "vlmcap/", "", "a b", "a\x00"):
        with pytest.raises(ValueError, match="mqtt_prefix"):
            validate_prefix(bad)
    with pytest.raises(ValueError, match="max_pending"):
        MqttPublisher("mqtt://127.0.0.1:1", "vlmcap", None, max_pending=0)


def test_a_full_queue_drops_captions_first_and_keeps_the_alerts(broker, prefix, caplog):
    gate = Gate(broker.port)
    gate.close()
    live = Subscriber(broker.port, f"{prefix}/#")
    publisher = publisher_to(gate.port, prefix, max_pending=6)
    try:
        with caplog.at_level(logging.WARNING, logger="memory.mqtt"):
            for index in range(10):
                publisher.notify(result(f"c-{index}", caption=f"caption {index}"))
            for index in range(3):  # each a caption (dropped first) and an alert
                publisher.notify(result(f"f-{index}", kind="fall", fall=True, status="failed"))
        health = publisher.health()
        assert health["pending"] == 6 and not health["connected"]
        assert health["dropped"] == 7 and health["dropped_alerts"] == 0
        assert any("dropped" in r.getMessage() and "fall alerts are kept" in r.getMessage() for r in caplog.records)
        gate.open()
        alerts = live.wait_for(f"{prefix}/gate-1/fall", 3)
        assert [json.loads(m.payload)["id"] for m in alerts] == ["f-0", "f-1", "f-2"]
        captions = live.wait_for(f"{prefix}/gate-1/caption", 3)
        assert [json.loads(m.payload)["id"] for m in captions] == ["c-7", "c-8", "c-9"], "the newest kept"
        wait_until(lambda: publisher.health()["pending"] == 0, "the queue emptied")
    finally:
        publisher.stop()
        live.close()
        gate.shut()


def test_alerts_published_while_the_broker_is_down_reach_it_when_it_is_back(tmp_path, prefix):
    broker = Broker(free_port(), tmp_path).start()
    gate = Gate(broker.port)
    publisher = publisher_to(gate.port, prefix, min_backoff_s=1, max_backoff_s=2)
    live = Subscriber(broker.port, f"{prefix}/#")
    try:
        publisher.notify(result("before", kind="fall", fall=True))
        live.wait_for(f"{prefix}/gate-1/fall")
        # The publisher vanishes: the broker says its last will.
        gate.close()
        offline = live.wait_for(f"{prefix}/available")
        wait_until(lambda: live.on(f"{prefix}/available")[-1].payload == b"offline", "the last will (offline)")
        wait_until(lambda: not publisher.connected, "the publisher saw the connection go")
        live.close()
        broker.stop()
        for index in range(3):
            publisher.notify(result(f"down-{index}", kind="fall", fall=True))
        assert publisher.health()["pending"] == 6  # each a caption and an alert
        assert publisher.health()["disconnects"] == 1 and offline

        broker.start()  # a new broker process: nothing retained, no session
        back = Subscriber(broker.port, "#")
        gate.open()
        alerts = back.wait_for(f"{prefix}/gate-1/fall", 3)
        assert [json.loads(m.payload)["id"] for m in alerts] == ["down-0", "down-1", "down-2"]
        assert all(m.qos == 1 for m in alerts)
        assert back.wait_for(f"{prefix}/available")[-1].payload == b"online"
        back.wait_for(f"homeassistant/binary_sensor/{prefix}_gate-1_fall/config")  # discovery sent again
        assert publisher.health()["connects"] == 2
        back.close()
    finally:
        publisher.stop()
        gate.shut()
        broker.stop()


@pytest.mark.timeout(300)
def test_a_server_publishes_the_jobs_its_queue_worker_finishes(broker, prefix, redis_url, tmp_path):
    """`--mqtt-url` on a real server (tiny model, embedded Redis): a sighting and a fall job sent by the real
    producer reach the broker as the camera's retained caption and a QoS 1 alert, beside the event store's hook;
    /ready shows the publisher."""
    import io

    import httpx
    from PIL import Image
    from queue_support import enqueue

    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig
    from jobqueue.contract import Detection, Job

    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 30)).save(picture, format="JPEG")
    box = [Detection(1, 2, 30, 40, 0.9, 3)]
    jobs = [Job(camera_id="yard:1.a", frame_ts=1000.0, prompt="Who?", image=picture.getvalue(), detections=box,
                job_id="seen-1", track_id=3),
            Job(camera_id="yard:1.a", frame_ts=1001.0, prompt="Fallen?", image=picture.getvalue(), detections=box,
                job_id="fell-1", fall=True, track_id=3)]
    settings = ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=4, redis_url=redis_url,
                              data_dir=str(tmp_path / "data"), mqtt_url=f"mqtt://127.0.0.1:{broker.port}",
                              mqtt_prefix=prefix)
    live = Subscriber(broker.port, "#")
    try:
        with BackgroundServer(create_app(settings)) as server:
            enqueue(redis_url, jobs)
            camera = camera_topic_id("yard:1.a")
            alert = json.loads(_wait(live, f"{prefix}/{camera}/fall")[0].payload)
            assert (alert["id"], alert["camera_id"], alert["fall"]) == ("fell-1", "yard:1.a", True)
            captions = _wait(live, f"{prefix}/{camera}/caption", 2)
            assert {json.loads(m.payload)["id"] for m in captions} == {"seen-1", "fell-1"}
            live.wait_for(f"homeassistant/sensor/{prefix}_{camera}_caption/config")
            with httpx.Client(base_url=server.url) as http:
                ready = http.get("/ready").json()
                assert ready["mqtt"]["connected"] and ready["mqtt"]["published"] >= 5
                assert {e["id"] for e in http.get("/v1/events").json()["data"]} <= {"seen-1", "fell-1"}
        assert live.on(f"{prefix}/available")[-1].payload == b"offline", "a clean stop says offline"
    finally:
        live.close()


def _wait(subscriber: Subscriber, topic: str, count: int = 1) -> list[mqtt.MQTTMessage]:
    """As `Subscriber.wait_for`, with a deadline for captioning on a loaded machine."""
    wait_until(lambda: len(subscriber.on(topic)) >= count, f"{count} message(s) on {topic}", timeout=240)
    return subscriber.on(topic)
