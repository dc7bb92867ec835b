"""Shared helpers of the benchmarks: the machine's description, JSON and PNG output, the sample photos, a
streamed chat's arrival times. It
imports neither torch nor the engine (`bench serve`, an HTTP load generator, runs without them): `machine()`
imports torch only when asked for torch's part. Percentiles are `api.percentiles`'s."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any


def machine(with_torch: bool = True) -> dict[str, Any]:
    """When and where a benchmark ran; `with_torch`: also torch's version, threads and GPU (imports torch)."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    if with_torch:
        import torch

        info.update(torch_threads=torch.get_num_threads(), torch=torch.__version__)
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds the listening TCP socket on `port`: a server a benchmark started on a port it
    picked beforehand (`free_tcp_port`) may have lost that port to another process in between, whose answers
    would then pass for its own."""
    import psutil

    try:
        return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.Process(pid).net_connections("tcp"))
    except psutil.Error:
        return False


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")


def pyplot():
    """matplotlib's pyplot on a backend that needs no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def save(
    result: dict[str, Any], json_path: str | None, png_path: str | None, plot: Callable[[dict[str, Any], str], None]
) -> None:
    """Write a benchmark's result as JSON and draw its figure, where asked."""
    if json_path:
        write_json(json_path, result)
    if png_path:
        Path(png_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, png_path)


def prefix_caching_option(enabled: bool | None) -> dict[str, bool]:
    """EngineConfig's keyword for a benchmark's `--prefix-caching/--no-prefix-caching`: none when not given, so
    that the engine's default holds."""
    return {} if enabled is None else {"enable_prefix_caching": enabled}


def photo_paths() -> list[Path]:
    """bus.jpg and zidane.jpg, real photos with people: from the folder `VLMCAP_PHOTOS` names (for a machine
    without ultralytics, such as a lent GPU machine), else from the ultralytics wheel, found without
    importing it (its import patches PIL.Image.open)."""
    import importlib.util

    folder = os.environ.get("VLMCAP_PHOTOS")
    if folder:
        assets = Path(folder)
    else:
        assets = Path(importlib.util.find_spec("ultralytics").submodule_search_locations[0]) / "assets"
    return [assets / name for name in ("bus.jpg", "zidane.jpg")]


def sample_images() -> list:
    """The photos of `photo_paths`, decoded."""
    from PIL import Image

    return [Image.open(path).convert("RGB") for path in photo_paths()]


def panning_frames(photo: Any, count: int, size: tuple[int, int]) -> list:
    """RGB frames (arrays) of a camera panning across `photo`: square crops a little further right each frame,
    resized to `size` (width, height); a clip for benchmarks and tests of video input."""
    import cv2
    import numpy as np

    image = np.asarray(photo)
    height, width = image.shape[:2]
    side = min(height, width) * 3 // 4
    steps = np.linspace(0, width - side, count).astype(int)
    return [cv2.resize(image[:side, x : x + side], size, interpolation=cv2.INTER_AREA) for x in steps]


def mp4_bytes(frames: list, fps: float) -> bytes:
    """RGB frames (arrays of one size) encoded as an MP4 (OpenCV's VideoWriter, mp4v)."""
    import tempfile

    import cv2

    height, width = frames[0].shape[:2]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        return path.read_bytes()


LINE_END = re.compile(r"\r\n|\r|\n")  # where server-sent events and NDJSON end a line, and only there


async def stream_lines(response: Any) -> AsyncIterator[str]:
    """The lines of a streamed httpx response (server-sent events, NDJSON), split at CR, LF and CRLF only. httpx's
    `aiter_lines` splits as str.splitlines does, at NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR too, which a
    server may leave as they are inside its JSON strings (a model can write any of them): a peer's event would
    be cut."""
    pending = ""
    async for text in response.aiter_text():
        text = pending + text
        held = text.endswith("\r")  # a CR that may be a CRLF's first half: held back for the next chunk
        *lines, pending = LINE_END.split(text[:-1] if held else text)
        pending += "\r" if held else ""
        for line in lines:
            yield line
    *lines, last = LINE_END.split(pending)
    for line in lines + ([last] if last else []):
        yield line


async def stream_chat(client: Any, body: dict[str, Any], times: list[float]) -> str | None:
    """Stream one chat completion, appending the arrival time of every chunk that carries text. Returns an
    error message, or None when the stream ended (a chat is cancelled once the measurement is over)."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
        async for line in stream_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return None
