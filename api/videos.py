"""Videos from clients, checked before they reach the engine: a `video_url` part's data URL
(`data:video/mp4;base64,...`) or http(s) URL (fetched under the same policy as remote images: off unless
enabled, allowlisted hosts, public addresses only, size and time limits), decoded with OpenCV off the event
loop. Frames are sampled as the server's limits and the request's `video_options` say; a file whose
duration or frame size is over a limit is refused from its header, before any frame is decoded, and only the
sampled frames are kept (engine/video.py), so a video's frames in memory stay under
max_video_frames x max_video_frame_pixels x 3 bytes."""

from __future__ import annotations

import io

from api.errors import APIError
from api.images import Media, data_url_bytes, fetch_remote
from api.pools import work_pools
from api.settings import Limits
from engine import Engine
from engine.media_box import MediaBusy, MediaLimitError
from engine.video import Video, VideoSampling, read_video


def check_video_input(engine: Engine, param: str) -> None:
    """A model without a video path refuses a video before it is fetched or decoded (400 naming the model)."""
    if not engine.takes_videos:
        raise APIError(400, f"{param}: the model ({engine.model_family}) has no video input; send the frames as "
                            "images instead", param, "unsupported_video")


def video_media(limits: Limits) -> Media:
    return Media("video", limits.max_video_bytes)


def video_sampling(limits: Limits, num_frames: int | None, fps: float | None, param: str) -> VideoSampling:
    """The frames to take from each video of a request: its `video_options` within the server's limits."""
    if num_frames is not None and num_frames > limits.max_video_frames:
        raise APIError(400, f"{param}.num_frames is {num_frames}, over this server's max_video_frames of "
                            f"{limits.max_video_frames}", f"{param}.num_frames", "too_many_video_frames")
    return VideoSampling(
        num_frames=num_frames or limits.video_frames,
        fps=fps if fps is not None else (None if num_frames is not None else limits.video_fps),
        max_frames=limits.max_video_frames,
        max_seconds=limits.max_video_seconds,
        max_frame_pixels=limits.max_video_frame_pixels,
    )


def decode_video(data: bytes, sampling: VideoSampling, limits: Limits, param: str) -> Video:
    """The sampled frames of an encoded video, or an APIError: 413 over a byte, duration or pixel limit
    (naming it), 400 for bytes that are not a readable video."""
    if len(data) > limits.max_video_bytes:
        raise APIError(413, f"{param}: the video has {len(data)} bytes, over the max_video_bytes limit of "
                            f"{limits.max_video_bytes}", param, "video_too_large")
    try:
        return read_video(io.BytesIO(data), sampling, param)
    except MediaBusy as exc:
        raise APIError(503, f"{exc}; retry later", param, "busy", exc.retry_after_s) from None
    except MediaLimitError as exc:  # a limit of the request's sampling, or of the media box (deadline, memory)
        raise APIError(413, f"{exc} ({exc.limit})" if f"({exc.limit})" not in str(exc) else str(exc), param,
                       "video_too_large") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param, "invalid_video") from None


async def load_video_url(url: str, sampling: VideoSampling, limits: Limits, param: str) -> Video:
    """A `video_url` from a chat message: a data URL, or an http(s) URL when the remote policy allows it."""
    media = video_media(limits)
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{param}: the video URL must be a non-empty string", param, media.url_code)
    if url.startswith("data:"):
        data = await work_pools(limits).run("decode", data_url_bytes, url, limits, param, media)
    else:
        data = await fetch_remote(url, limits, param, media)
    return await work_pools(limits).run("decode", decode_video, data, sampling, limits, param)
