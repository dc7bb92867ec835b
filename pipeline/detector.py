"""Person detectors: Ultralytics YOLO (person class only) and OpenCV's built-in HOG people detector,
which needs no download. Both return `Detection`s in full-frame pixels, filtered by a minimum box area."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.contract import Detection

log = logging.getLogger(__name__)

DEFAULT_YOLO_WEIGHTS = "yolo26n.pt"
PERSON_CLASS = 0  # COCO's "person", the first class of every ultralytics detection model


class DetectorUnavailable(RuntimeError):
    """The requested detector cannot be loaded (weights neither on disk nor downloadable)."""


class PersonDetector(Protocol):
    name: str

    def detect(self, frame: np.ndarray) -> list[Detection]:
        """Person boxes in one BGR frame, without track ids."""
        ...


def _keep_large(detections: list[Detection], min_box_area: float) -> list[Detection]:
    return [d for d in detections if d.area >= min_box_area]


class HogDetector:
    """OpenCV's HOG + linear SVM people detector (opencv-python 4.x). It finds upright people of at
    least its 64x128 window; close-ups and small figures can be missed."""

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
            Detection(float(x), float(y), float(x + w), float(y + h), float(score))
            for (x, y, w, h), score in zip(rects, np.ravel(weights), strict=True)
        ]
        return _keep_large(detections, self.min_box_area)


class YoloDetector:
    """An ultralytics detection model restricted to the person class. `track()` uses ultralytics'
    own ByteTrack through `model.track(persist=True)` when its `lap` dependency is installed."""

    def __init__(self, weights: str, conf: float = 0.25, imgsz: int = 640, min_box_area: float = 0.0) -> None:
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
        self.name = f"yolo:{Path(weights).name}"
        self.conf = conf
        self.imgsz = imgsz
        self.min_box_area = min_box_area
        self.can_track = importlib.util.find_spec("lap") is not None

    def _options(self) -> dict:
        return {"classes": [PERSON_CLASS], "conf": self.conf, "imgsz": self.imgsz, "verbose": False}

    def _to_detections(self, result) -> list[Detection]:
        boxes = result.boxes
        ids = boxes.id.int().tolist() if boxes.id is not None else [None] * len(boxes)
        detections = [
            Detection(*map(float, xyxy), float(score), track_id)
            for xyxy, score, track_id in zip(boxes.xyxy.tolist(), boxes.conf.tolist(), ids, strict=True)
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


def load_detector(
    spec: str | None, conf: float = 0.25, imgsz: int = 640, min_box_area: float = 0.0
) -> PersonDetector:
    """`spec` is "hog", a path to ultralytics weights, or None for the default (YOLO `yolo26n.pt`,
    falling back to HOG with a warning when those weights cannot be had). A detector named
    explicitly that cannot be loaded raises DetectorUnavailable."""
    if spec is not None and spec.strip().lower() == "hog":
        return HogDetector(min_box_area)
    try:
        return YoloDetector(spec or DEFAULT_YOLO_WEIGHTS, conf, imgsz, min_box_area)
    except DetectorUnavailable as err:
        if spec is not None:
            raise
        log.warning("YOLO weights %s unavailable (no network and no local file); falling back to the "
                    "HOG people detector (%s)", DEFAULT_YOLO_WEIGHTS, str(err).splitlines()[0])
        return HogDetector(min_box_area)
