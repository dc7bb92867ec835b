"""vlmcap's engine: continuous batching with chunked prefill over text and image tokens, a paged KV
cache, and stock transformers models with the engine's own attention. It needs torch and transformers
(with their tokenizers, Pillow and NumPy); structured output needs xgrammar, video inputs OpenCV (`cv2`), the
CUDA kernel Triton, the CPU kernels a C compiler; each is imported where it is used.

`EngineConfig` is imported with the package; the rest on first use, so that `engine.config` loads without torch
(the command line reads its fields)."""

from __future__ import annotations

import importlib
from typing import Any

from engine.config import EngineConfig

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]
_LAZY = {"Engine": "engine.engine", "EngineStats": "engine.outputs", "RequestOutput": "engine.outputs",
         "SamplingParams": "engine.sampling"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
