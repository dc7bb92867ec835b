"""The settings of the benchmarks, apart from the benchmarks themselves: plain dataclasses, so that the command
line reads their defaults without importing torch, the engine or an HTTP client (`python -m bench` runs on a
machine that has only torch, transformers and typer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_VIDEO = Path(__file__).resolve().parent.parent / "samples" / "people.mp4"


@dataclass
class HostConfig:
    model: str = "tiny-deep"
    device: str = "cpu"
    dtype: str = "float32"
    decodes: int = 64
    context: int = 900
    later: int = 500
    steps: int = 20
    warmup: int = 3
    counted_steps: int = 2
    budget: int = 2048
    threads: int | None = None
    attention_backend: str | None = None  # None: the engine's default
    cpu_linear: bool | None = None  # None: the engine's default
    compile_model: bool = False


@dataclass
class StallConfig:
    model: str = "dummy:smolvlm-256m"
    device: str = "cpu"
    dtype: str = "bfloat16"
    chats: int = 8
    images: int = 2
    budget: int = 16
    encoder_budget: int = 64
    encoder_slices_per_step: int | None = 3
    warmup_steps: int = 16
    after_steps: int = 16
    threads: int | None = None
    prefix_caching: bool | None = None  # None: the engine's default


@dataclass
class HttpStallConfig:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str | None = None  # the model id to ask for; default: the first of /v1/models
    chats: int = 8
    images: int = 2
    warmup_tokens: int = 16  # every chat has streamed this many tokens when the image prompt is sent
    after_tokens: int = 16  # and this many more after the image prompt's first token, then all stop
    chat_max_tokens: int = 3000  # long enough to outlast the image prompt's prefill
    timeout: float = 1800.0


@dataclass
class PeersConfig:
    model: str = "dummy:smolvlm-256m"
    device: str = "cpu"
    dtype: str = "bfloat16"
    requests: int = 32
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    seed: int = 0
    hf_batch_size: int = 8
    budget: int = 2048
    threads: int | None = None
    prefix_caching: bool | None = None  # None: the engine's default


@dataclass
class GrammarBenchConfig(PeersConfig):
    repeats: int = 3  # runs of each kind, alternated; the median is reported


QUESTIONS = (
    "Describe the people in this photo and what they are doing.",
    "What is the person nearest the camera wearing?",
    "What colour is the bus, and what is written on it?",
    "Is it day or night, and what is the weather like?",
)


@dataclass
class PrefixConfig:
    model: str = "dummy:smolvlm-256m"
    device: str = "cpu"
    dtype: str = "bfloat16"
    turns: int = 4
    max_tokens: int = 32  # new tokens of each turn (EOS ignored, so each answer has exactly this many)
    budget: int = 2048  # max_num_batched_tokens
    threads: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(QUESTIONS):
            raise ValueError(f"turns must be between 1 and {len(QUESTIONS)}, got {self.turns}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


@dataclass
class ServeConfig:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str | None = None
    rate: float = 2.0
    burstiness: float = 1.0
    num_requests: int | None = 50
    duration: float | None = None
    image_fraction: float = 0.25
    prompt_words: int = 48
    max_tokens: int = 64
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)  # "ttft" / "itl" / "tpot" / "e2e" in ms
    # Every request generates max_tokens tokens (random-weight models reach EOS at random); vlmcap and vLLM
    # take this extension to the OpenAI API.
    ignore_eos: bool = True
    timeout: float = 600.0


@dataclass
class PipelineBenchConfig:
    source: str = str(SAMPLE_VIDEO)
    detectors: tuple[str, ...] = ("people-fall", "hog")
    yolo_weights: str | None = None
    imgsz: int = 640
    redis_url: str | None = None
    repeats: int = 1


@dataclass
class OverheadConfig:
    model: str = "dummy:smolvlm-256m"
    dtype: str = "bfloat16"
    chats: int = 8
    max_tokens: int = 64
    budget: int = 2048
    threads: int | None = None
    repeats: int = 1  # each side runs this many times, alternating; the best of each is kept
    ready_timeout_s: float = 600.0


MAX_DURATION_S = 3600.0
MAX_CHATS = 64
MAX_RATE = 50.0


@dataclass
class SoakConfig:
    model: str = "tiny"
    duration: float = 120.0  # seconds of load
    warmup: float = 20.0  # seconds of load before the first memory sample that counts
    chats: int = 4  # streaming chats kept going at once
    caption_rate: float = 0.5  # REST captions per second
    job_rate: float = 1.0  # camera jobs per second
    hostile_fraction: float = 0.2
    max_tokens: int = 16
    max_body_bytes: int = 4 * 2**20  # the server's limit (an oversized hostile body is just over it)
    drain_timeout: float = 300.0  # seconds to wait for the last camera jobs after the load stops
    memory_interval: float = 2.0
    seed: int = 0
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.duration <= MAX_DURATION_S:
            raise ValueError(f"duration must be in (0, {MAX_DURATION_S:.0f}] seconds, got {self.duration}")
        if not 0 <= self.warmup < self.duration:
            raise ValueError(f"warmup must be in [0, duration), got {self.warmup}")
        if not 0 <= self.chats <= MAX_CHATS:
            raise ValueError(f"chats must be in [0, {MAX_CHATS}], got {self.chats}")
        for name in ("caption_rate", "job_rate"):
            if not 0 <= getattr(self, name) <= MAX_RATE:
                raise ValueError(f"{name} must be in [0, {MAX_RATE:.0f}] per second, got {getattr(self, name)}")
        if not 0 <= self.hostile_fraction <= 1:
            raise ValueError(f"hostile_fraction must be in [0, 1], got {self.hostile_fraction}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
