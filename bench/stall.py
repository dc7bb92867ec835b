"""`vlmcap bench stall`: do running chats freeze while a camera prompt with thousands of image tokens
is prefilled?

Several chats decode; then a prompt with `images` photos arrives. The same scenario runs with chunked
prefill on (with the per-step encoder budget: `encoder_budget` encoder output tokens a step, by default one
64-token SmolVLM tile, whose tower runs `encoder_slices_per_step` slices (five a layer) a step), with chunked prefill
off, and with chunking on but no per-step encoder budget (every tile a chunk reaches runs its whole tower
in that step). For each run:
the chats' inter-token latency over the window in which the image prompt is prefilled (from its
arrival to its first token), outside that window, the image prompt's time to first token, output
tokens per second, and the number of steps.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import numpy as np

from api.percentiles import percentiles_ms
from bench.configs import HttpStallConfig, StallConfig
from bench.report import (
    machine,
    mp4_bytes,
    panning_frames,
    prefix_caching_option,
    pyplot,
    sample_images,
    save_figure,
    stream_chat,
)
from engine import Engine, EngineConfig, SamplingParams
from engine.video import Video
from jobqueue.contract import MAX_FRAMES_PER_JOB

CHAT_PROMPT = "User: Tell me a long story about a bus driver in a rainy city.<end_of_utterance>\nAssistant:"
IMAGE_PROMPT = "User:{markers}Describe each person you see and what they are doing.<end_of_utterance>\nAssistant:"
# The clip of --video: 512x384 px frames at this rate, in the model's own chat template.
VIDEO_FPS = 2.0
VIDEO_MESSAGES = [{"role": "user", "content": [
    {"type": "video"}, {"type": "text", "text": "Describe each person you see and what they are doing."}]}]


# name: (chunked prefill, per-step encoder budget)
RUNS = {
    "chunked": (True, True),
    "unchunked": (False, False),
    "chunked_no_encoder_budget": (True, False),
}


def _run(cfg: StallConfig, chunked: bool, encoder_budget: bool, images: list,
         video: Video | None = None) -> dict[str, Any]:
    engine = Engine(
        EngineConfig(
            model=cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            max_num_batched_tokens=cfg.budget,
            max_num_seqs=max(cfg.chats + 1, 2),
            enable_chunked_prefill=chunked,
            max_encoder_tokens_per_step=cfg.encoder_budget if encoder_budget else None,
            encoder_slices_per_step=cfg.encoder_slices_per_step if encoder_budget else None,
            num_threads=cfg.threads,
            **prefix_caching_option(cfg.prefix_caching),
        )
    )
    chats = [
        engine.add_request(prompt=CHAT_PROMPT, sampling=SamplingParams(max_tokens=100_000, ignore_eos=True))
        for _ in range(cfg.chats)
    ]
    token_times: dict[str, list[float]] = {c: [] for c in chats}
    steps = []  # (start, end, tokens in the step)
    emitted: list[set[str]] = []  # per step, the requests that gained a token
    computed: list[dict[str, int]] = []  # per step, each request's prompt tokens computed after it
    began = time.perf_counter()

    def step() -> None:
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        steps.append((start - began, end - began, engine.stats().last_step_num_tokens))
        emitted.append({out.request_id for out in outputs})
        computed.append({rid: request.num_computed_tokens for rid, request in dict(engine.requests).items()})
        for out in outputs:
            if out.request_id in token_times:
                token_times[out.request_id].append(end - began)

    while not all(engine.requests[c].is_decoding for c in chats):
        step()
    for _ in range(cfg.warmup_steps):
        step()
    arrival = time.perf_counter() - began
    arrival_step = len(steps)
    # As in the server, the image prompt is preprocessed on another thread while the chats go on stepping
    # (so the step that takes it up may begin before the thread has returned its id).
    prompt = event_prompt(len(images)) if cfg.event_frames else IMAGE_PROMPT.format(markers="<image>" * cfg.images)
    media = dict(messages=VIDEO_MESSAGES, videos=[video]) if video is not None else dict(prompt=prompt, images=images)
    if cfg.event_frames:  # as the queue worker sends an event's frames: one encoder input each
        media["mm_processor_kwargs"] = type(engine.adapter).single_input_options or None
    with ThreadPoolExecutor(1) as pool:
        adding = pool.submit(engine.add_request, **media, sampling=SamplingParams(max_tokens=4))
        while not adding.done():
            step()
    camera = adding.result()
    prompt_tokens = engine.requests[camera].num_prompt_tokens
    while not any(camera in ids for ids in emitted[arrival_step:]):
        step()
    since_arrival = range(arrival_step, len(steps))
    first_step = next(i for i in since_arrival if computed[i].get(camera, 0) > 0)
    first_token_step = next(i for i in since_arrival if camera in emitted[i])
    first_token = steps[first_token_step][1]
    window_steps = first_token_step + 1 - first_step
    for _ in range(cfg.after_steps):
        step()

    before, inside, after = [], [], []
    for times in token_times.values():
        for prev, now in zip(times, times[1:]):
            (before if now <= arrival else inside if now <= first_token else after).append(now - prev)
    measured = steps[arrival_step:]
    span = measured[-1][1] - measured[0][0]
    tokens_out = sum(1 for times in token_times.values() for t in times if t > measured[0][0]) + 1
    return {
        "itl_ms": percentiles_ms(inside),
        "itl_outside_window_ms": percentiles_ms(before + after),
        # A chat's step grows with its context, which grows through a long window: the gaps after the
        # window are those of the same chats without the image prompt, at the context they reached.
        "itl_before_window_ms": percentiles_ms(before),
        "itl_after_window_ms": percentiles_ms(after),
        "ttft_ms": (first_token - arrival) * 1000.0,
        "throughput_tok_s": tokens_out / span,
        "steps": window_steps,
        "max_step_tokens": max(s[2] for s in steps[first_step : first_token_step + 1]),
        "image_prompt_tokens": prompt_tokens,
        "encoder_inputs": engine.stats().encoder_inputs_encoded,
        "timeline": {
            "window": [arrival, first_token],
            "streams": [token_times[c] for c in chats],
        },
    }


def event_prompt(frames: int) -> str:
    """An event's prompt as the queue worker renders it for SmolVLM: each frame after a tracker's note."""
    notes = "".join(f"t=+{0.8 * i:.1f} s: person 3 is in the middle<image>" for i in range(frames))
    return (f"User:{notes}These {frames} frames follow person 3, boxed and labelled. Describe what the person did, "
            "in order.<end_of_utterance>\nAssistant:")


def event_images(photos: list, frames: int, size: int = 512) -> list:
    """`frames` photos scaled so that their longer side is `size` px, as the pipeline sizes an event's frames."""
    scaled = []
    for i in range(frames):
        photo = photos[i % len(photos)]
        ratio = size / max(photo.size)
        scaled.append(photo.resize((max(1, round(photo.width * ratio)), max(1, round(photo.height * ratio)))))
    return scaled


def video_clip(photos: list, seconds: float) -> Video:
    """--video's clip: a camera panning across the first photo, `seconds` long at VIDEO_FPS, 512x384 px."""
    if seconds <= 0:
        raise ValueError(f"video must be a positive number of seconds, got {seconds}")
    return Video(np.stack(panning_frames(photos[0], max(1, round(seconds * VIDEO_FPS)), (512, 384))), VIDEO_FPS)


def run_stall(cfg: StallConfig) -> dict[str, Any]:
    if not 1 <= cfg.images <= 8:
        raise ValueError(f"images must be between 1 and 8, got {cfg.images}")
    if cfg.video and cfg.event_frames:
        raise ValueError(f"video and event_frames are two kinds of prompt: give one (video={cfg.video}, "
                         f"event_frames={cfg.event_frames})")
    if not 0 <= cfg.event_frames <= MAX_FRAMES_PER_JOB:
        raise ValueError(f"event_frames must be between 0 and {MAX_FRAMES_PER_JOB}, got {cfg.event_frames}")
    photos = sample_images()
    images = (event_images(photos, cfg.event_frames) if cfg.event_frames
              else [photos[i % len(photos)] for i in range(cfg.images)])
    video = video_clip(photos, cfg.video) if cfg.video != 0 else None
    runs = {name: _run(cfg, chunked, encoder_budget, images, video)
            for name, (chunked, encoder_budget) in RUNS.items()}
    return {"config": asdict(cfg), "machine": machine(), "runs": runs}


def plot(result: dict[str, Any], path: str) -> None:
    """The chat token timeline of each run: one row of ticks per stream, the image prefill shaded."""
    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.2 * len(runs)), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        timeline = run["timeline"]
        arrival, first_token = timeline["window"]
        last = max(max(times) for times in timeline["streams"]) - arrival
        first = min(min(times) for times in timeline["streams"]) - arrival
        lead = min(0.25 * last, -first)  # some steady decoding before the image prompt arrives
        ax.axvspan(0, first_token - arrival, color="orange", alpha=0.25, label="image prefill")
        for row, times in enumerate(timeline["streams"]):
            xs = [t - arrival for t in times if t - arrival >= -lead]
            ax.plot(xs, [row] * len(xs), "|", color="tab:blue", markersize=8)
        ax.set_xlim(-lead, last * 1.02)
        ax.set_yticks(range(len(timeline["streams"])))
        itl = run["itl_ms"]
        ax.set_title(f"{name}: chat ITL in window p50 {itl['p50']:.0f} ms, max {itl['max']:.0f} ms", fontsize=9)
        ax.set_ylabel("chat")
    axes[-1, 0].set_xlabel("seconds from the image prompt's arrival")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    save_figure(fig, path)


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'run':<28}{'ITL p50':>9}{'p99':>9}{'max':>9}{'before':>8}{'after':>8}{'TTFT':>10}{'tok/s':>8}"
             f"{'steps':>7}"]
    for name, run in result["runs"].items():
        itl = run["itl_ms"]
        lines.append(
            f"{name:<28}{itl['p50']:>9.0f}{itl['p99']:>9.0f}{itl['max']:>9.0f}"
            f"{run['itl_before_window_ms']['p50']:>8.0f}{run['itl_after_window_ms']['p50']:>8.0f}"
            f"{run['ttft_ms']:>10.0f}{run['throughput_tok_s']:>8.1f}{run['steps']:>7}"
        )
    return "\n".join(lines) + ("\n(ms; ITL of the chats while the image prompt is prefilled; before and after: "
                               "ITL p50 before and after that window)")


# -- over HTTP, against any OpenAI-compatible server -------------------------------------------------------

HTTP_CHAT_TEXT = "Tell me a long story about a bus driver in a rainy city."
HTTP_IMAGE_TEXT = "Describe each person you see and what they are doing."


def _jpeg_data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def _run_http(cfg: HttpStallConfig, media: list[dict[str, Any]]) -> dict[str, Any]:
    import asyncio

    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.chats + 4)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=cfg.timeout, limits=limits) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]

        def body(content: Any, max_tokens: int) -> dict[str, Any]:
            return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                    "stream": True, "temperature": 0.0, "ignore_eos": True}

        streams: list[list[float]] = [[] for _ in range(cfg.chats)]
        began = time.perf_counter()
        chats = [asyncio.create_task(stream_chat(client, body(HTTP_CHAT_TEXT, cfg.chat_max_tokens), times))
                 for times in streams]

        async def until(condition) -> None:
            while not condition():
                ended = next((t for t in chats if t.done()), None)
                if ended is not None:
                    why = ended.exception() or ended.result() or "its stream finished; raise chat_max_tokens"
                    raise RuntimeError(f"a chat ended before the measurement did: {why}")
                await asyncio.sleep(0.005)

        await until(lambda: all(len(t) >= cfg.warmup_tokens for t in streams))
        content = [*media, {"type": "text", "text": HTTP_IMAGE_TEXT}]
        image_times: list[float] = []
        arrival = time.perf_counter()
        image = asyncio.create_task(stream_chat(client, body(content, 4), image_times))
        await until(lambda: bool(image_times) or image.done())
        if not image_times:
            raise RuntimeError(f"the image prompt gave no token: {image.result()}")
        first_token = image_times[0]
        counts = [len(t) for t in streams]
        await until(lambda: all(len(t) >= n + cfg.after_tokens for t, n in zip(streams, counts)))
        for chat in chats:
            chat.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
        if error := await image:
            raise RuntimeError(f"the image prompt failed: {error}")

    before, inside, after = [], [], []
    for times in streams:
        for prev, now in zip(times, times[1:]):
            (before if now <= arrival else inside if now <= first_token else after).append(now - prev)
    in_window = sum(1 for times in streams for t in times if arrival < t <= first_token)
    return {
        "model": model,
        "itl_ms": percentiles_ms(inside),
        "itl_outside_window_ms": percentiles_ms(before + after),
        "itl_before_window_ms": percentiles_ms(before),
        "itl_after_window_ms": percentiles_ms(after),
        "worst_gap_ms": percentiles_ms(inside)["max"],
        "ttft_ms": (first_token - arrival) * 1000.0,
        "chat_tok_s_in_window": in_window / (first_token - arrival),
        "timeline": {
            "window": [arrival - began, first_token - began],
            "streams": [[t - began for t in times] for times in streams],
        },
    }


def run_stall_http(cfg: HttpStallConfig) -> dict[str, Any]:
    """The stall scenario against a running server: `chats` streaming chats, then a prompt with `images`
    photos (or a `video` clip); the chats' gaps while it is prefilled, its time to first token, the chats'
    tokens/s meanwhile."""
    import asyncio

    if not 1 <= cfg.images <= 8:
        raise ValueError(f"images must be between 1 and 8, got {cfg.images}")
    photos = sample_images()
    if cfg.video != 0:
        clip = video_clip(photos, cfg.video)
        url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(list(clip.frames), clip.fps)).decode()
        media = [{"type": "video_url", "video_url": {"url": url}}]
    else:
        media = [{"type": "image_url", "image_url": {"url": _jpeg_data_url(photos[i % len(photos)])}}
                 for i in range(cfg.images)]
    run = asyncio.run(_run_http(cfg, media))
    return {"config": asdict(cfg), "machine": machine(), "runs": {cfg.url: run}}


def summary_http(result: dict[str, Any]) -> str:
    lines = [f"{'server':<28}{'ITL p50':>9}{'p99':>9}{'worst':>9}{'before':>8}{'after':>8}{'TTFT':>10}"
             f"{'chat tok/s':>11}"]
    for name, run in result["runs"].items():
        itl = run["itl_ms"]
        lines.append(
            f"{name:<28}{itl['p50']:>9.0f}{itl['p99']:>9.0f}{run['worst_gap_ms']:>9.0f}"
            f"{run['itl_before_window_ms']['p50']:>8.0f}{run['itl_after_window_ms']['p50']:>8.0f}"
            f"{run['ttft_ms']:>10.0f}{run['chat_tok_s_in_window']:>11.1f}"
        )
    return "\n".join(lines) + ("\n(ms; chat gaps between streamed tokens while the image prompt is prefilled; "
                               "chat tok/s: the chats' tokens in that window per second)")
