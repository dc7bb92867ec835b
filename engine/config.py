"""Engine configuration: one dataclass, validated once. It imports neither torch nor the rest of the engine, so
that the command line builds `vlmcap serve`'s options from its fields (cli/declared.py) without loading torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.grammar_limits import GrammarLimits

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "kernel", "cpu", "reference")
DTYPES = ("float32", "bfloat16", "float16")  # torch's names of the dtypes the engine runs in
KV_CACHE_DTYPES = ("auto", "int8")  # what the KV cache stores ("auto": the model's dtype)
QUANTIZATIONS = ("int8",)  # what `quantization` takes besides None


@dataclass
class EngineConfig:
    """How the engine loads its model and schedules work. Each field's `help` (its metadata) is written beside it;
    the help's first sentence is its option's help in `vlmcap serve --help` (cli/declared.py reads them), and
    docs/configuration.md lists them all."""

    model: str = field(default="tiny", metadata={"help": (
        "the model to load. A local Hugging Face checkpoint directory, a hub id, `tiny` / `tiny-<family>` (small "
        "random offline models: `tiny-qwen2-vl`, `tiny-qwen2.5-vl`, `tiny-llava`, `tiny-llava-onevision`) or "
        "`dummy:<preset>` (a real architecture at real size with random weights).")})
    chat_template: str | None = field(default=None, metadata={"help": (
        "a Jinja chat template file for chat requests, over the checkpoint's own (`None`: the processor's template, "
        "else the tokenizer's; a checkpoint with neither serves prompts only, and answers chat requests with a "
        "ValueError that names this option).")})
    device: str = field(default="cpu", metadata={"help": (
        "the torch device (cpu, cuda, cuda:1, ...).")})
    dtype: str = field(default="float32", metadata={"help": (
        "the weights' and KV cache's dtype (float32, bfloat16 or float16).")})
    quantization: str | None = field(default=None, metadata={"help": (
        "quantize the weights at load: `int8` (per output channel, symmetric, from the checkpoint's float weights; "
        "nothing written to disk). Every Linear layer of the text model, the output head (its own copy where it is "
        "tied to the embeddings, which stay float) and the vision tower and its connector keep int8 weights and a "
        "float32 scale a row, their float weights dropped; activations are quantized per token at each call and "
        "multiplied in int32 by the CPU's C kernels (engine/quantization.py). Where those do not run (no C "
        "compiler, `cpu_linear` off, a GPU) a PyTorch path computes the same numbers, much slower. A checkpoint "
        "quantized already (compressed-tensors W8A8, as vLLM loads) is loaded as it is, whatever this says. `None`: "
        "the checkpoint's weights as they are, in `dtype`.")})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": (
        "the step budget, in tokens (decode tokens plus prefill chunk tokens).")})
    max_num_seqs: int = field(default=64, metadata={"help": (
        "the most requests that run (hold KV blocks) at once.")})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": (
        "split prompts into chunks that fit the step budget. Off, a prompt is prefilled whole in one step however "
        "long it is (for comparison).")})
    max_encoder_tokens_per_step: int | None = field(default=128, metadata={"help": (
        "the encoder budget of one step, in the encoder's output tokens. Those are the image placeholders it fills "
        "(64 a SmolVLM-256M tile, one per 2x2 patch group of a Qwen2-VL image), so that the budget follows the "
        "encoder's cost in any family. Encoder inputs (a tile for SmolVLM, an image for Qwen2-VL and LLaVA, whose "
        "towers attend across a whole image) run whole or not at all; one runs each step even if it alone is over "
        "the budget. `None`: every input a chunk needs runs in the step that needs it.")})
    encoder_slices_per_step: int | None = field(default=None, metadata={"help": (
        "slices of an encoder input's vision tower run a step (`None`: the whole tower). A tower run over several "
        "steps never costs a step much more than a decode (every family: SmolVLM, Gemma 3, LLaVA and "
        "LLaVA-OneVision, where a slice is one of five of a SigLIP or CLIP layer: its QKV projections, half its "
        "heads' attention, the other half with the output projection, the MLP's first or its second linear layer; "
        "Qwen2-VL and Qwen2.5-VL, where it is one of five like parts of a block, with a transformers that has "
        "`vision_utils`, else its tower runs whole). What a step leaves of the encoder budget starts the next "
        "input's tower before the chunk reaches it.")})
    itl_target_ms: float | None = field(default=None, metadata={"help": (
        "the inter-token latency a step should stay within: the scheduler fills each step with prefill chunks and "
        "vision-tower slices only as far as the step's predicted time (engine/step_costs.py: fitted at start-up on "
        "a few steps, kept up to date from every step's time) stays within it, so that running chats stay smooth "
        "while image prompts are prefilled, on any machine, with no tuning; the token and encoder budgets stay "
        "upper bounds. `None`: the device's default (250 ms on a CPU, 60 ms on CUDA), and where the running decodes "
        "alone take most of it (a large model on a small machine) a prompt still gets as much of each step as they "
        "take, so that chats' gaps at most double (engine/scheduler.py); 0: steps budgeted by tokens only.")})
    block_size: int = field(default=16, metadata={"help": (
        "tokens per KV cache block.")})
    num_kv_blocks: int | None = field(default=None, metadata={"help": (
        "the KV cache's size in blocks (`None`: from free memory). `None` sizes it from `kv_cache_memory_fraction` "
        "of the device memory that is free after the model is loaded (capped at what `max_num_seqs` requests of "
        "`max_model_len` tokens can use).")})
    kv_cache_memory_fraction: float = field(default=0.5, metadata={"help": (
        "the share of free device memory the KV cache takes when `num_kv_blocks` is None.")})
    kv_cache_dtype: str = field(default="auto", metadata={"help": (
        "what the KV cache stores: auto or int8. `auto` stores the model's dtype; `int8` stores each token's keys "
        "and values per KV head as int8 with a float32 scale (symmetric, the least power of two >= max |x| / 127; "
        "engine/kv_cache.py), about half a bfloat16 cache's bytes, so about twice the blocks in the same memory. "
        "Attention reads them back in place, exactly values of the model's dtype (the CPU's decode kernel and the "
        "fused decode step).")})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "prompt plus output tokens of one request (`None`: the model's own limit).")})
    watermark: float = field(default=0.01, metadata={"help": (
        "the share of KV blocks kept free when a request is admitted (so it is not preempted at once).")})
    seed: int = field(default=0, metadata={"help": (
        "the seed of torch's default generator (requests with a seed of their own use their own).")})
    num_threads: int | None = field(default=None, metadata={"help": (
        "torch's CPU threads (`None`: torch's choice).")})
    attention_backend: str = field(default="auto", metadata={"help": (
        "how attention reads the paged KV cache: auto, kernel, cpu or reference. `kernel` reads the cache in place "
        "with one Triton launch per layer (CUDA, bfloat16 or float16, a block size that is a power of two of at "
        "least 16); `cpu` reads the cache in place for every decode with a small C kernel built at first use (the "
        "CPU, with a C compiler), and prefill chunks through SDPA reading the cache in place; `reference` gathers "
        "each context's blocks and runs SDPA (any device and dtype: the exactness reference); `auto` takes the "
        "kernel where it runs, else `cpu` where it runs, else `reference`.")})
    cuda_graphs: bool | None = field(default=None, metadata={"help": (
        "replay decode-only steps from CUDA graphs captured at start-up (`None`: where the kernel runs on CUDA). "
        "Graphs are captured at padded batch sizes (1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`); they "
        "need the kernel backend.")})
    cpu_linear: bool | None = field(default=None, metadata={"help": (
        "on the CPU, run Linear layers and RMSNorms through the engine's C kernels (`None`: where they build). The "
        "Linear kernel reads each weight where the model holds it, in its own dtype (engine/cpu/; the row "
        "counts where it beats torch's GEMM, measured at start-up; vision towers' patch embeddings too, as rows of "
        "patches), and Llama-style RMSNorms run in one call instead of seven operators.")})
    cpu_kernels: str | None = field(default=None, metadata={"help": (
        "the C kernels' build: amx_bf16, avx512_bf16, avx512, avx2 or generic (`None`: the best this CPU's flags "
        "allow). One library serves the whole process; a build this CPU cannot run is refused.")})
    compile_model: bool = field(default=False, metadata={"help": (
        "compile the text model's decoder layers with torch.compile at start-up (the CPU). On the CPU per-operator "
        "overhead is a large part of a decode step (engine/compiled.py; needs a C compiler for inductor's kernels). "
        "Start-up takes longer by the compile time, which `stats().compile_seconds` reports.")})
    lean_layers: bool | None = field(default=None, metadata={"help": (
        "on the CPU, run Llama-style and Gemma 3 decoder layers as a few C calls (`None`: where the layers fit). A "
        "stock layer's some 60 small operators a step become fused projections, RoPE with the KV write, and norms "
        "with the residual adds (engine/lean_layers.py); `True` refuses a model with no such layer. A sliced SigLIP "
        "tower's encoder layers run fused likewise (engine/lean_vision.py: q/k/v as one product, bias and residual "
        "add in oneDNN's epilogue, GELU in C).")})
    cpu_linear_rows: int | None = field(default=None, metadata={"help": (
        "the most rows a Linear goes through the CPU kernel for (`None`: measured per weight shape at start-up "
        "against torch's GEMM; 0: none).")})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "reuse the KV blocks of a prompt's prefix computed for an earlier request. Computed blocks stay findable by "
        "a hash of their tokens and images, so a request whose prompt starts like an earlier one (a chat's next "
        "turn, a camera's fixed prompt) skips that prefix; and recent vision features are kept by image content, so "
        "an image sent again is not encoded again.")})
    encoder_cache_tokens: int = field(default=4096, metadata={"help": (
        "vision features kept for images sent again, in the encoder's output tokens (0: none).")})
    jump_forward: bool = field(default=False, metadata={"help": (
        "append the tokens a request's structured-output grammar forces without sampling them (jump-forward). A "
        "forced token is the only one its mask allows (a key, punctuation, an enum's tail); a run of them is "
        "computed with the next step's chunk, one forward for the run instead of one step a token. The output is the "
        "same token for token as without (seeded sampling's random stream is drawn as if each had been sampled); "
        "requests that ask for logprobs decode every token. Off by default: a step that carries such a run is not a "
        "decode-only step, and on the CPU it leaves the fused decode path, which costs more than the steps saved "
        "(`vlmcap bench grammar`: structured, jump-forward on / off).")})
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits, metadata={"help": (
        "what one grammar (structured output) may ask for, its compile deadline, the compiler's child processes and "
        "the compiled-grammar cache's size (engine/grammar_limits.py).")})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_chunked_prefill and self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running decode needs a token of each step's budget"
            )
        if not isinstance(self.encoder_cache_tokens, int) or self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be a non-negative integer, got {self.encoder_cache_tokens!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")
        if self.max_encoder_tokens_per_step is not None and self.max_encoder_tokens_per_step < 1:
            raise ValueError(
                f"max_encoder_tokens_per_step must be positive or None, got {self.max_encoder_tokens_per_step!r}"
            )
        if self.encoder_slices_per_step is not None and self.encoder_slices_per_step < 1:
            raise ValueError(f"encoder_slices_per_step must be positive or None, got {self.encoder_slices_per_step!r}")
        if self.itl_target_ms is not None and not (math.isfinite(self.itl_target_ms) and self.itl_target_ms >= 0):
            raise ValueError(f"itl_target_ms must be a non-negative number of milliseconds or None, got "
                             f"{self.itl_target_ms!r}")
        if self.cpu_linear_rows is not None and (not isinstance(self.cpu_linear_rows, int) or self.cpu_linear_rows < 0):
            raise ValueError(f"cpu_linear_rows must be a non-negative integer or None, got {self.cpu_linear_rows!r}")
        if self.cpu_kernels is not None:
            from engine.cpu.build import VARIANTS  # the builds' table, with torch: only when a build is named

            if self.cpu_kernels not in VARIANTS:
                raise ValueError(f"cpu_kernels must be one of {list(VARIANTS)} or None, got {self.cpu_kernels!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
