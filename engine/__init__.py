"""vlmcap's engine: continuous batching with chunked prefill over text and image tokens, a paged KV
cache, and stock transformers models with the engine's own attention. Depends on torch and
transformers only."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import EngineStats, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]
