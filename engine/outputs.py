"""What the engine reports: each request that advanced in a step (`Engine.step`), where a step's time went,
and the engine's counters (`Engine.stats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # every token generated so far
    text: str  # their text, without any stop string and without a tail that may still become one
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "abort", "error" (the step failed)
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed again
    # The prompt's token ids (the request's own list, not a copy: read it, never change it); empty where not given.
    prompt_token_ids: list[int] = field(default_factory=list)
    # Log-probabilities of the tokens new in this output (`SamplingParams.logprobs`; None when not asked for):
    # a request's are the concatenation over its outputs.
    new_logprobs: list[TokenLogprobs] | None = None
    # With `add_request(embed_images=True)`, on the finished output: each encoder input's features mean-pooled and
    # L2-normalised (engine/embeddings.py `pooled`), in the prompt's order; None for an input this request did not
    # encode (its span was found in the prefix cache). An image that is one encoder input gets `Engine.embed`'s
    # vector (to float32 rounding).
    image_embeddings: list[list[float] | None] | None = None
    # The prompt's token scores (`SamplingParams.prompt_logprobs`), None first (the first token has no context), in
    # the output that carries the first generated token; None in the others and when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class StepTimings:
    """Seconds of host time in each phase of one step. On CUDA the forward is asynchronous: its time shows
    where sampling's one read-back waits for it."""

    schedule: float = 0.0
    encode: float = 0.0  # the vision tower
    prepare: float = 0.0  # the step's inputs and attention metadata
    forward: float = 0.0  # the text model (launches, on CUDA)
    sample: float = 0.0
    update: float = 0.0  # the scheduler's bookkeeping, stop conditions and detokenizing

    @property
    def total(self) -> float:
        return self.schedule + self.encode + self.prepare + self.forward + self.sample + self.update


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters since it started. Fields can also be read by name
    (`stats["kv_blocks_used"]`) and as a dict (`as_dict`, for JSON)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    last_step_num_tokens: int  # tokens (decodes plus prefill chunks) of the last step
    max_num_batched_tokens: int
    encoder_inputs_encoded: int  # encoder inputs whose vision tower ran to the end
    encoder_slices_run: int  # slices of the tower run (a whole tower counts all of its slices)
    encoder_seconds: float
    num_steps: int
    num_generated_tokens: int
    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hit_tokens: int  # of those, found computed
    prefix_cache_blocks: int  # blocks held for reuse (computed, not in use)
    encoder_cache_hits: int  # encoder inputs whose features were found by content, not encoded again
    num_step_failures: int  # steps whose forward raised (their requests ended with "error")
    num_request_failures: int  # requests ended alone because their token could not be sampled
    compile_seconds: float = 0.0  # start-up time spent compiling the model (`EngineConfig.compile_model`)
    cpu_kernels: str | None = None  # the CPU kernels' build (engine/cpu/build.py VARIANTS); None: not used
    # How that build's Linear multiplies bfloat16: "dot" (vdpbf16ps) or "widen" (float32 FMAs), measured at start-up.
    cpu_bf16_products: str | None = None
    lean_layers: int = 0  # decoder layers run by engine/lean_layers.py
    lean_vision_layers: int = 0  # vision encoder layers run by engine/lean_vision.py
    # The rows [first, last] a Linear shape ("n x k dtype") goes through the CPU kernel for, measured at start-up.
    linear_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The step cost model (engine/step_costs.py) behind the inter-token-latency target; empty when not fitted.
    step_costs: dict[str, float | None] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_queried_tokens, 1)

    def __getitem__(self, name: str) -> Any:
        if name not in self.__dataclass_fields__ and name != "prefix_cache_hit_rate":
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
