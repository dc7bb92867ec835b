"""Where the camera memory keeps events and for how long, and the MQTT broker finished jobs are published to: the
settings `vlmcap serve` and `vlmcap worker` take (their options and `VLMCAP_*` variables are built from these
fields), declared once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jobqueue.checks import positive_count

EVENTS_FILE = "events.db"  # the embedded store's file under the data directory


@dataclass(kw_only=True)
class MemorySettings:
    """The camera memory (the event store).

    data_dir: directory of the server's own files, the embedded event store among them (default:
        $XDG_DATA_HOME/vlmcap, else ~/.local/share/vlmcap).
    events_store: where finished camera jobs are kept as events: a SQLite file, a postgresql:// URL shared by
        several servers, or 'off' (default: events.db under data_dir).
    events_max_age_days: events older than this many days are dropped.
    events_max_bytes: when the events' frames, text and vectors pass this size, the oldest are dropped.
    events_frames: thumbnails kept per event, spread over its frames.
    events_thumbnail_size: longest side of a kept thumbnail, in pixels.
    events_shared: every API key sees every camera's events (one tenant with several keys).
    events_key_cameras: a named key's cameras, 'name:camera,camera' (repeat): without events_shared a key of
        --api-keys sees the events of its cameras only; --api-key's key (named default) sees every camera's.
    """

    data_dir: str | None = None
    events_store: str | None = None
    events_max_age_days: float = 30.0
    events_max_bytes: int = 2 * 1024 * 1024 * 1024
    events_frames: int = 4
    events_thumbnail_size: int = 320
    events_shared: bool = False
    events_key_cameras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.events_max_age_days > 0:
            raise ValueError(f"events_max_age_days must be positive, got {self.events_max_age_days!r}")
        for name in ("events_max_bytes", "events_frames", "events_thumbnail_size"):
            positive_count(name, getattr(self, name))
        self.key_cameras  # noqa: B018 (a malformed entry is refused at start)

    @property
    def key_cameras(self) -> dict[str, frozenset[str]]:
        """`events_key_cameras` by key name (ValueError naming a malformed entry)."""
        out: dict[str, set[str]] = {}
        for entry in self.events_key_cameras:
            name, _, cameras = entry.partition(":")
            listed = {c.strip() for c in cameras.split(",") if c.strip()}
            if not name.strip() or not listed:
                raise ValueError(f"events_key_cameras entries are 'name:camera,camera', got {entry!r}")
            out.setdefault(name.strip(), set()).update(listed)
        return {name: frozenset(cameras) for name, cameras in out.items()}

    @property
    def events_location(self) -> str | None:
        """The store to open: a path or a postgresql:// URL; None when the store is off."""
        if self.events_store and self.events_store.strip().lower() == "off":
            return None
        if self.events_store:
            return self.events_store
        return str(resolved_data_dir(self.data_dir) / EVENTS_FILE)


def resolved_data_dir(data_dir: str | None) -> Path:
    """`data_dir`, or the platform's data directory for vlmcap."""
    if data_dir:
        return Path(data_dir).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "vlmcap"


@dataclass(kw_only=True)
class MqttSettings:
    """MQTT out (memory/mqtt.py): what `vlmcap serve` and `vlmcap worker` publish each finished camera job to.

    mqtt_url: publish camera captions, events and fall alerts to this MQTT broker, with Home Assistant discovery
        (mqtt://host:port, mqtts:// for TLS, user:password@ before the host when it asks; default: none).
    mqtt_prefix: the MQTT topics' prefix: <prefix>/<camera>/caption, /event, /fall and <prefix>/available.
    mqtt_discovery_prefix: Home Assistant's MQTT discovery prefix ('': publish no discovery configs).
    """

    mqtt_url: str | None = None
    mqtt_prefix: str = "vlmcap"
    mqtt_discovery_prefix: str = "homeassistant"

    def __post_init__(self) -> None:
        self.mqtt_url = self.mqtt_url or None  # an empty variable: none
        if self.mqtt_url:
            from memory.mqtt import parse_mqtt_url, validate_prefix

            parse_mqtt_url(self.mqtt_url)
            validate_prefix(self.mqtt_prefix)
            if self.mqtt_discovery_prefix:
                validate_prefix(self.mqtt_discovery_prefix, "mqtt_discovery_prefix")
