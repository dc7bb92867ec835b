"""Makes samples/people.mp4: 12 s at 5 fps, 640x480, real photos with people (the two shipped with
ultralytics) between scenes without people, and a person lying on the ground (a person of bus.jpg turned
on their side), which the people-fall detector classes as `Fall`. Run with the project's Python:
`.venv/bin/python samples/make_sample_video.py`."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

FPS = 5
WIDTH, HEIGHT = 640, 480
SEGMENT_SECONDS = 2.0
# In order; each lasts SEGMENT_SECONDS. "bus" is the band of bus.jpg where people stand (OpenCV's HOG
# finds two of them at this size); "zidane" is letterboxed (HOG misses these close-ups at this size);
# "fallen" is one person of bus.jpg lying on the blurred street.
SEGMENTS = ("empty-blur", "bus", "empty-dark", "zidane", "fallen", "empty-blur")
PEOPLE_SEGMENTS = {"bus", "zidane", "fallen"}
FALL_SEGMENTS = {"fallen"}
BUS_ROWS = (330, 938)
# The person lying down: the second from the left in bus.jpg (the box people-fall gives them, in bus.jpg's
# pixels), with a margin of a tenth of the box on each side, turned a quarter clockwise (head to the left)
# and scaled to FALLEN_WIDTH pixels, lying FALLEN_BOTTOM_GAP pixels above the bottom edge. Checked with the
# people-fall detector: one box, class Fall, confidence about 0.75 (other crops, turns and sizes tried gave
# Normal or extra boxes as often as not; see docs/pipeline-and-queue.md, "Falls and alerts").
FALLEN_BOX = (210, 391, 347, 872)
FALLEN_WIDTH = 360
FALLEN_BOTTOM_GAP = 30


def _fit(image: np.ndarray) -> np.ndarray:
    """Scale to fit 640x480 and pad with black."""
    scale = min(WIDTH / image.shape[1], HEIGHT / image.shape[0])
    resized = cv2.resize(image, (round(image.shape[1] * scale), round(image.shape[0] * scale)),
                         interpolation=cv2.INTER_AREA)
    canvas = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    top, left = (HEIGHT - resized.shape[0]) // 2, (WIDTH - resized.shape[1]) // 2
    canvas[top:top + resized.shape[0], left:left + resized.shape[1]] = resized
    return canvas


def lying_person(bus: np.ndarray, background: np.ndarray) -> np.ndarray:
    """`background` with the person of FALLEN_BOX lying on it, centred near the bottom."""
    x1, y1, x2, y2 = FALLEN_BOX
    mx, my = (x2 - x1) // 10, (y2 - y1) // 10
    person = cv2.rotate(bus[max(0, y1 - my):y2 + my, max(0, x1 - mx):x2 + mx], cv2.ROTATE_90_CLOCKWISE)
    height = round(person.shape[0] * FALLEN_WIDTH / person.shape[1])
    person = cv2.resize(person, (FALLEN_WIDTH, height), interpolation=cv2.INTER_AREA)
    scene = background.copy()
    top, left = HEIGHT - height - FALLEN_BOTTOM_GAP, (WIDTH - FALLEN_WIDTH) // 2
    scene[top:top + height, left:left + FALLEN_WIDTH] = person
    return scene


def scenes() -> dict[str, np.ndarray]:
    from ultralytics.utils import ASSETS

    bus = cv2.imread(str(ASSETS / "bus.jpg"))
    zidane = cv2.imread(str(ASSETS / "zidane.jpg"))
    bus_band = cv2.resize(bus[BUS_ROWS[0]:BUS_ROWS[1]], (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA)
    # A street so blurred that no person shape is left, and a dark noisy scene like a camera at night.
    blurred = cv2.GaussianBlur(bus_band, (0, 0), 60)
    dark = np.random.default_rng(0).integers(10, 40, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    return {"empty-blur": blurred, "bus": bus_band, "empty-dark": dark, "zidane": _fit(zidane),
            "fallen": lying_person(bus, blurred)}


# A second video (the tests make it): two people of bus.jpg cross the street in opposite directions, one in
# the upper band walking right (WALKER), one in the lower band walking left (FALLER), who then lies on the
# ground in the middle; empty street before and after. Times in seconds at FPS.
WALKER_BOX = (46, 384, 216, 907)  # in bus.jpg's pixels, the person at the left
FALLER_BOX = FALLEN_BOX
PERSON_HEIGHT = 200
CROSSING = {"empty_before": 0.6, "crossing": 4.0, "lying": 2.0, "empty_after": 1.4}
WALKER_X = (20, 540)  # left edge of the walker's cut-out at the start and the end of the crossing
FALLER_X = (540, 300)
WALKER_TOP, FALLER_TOP = 20, 260


def _person(bus: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x1, y1, x2, y2 = box
    mx, my = (x2 - x1) // 10, (y2 - y1) // 10
    cut = bus[max(0, y1 - my):y2 + my, max(0, x1 - mx):x2 + mx]
    return cv2.resize(cut, (round(cut.shape[1] * PERSON_HEIGHT / cut.shape[0]), PERSON_HEIGHT),
                      interpolation=cv2.INTER_AREA)


def crossing_frames() -> list[tuple[float, np.ndarray, dict[str, tuple[int, int]]]]:
    """The second video's frames: (time, image, {person: (left, top) of their cut-out}) for "walker",
    "faller" (standing) and "lying"."""
    from ultralytics.utils import ASSETS

    bus = cv2.imread(str(ASSETS / "bus.jpg"))
    street = scenes()["empty-blur"]
    walker, faller = _person(bus, WALKER_BOX), _person(bus, FALLER_BOX)
    lying = lying_person(bus, street)
    counts = {name: round(seconds * FPS) for name, seconds in CROSSING.items()}
    frames = []
    for _ in range(counts["empty_before"]):
        frames.append((street, {}))
    steps = counts["crossing"]
    for step in range(steps):
        image = street.copy()
        at = {}
        for name, cut, (x0, x1), top in (("walker", walker, WALKER_X, WALKER_TOP),
                                         ("faller", faller, FALLER_X, FALLER_TOP)):
            left = round(x0 + (x1 - x0) * step / (steps - 1))
            image[top:top + cut.shape[0], left:left + cut.shape[1]] = cut
            at[name] = (left, top)
        frames.append((image, at))
    for _ in range(counts["lying"]):
        frames.append((lying, {"lying": (0, 0)}))
    for _ in range(counts["empty_after"]):
        frames.append((street, {}))
    return [(index / FPS, image, at) for index, (image, at) in enumerate(frames)]


def write_crossing_video(out: Path) -> Path:
    """The second video as an mp4 at `out`."""
    frames = crossing_frames()
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (WIDTH, HEIGHT))
    if not writer.isOpened():
        raise RuntimeError(f"cannot write {out}")
    for _, image, _ in frames:
        writer.write(image)
    writer.release()
    return out


def segment_at(ts: float) -> str:
    return SEGMENTS[min(len(SEGMENTS) - 1, int(ts // SEGMENT_SECONDS))]


def main(out: Path = Path(__file__).with_name("people.mp4")) -> None:
    images = scenes()
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (WIDTH, HEIGHT))
    if not writer.isOpened():
        raise RuntimeError(f"cannot write {out}")
    frames_per_segment = round(SEGMENT_SECONDS * FPS)
    for name in SEGMENTS:
        for _ in range(frames_per_segment):
            writer.write(images[name])
    writer.release()
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB, {len(SEGMENTS) * frames_per_segment} frames)")


if __name__ == "__main__":
    main()
