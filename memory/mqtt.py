"""MQTT out, the convention of Frigate and Home Assistant: each finished camera job is published to a broker
under a prefix per camera, and Home Assistant finds each camera's entities by MQTT discovery.

Topics (`<prefix>` is `--mqtt-prefix`, `<camera>` the camera's topic id, `camera_topic_id`):

- `<prefix>/available`: `online` / `offline`, retained; `offline` is also the connection's last will, so the
  broker says it when the server vanishes.
- `<prefix>/<camera>/caption`: every captioned job's result as JSON (GET /v1/captions/{id}'s body), retained:
  a subscriber that comes later gets the camera's last caption. QoS 0: a newer caption supersedes it.
- `<prefix>/<camera>/event`: results of multi-frame events (`kind` `event`), QoS 1.
- `<prefix>/<camera>/fall`: fall alerts (also those whose caption failed: the fall was still seen), QoS 1.
- `<discovery>/sensor/<node>_<camera>_caption/config` and `<discovery>/binary_sensor/<node>_<camera>_fall/config`:
  Home Assistant discovery (retained) of a "last caption" sensor and a "fall" binary sensor per camera, one
  device per camera, available while `<prefix>/available` says `online`. Sent when a camera is first seen and
  again on every connection.

Publishing never waits on the broker: `notify` queues a message when the broker is not connected and returns.
paho-mqtt's network thread reconnects with exponential backoff and, once connected, the queue is sent in order
(QoS 1 messages in flight when a connection breaks are sent again by paho). The queue is bounded: when it is
full a caption or event is dropped first (logged), a fall alert only when the queue holds nothing but alerts.

A camera id never leaves its prefix: one that is not 1-64 of [A-Za-z0-9_-] (what Home Assistant's object ids
allow; MQTT's `+`, `#` and `/` among those refused) is published under its safe characters plus a hash of the
whole id, so two cameras never share a topic."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import ssl
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from jobqueue.checks import at_least
from jobqueue.contract import CaptionResult, Job, JobStatus

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 1000  # messages kept while the broker is away
DEFAULT_MIN_BACKOFF_S = 1  # paho takes whole seconds
DEFAULT_MAX_BACKOFF_S = 60
KEEPALIVE_S = 30
MAX_CAMERAS = 1000  # cameras whose discovery is repeated on each connection
FALL_OFF_DELAY_S = 300  # Home Assistant turns the fall sensor off this long after the last alert
HA_STATE_CHARS = 255  # Home Assistant's longest state
ONLINE, OFFLINE = "online", "offline"
SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")
PREFIX_LEVEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DROP_LOG_EVERY = 100  # after the first drop of an outage, one log line per this many


def camera_topic_id(camera_id: str) -> str:
    """The camera's id in topics and Home Assistant object ids: the id itself when it is 1-64 of
    [A-Za-z0-9_-], else its safe characters (at most 40) and 8 hex digits of its SHA-256."""
    if SAFE_ID.match(camera_id):
        return camera_id
    safe = UNSAFE_RUN.sub("_", camera_id).strip("_")[:40] or "camera"
    return f"{safe}-{hashlib.sha256(camera_id.encode()).hexdigest()[:8]}"


def validate_prefix(prefix: str, name: str = "mqtt_prefix") -> str:
    """The topic prefix itself: levels of [A-Za-z0-9_.-] joined by '/' (no wildcard, no leading or trailing
    '/'); ValueError naming it otherwise."""
    levels = prefix.split("/")
    if len(levels) > 8 or not all(PREFIX_LEVEL.match(level) for level in levels):
        raise ValueError(f"{name} must be 1-8 topic levels of letters, digits, _ . - joined by '/', got {prefix!r}")
    return prefix


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool
    username: str | None
    password: str | None


def parse_mqtt_url(url: str) -> BrokerAddress:
    """mqtt://[user[:password]@]host[:port] (port 1883) or mqtts:// (TLS, port 8883); ValueError naming the URL
    (its password hidden) otherwise."""
    parts = urlsplit(url)
    shown = url if parts.password is None else url.replace(f":{parts.password}@", ":***@")
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"mqtt_url must be mqtt://host[:port] or mqtts://host[:port], got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"mqtt_url has a bad port: {shown!r}") from None
    tls = parts.scheme == "mqtts"
    return BrokerAddress(parts.hostname, port or (8883 if tls else 1883), tls,
                         unquote(parts.username) if parts.username else None,
                         unquote(parts.password) if parts.password else None)


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    alert: bool = False  # a fall alert: kept over captions and events when the queue is full


@dataclass
class MqttStats:
    published: int = 0  # messages handed to the broker connection
    queued: int = 0  # messages that waited for the broker
    dropped: int = 0  # captions and events dropped from a full queue
    dropped_alerts: int = 0  # fall alerts dropped from a queue full of alerts
    connects: int = 0
    disconnects: int = 0


class MqttPublisher:
    """Publishes finished camera jobs to `url`'s broker from paho-mqtt's own network thread: `start()`, then
    `notify(result)` for each finished job (any thread, never blocks), `stop()` at shutdown."""

    def __init__(self, url: str, prefix: str, discovery_prefix: str | None,
                 max_pending: int = DEFAULT_MAX_PENDING, min_backoff_s: int = DEFAULT_MIN_BACKOFF_S,
                 max_backoff_s: int = DEFAULT_MAX_BACKOFF_S, client_id: str | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.address = parse_mqtt_url(url)
        self.prefix = validate_prefix(prefix)
        self.discovery_prefix = validate_prefix(discovery_prefix, "mqtt_discovery_prefix") if discovery_prefix \
            else None
        at_least("max_pending", max_pending, 1)
        if not 1 <= min_backoff_s <= max_backoff_s:
            raise ValueError(f"backoff must be 1 <= min ({min_backoff_s}) <= max ({max_backoff_s}) seconds")
        self.node = UNSAFE_RUN.sub("_", self.prefix)
        self.availability_topic = f"{self.prefix}/available"
        self.max_pending = max_pending
        self.stats = MqttStats()
        self._pending: deque[Message] = deque()
        self._cameras: dict[str, str] = {}  # topic id -> the camera id it was first seen as
        self._lock = threading.Lock()
        self._connected = False
        self._stopping = False
        self._drops_this_outage = 0
        self._last_error: str | None = None
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2,
                                   client_id=client_id or f"vlmcap-{socket.gethostname()}-{id(self):x}")
        if self.address.username:
            self._client.username_pw_set(self.address.username, self.address.password)
        if self.address.tls:
            self._client.tls_set_context(ssl.create_default_context())
        self._client.will_set(self.availability_topic, OFFLINE, qos=1, retain=True)
        self._client.reconnect_delay_set(min_backoff_s, max_backoff_s)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background (a broker that is down is retried with backoff; nothing waits on it)."""
        self._client.connect_async(self.address.host, self.address.port, KEEPALIVE_S)
        self._client.loop_start()
        log.info("mqtt: publishing to %s:%d under %s/", self.address.host, self.address.port, self.prefix)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Say `offline` (retained), give what is in flight `timeout_s` to reach the broker, disconnect."""
        with self._lock:
            connected, waiting = self._connected, len(self._pending)
        if connected:
            info = self._client.publish(self.availability_topic, OFFLINE, qos=1, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError):  # the connection went meanwhile
                pass
        if waiting:
            log.warning("mqtt: %d messages unsent at shutdown", waiting)
        self._stopping = True
        self._client.disconnect()
        self._client.loop_stop()

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    def health(self) -> dict[str, Any]:
        """What `/ready` shows: connected or not, the queue, the counters, the last connection error."""
        with self._lock:
            return {"connected": self._connected, "pending": len(self._pending), **vars(self.stats),
                    "last_error": self._last_error}

    # -- publishing ------------------------------------------------------------------------------

    def notify(self, result: CaptionResult) -> None:
        """Publish a finished job's result (a REST caption, without a kind, too); returns at once."""
        topic_id = camera_topic_id(result.camera_id)
        messages = self.messages_for(result, topic_id)
        if not messages:
            return
        with self._lock:
            if topic_id not in self._cameras and len(self._cameras) < MAX_CAMERAS:
                self._cameras[topic_id] = result.camera_id
                if self._connected:
                    for message in self.discovery_messages(topic_id, result.camera_id):
                        self._publish_locked(message)
            for message in messages:
                self._send_locked(message)

    def on_finished(self, job: Job, result: CaptionResult) -> None:
        """The queue worker's finish hook (`jobqueue.finish.FinishedJob`): publish the job's result."""
        self.notify(result)

    def messages_for(self, result: CaptionResult, topic_id: str) -> list[Message]:
        """The messages of one finished job: its caption (when captioned), its event, its fall alert."""
        base = f"{self.prefix}/{topic_id}"
        payload = json.dumps(result.to_json(), separators=(",", ":")).encode()
        messages = []
        if result.status == JobStatus.DONE.value:
            messages.append(Message(f"{base}/caption", payload, qos=0, retain=True))
            if result.kind == "event":
                messages.append(Message(f"{base}/event", payload, qos=1, retain=False))
        if result.fall:
            messages.append(Message(f"{base}/fall", payload, qos=1, retain=False, alert=True))
        return messages

    def discovery_messages(self, topic_id: str, camera_id: str) -> list[Message]:
        """Home Assistant's discovery configs of a camera: a "last caption" sensor and a "fall" binary sensor."""
        if self.discovery_prefix is None:
            return []
        base = f"{self.prefix}/{topic_id}"
        device = {"identifiers": [f"{self.node}_{topic_id}"], "name": f"{camera_id[:64]} (vlmcap)",
                  "manufacturer": "vlmcap", "model": "camera captions"}
        common = {"availability_topic": self.availability_topic, "payload_available": ONLINE,
                  "payload_not_available": OFFLINE, "device": device}
        caption_id, fall_id = f"{self.node}_{topic_id}_caption", f"{self.node}_{topic_id}_fall"
        caption = {"name": "Last caption", "unique_id": caption_id, "object_id": caption_id,
                   "state_topic": f"{base}/caption",
                   "value_template": f"{{{{ (value_json.caption or '')[:{HA_STATE_CHARS}] }}}}",
                   "json_attributes_topic": f"{base}/caption", "icon": "mdi:cctv", **common}
        fall = {"name": "Fall", "unique_id": fall_id, "object_id": fall_id, "state_topic": f"{base}/fall",
                "value_template": "{{ 'ON' if value_json.fall else 'OFF' }}", "payload_on": "ON",
                "payload_off": "OFF", "device_class": "safety", "off_delay": FALL_OFF_DELAY_S,
                "json_attributes_topic": f"{base}/fall", **common}
        return [
            Message(f"{self.discovery_prefix}/sensor/{caption_id}/config", json.dumps(caption).encode(), 1, True),
            Message(f"{self.discovery_prefix}/binary_sensor/{fall_id}/config", json.dumps(fall).encode(), 1, True),
        ]

    def _send_locked(self, message: Message) -> None:
        if self._connected and not self._pending and self._publish_locked(message):
            return
        self._enqueue_locked(message)

    def _publish_locked(self, message: Message) -> bool:
        """Hand one message to paho; False when the connection is gone (paho keeps QoS 1 ones itself)."""
        import paho.mqtt.client as mqtt

        info = self._client.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
        if info.rc == mqtt.MQTT_ERR_NO_CONN and message.qos == 0:
            return False
        self.stats.published += 1
        return True

    def _enqueue_locked(self, message: Message) -> None:
        self.stats.queued += 1
        if len(self._pending) >= self.max_pending:
            victim = next((m for m in self._pending if not m.alert), None)
            if victim is None and not message.alert:
                victim = message
            elif victim is None:
                victim = self._pending[0]
            if victim is not message:
                self._pending.remove(victim)
            self._dropped_locked(victim)
            if victim is message:
                return
        self._pending.append(message)

    def _dropped_locked(self, message: Message) -> None:
        if message.alert:
            self.stats.dropped_alerts += 1
            log.error("mqtt: the broker is unreachable and %d fall alerts wait; the oldest (%s) dropped",
                      self.max_pending, message.topic)
            return
        self.stats.dropped += 1
        self._drops_this_outage += 1
        if self._drops_this_outage % DROP_LOG_EVERY == 1:
            log.warning("mqtt: the broker is unreachable and %d messages wait; %s dropped (%d dropped in this "
                        "outage; fall alerts are kept)", self.max_pending, message.topic, self._drops_this_outage)

    # -- paho's network thread -------------------------------------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            with self._lock:
                self._last_error = f"connection refused: {reason}"
            log.warning("mqtt: %s:%d refused the connection: %s", self.address.host, self.address.port, reason)
            return
        with self._lock:
            self.stats.connects += 1
            self._publish_locked(Message(self.availability_topic, ONLINE.encode(), 1, True))
            for topic_id, camera_id in self._cameras.items():
                for message in self.discovery_messages(topic_id, camera_id):
                    self._publish_locked(message)
            sent = 0
            while self._pending:
                if not self._publish_locked(self._pending[0]):
                    break  # gone again: the rest waits for the next connection
                self._pending.popleft()
                sent += 1
            self._connected, self._drops_this_outage = True, 0
        log.info("mqtt: connected to %s:%d%s", self.address.host, self.address.port,
                 f"; {sent} queued messages sent" if sent else "")

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        with self._lock:
            was = self._connected
            self._connected = False
            if was:
                self.stats.disconnects += 1
                self._last_error = f"disconnected: {reason}"
        if was and not self._stopping:
            log.warning("mqtt: lost the broker %s:%d (%s); reconnecting with backoff, messages queued",
                        self.address.host, self.address.port, reason)
