"""Everything `vlmcap serve` can be told: the engine's configuration, the served name, security and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobqueue.consumer import DEFAULT_CAPTION_PRIORITY, DEFAULT_FALL_PRIORITY

if TYPE_CHECKING:
    from engine import EngineConfig


def _engine_config() -> EngineConfig:
    """The engine's defaults, imported only when settings are made: the command line reads the defaults of
    these settings without loading torch."""
    from engine import EngineConfig

    return EngineConfig()


@dataclass
class Limits:
    """What one client may ask for. Each limit answers with a clear 4xx when passed."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_image_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 8
    max_tokens_cap: int = 4096  # the most new tokens one request may ask for
    default_max_tokens: int = 256
    max_waiting_requests: int = 256  # requests queued in the engine beyond which new ones get 429
    # Remote images (http/https URLs): off unless enabled, only to allowlisted hosts.
    allow_remote_images: bool = False
    remote_image_hosts: tuple[str, ...] = ()
    allow_private_remote_images: bool = False
    remote_image_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_bytes", "max_image_pixels", "max_images_per_request",
                     "max_tokens_cap", "default_max_tokens", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} is over max_tokens_cap {self.max_tokens_cap}"
            )


@dataclass
class ServerSettings:
    engine: EngineConfig = field(default_factory=_engine_config)
    served_model_name: str | None = None
    api_key: str | None = None
    # Named keys besides api_key, name -> key (`VLMCAP_API_KEYS`: `name:key` lines; see api.guard.parse_api_keys).
    api_keys: dict[str, str] = field(default_factory=dict)
    # Listen on a non-loopback address without a key (protected mode refuses to; see api.guard.check_exposure).
    allow_unauthenticated: bool = False
    # /metrics answers without the key (a scraper on a trusted network); with keys set it needs one otherwise.
    public_metrics: bool = False
    # Requests of different API keys share cached prefix blocks and image features (else salted by key).
    share_prefix_cache: bool = False
    # Server-sent event streams open at once (captions and alerts); one more answers 503 with Retry-After.
    max_sse_subscribers: int = 256
    # Without an API key, Host header names accepted besides loopback ones ("*": any); see api.guard.
    allowed_hosts: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    # Captions: results go to Redis (shared with camera queue workers) when a URL is given, else memory.
    redis_url: str | None = None
    run_queue_worker: bool = True
    # The in-process queue worker (see jobqueue.consumer.QueueWorker); consumer name None: host-pid.
    consumer_name: str | None = None
    claim_idle_s: float = 60.0
    max_deliveries: int = 3
    queue_batch_size: int = 8
    caption_prompt: str = "Describe the people in this image in one sentence."
    caption_max_tokens: int = 64
    structured_caption_max_tokens: int = 512  # captions under a JSON schema (`schema` of a job or request)
    caption_priority: int = DEFAULT_CAPTION_PRIORITY  # chats (priority 0) go first
    fall_priority: int = DEFAULT_FALL_PRIORITY  # fall alerts: before other camera jobs, after chats
    alert_webhook: str | None = None  # URL each fall alert's result is POSTed to (see jobqueue.alerts)
    shutdown_grace_s: float = 10.0

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
