"""The model rewritten for the CPU kernels: its Linear layers and patch embeddings become `KernelLinear` and
`KernelPatchConv` (`route_linears`: the same weights, the row counts their `rows` range says through the Linear
kernel), its Llama-style norms `KernelRMSNorm` (`route_norms`); `Norm` is one RMSNorm as the kernels apply it, found
by what a norm's forward computes (its source against transformers' LlamaRMSNorm's and Gemma3RMSNorm's);
`activation_of` names what an activation module computes."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cpu import build, ops
from engine.cpu.abi import DTYPE_CODES, NORM_GEMMA, NORM_LLAMA, NormArgs

# transformers' activation modules by what they compute (a class of either kind computes exactly that function).
ACTIVATION_CLASSES = {"silu": frozenset({"SiLU", "SiLUActivation"}),
                      "gelu_tanh": frozenset({"GELUTanh", "PytorchGELUTanh", "NewGELUActivation"})}


def activation_of(module: torch.nn.Module | None) -> str | None:
    """What activation `module` computes ("silu", "gelu_tanh"), None where it is neither."""
    name = type(module).__name__
    return next((act for act, classes in ACTIVATION_CLASSES.items() if name in classes), None)


ALL_ROWS = 1 << 30
# Rows for which `linear` is used before any measurement: every row count (bfloat16 and float16 GEMMs lack fast
# kernels on CPUs without their instructions), float32 up to 16 rows, beyond which MKL's blocking wins.
KERNEL_ROWS: dict[torch.dtype, tuple[int, int]] = {torch.float32: (1, 16), torch.bfloat16: (1, ALL_ROWS),
                                                   torch.float16: (1, ALL_ROWS)}


def route_linears(model: torch.nn.Module) -> int:
    """Make every `nn.Linear` of `model` a `KernelLinear` (its weights untouched): inputs whose row count lies in
    its `rows` range go through `linear`, the rest through F.linear as before; likewise every patch embedding
    (`nn.Conv2d` or `nn.Conv3d` whose stride is its kernel, no padding) a `KernelPatchConv` or `KernelPatchConv3d`,
    one row a patch; an int8 layer
    (engine/quantization.py `Int8Linear`) runs through the int8 kernel at every row count. Returns how many."""
    from engine.quantization import Int8Linear

    routed = 0
    for module in model.modules():
        if type(module) is Int8Linear:  # its own forward: the int8 kernel at every row count
            module.kernel = True
            routed += 1
            continue
        if type(module) is torch.nn.Linear and module.weight.dtype in KERNEL_ROWS:
            module.__class__ = KernelLinear
        elif _is_patch_conv(module):
            module.__class__ = KernelPatchConv if type(module) is torch.nn.Conv2d else KernelPatchConv3d
        else:
            continue
        ops.check_weight(module.weight.reshape(module.weight.shape[0], -1))
        bias32 = None if module.bias is None else module.bias.detach().to(torch.float32).contiguous()
        module.register_buffer("bias32", bias32, persistent=False)  # the kernel sums in float32
        module.rows = KERNEL_ROWS[module.weight.dtype]
        routed += 1
    return routed


def _is_patch_conv(module: torch.nn.Module) -> bool:
    """A patch embedding: a Conv2d, or a Conv3d in 16 bits (torch's float32 Conv3d is fast on every CPU and is what a
    float32 reference computes; its bfloat16 one had no fast path on an AVX2 CPU: 2.2 s for 7 GMAC), stride =
    kernel, no padding."""
    if type(module) is not torch.nn.Conv2d and (type(module) is not torch.nn.Conv3d
                                                or module.weight.dtype == torch.float32):
        return False
    dims = len(module.kernel_size)
    return (module.weight.dtype in KERNEL_ROWS and module.groups == 1
            and tuple(module.stride) == tuple(module.kernel_size) and tuple(module.dilation) == (1,) * dims
            and module.padding in ((0,) * dims, "valid") and module.padding_mode == "zeros"
            and module.weight.is_contiguous())


class KernelLinear(torch.nn.Linear):
    """A Linear layer whose inputs of `rows[0]` to `rows[1]` rows go through `linear`, reading the layer's own
    weight (one class for all, so that a compiled model sees the same code in every layer)."""

    bias32: torch.Tensor | None
    rows: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this some 200 times: only what the call needs (the weight was checked once).
        width = x.shape[-1]  # a wrong width goes to F.linear, which says so
        low, high = self.rows
        if (width == self.in_features and low * width <= x.numel() <= high * width and x.dtype in DTYPE_CODES
                and x.device.type == "cpu" and self.weight.dtype in DTYPE_CODES):
            if torch.compiler.is_compiling():  # an opaque operator in the graph (engine/compiled.py)
                return torch.ops.vlmcap.linear(x, self.weight, self.bias32)
            return ops.run_linear(build.load_variant(build.variant()), x, self.weight, self.bias32, None)
        return F.linear(x, self.weight, self.bias)


class _PatchRows:
    """A patch embedding (stride = kernel, no padding; 2-d or 3-d) as `linear` over the input's patches: each patch,
    flattened as the weight is ([channels, *kernel]), is a row. The same sums as the convolution, in float32."""

    bias32: torch.Tensor | None
    rows: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel_size
        dims = len(kernel)
        if (x.dim() != dims + 2 or x.shape[1] != self.in_channels or x.dtype not in DTYPE_CODES
                or x.device.type != "cpu"):
            return super().forward(x)
        batch, channels, *sizes = x.shape
        counts = [(size - k) // k + 1 for size, k in zip(sizes, kernel)]  # patches along each dimension
        count = math.prod(counts)
        if not self.rows[0] <= batch * count <= self.rows[1] or torch.compiler.is_compiling():
            return super().forward(x)
        cropped = x[(slice(None), slice(None), *(slice(0, c * k) for c, k in zip(counts, kernel)))]
        split = [size for c, k in zip(counts, kernel) for size in (c, k)]  # [c0, k0, c1, k1, ...]
        order = (0, *(2 + 2 * i for i in range(dims)), 1, *(3 + 2 * i for i in range(dims)))
        patches = (cropped.reshape(batch, channels, *split).permute(order)
                   .reshape(batch, count, channels * math.prod(kernel)))
        weight = self.weight.view(self.out_channels, -1)
        out = ops.run_linear(build.load_variant(build.variant()), patches, weight, self.bias32, None)
        return out.transpose(1, 2).reshape(batch, self.out_channels, *counts).contiguous()


class KernelPatchConv(_PatchRows, torch.nn.Conv2d):
    """An image's patch embedding (SigLIP's, CLIP's) through `linear`: `_PatchRows`."""


class KernelPatchConv3d(_PatchRows, torch.nn.Conv3d):
    """A 3-d patch embedding (Qwen2-VL's: two frames of 14 x 14 px, each input row one patch) through `linear`:
    `_PatchRows`."""


ROUTED = (KernelLinear, KernelPatchConv, KernelPatchConv3d)  # the classes `route_linears` gives layers


@dataclass
class Norm:
    """One RMSNorm as rms_norm.c applies it: `weight` [dim] as the kernel reads it (Llama's own weight; Gemma's
    `1 + weight` in float32, made once), its epsilon and flavor (NORM_LLAMA: x * scale rounded to the input's dtype,
    times the weight, rounded again; NORM_GEMMA: x * scale * weight rounded once)."""

    weight: torch.Tensor
    eps: float
    flavor: int

    def __post_init__(self) -> None:
        if self.weight.dtype not in DTYPE_CODES or self.weight.dim() != 1 or not self.weight.is_contiguous():
            raise ValueError(f"a norm's weight is a contiguous 1-d float32, bfloat16 or float16 tensor, got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")

    @property
    def args(self) -> NormArgs:
        """As the kernels read it (made on each use: a copy of the norm points at its own weight)."""
        return NormArgs(self.weight.data_ptr(), DTYPE_CODES[self.weight.dtype], self.flavor, self.eps)

    @staticmethod
    def of(module: torch.nn.Module | None) -> Norm | None:
        """`module`'s norm where its forward is LlamaRMSNorm's or Gemma's RMSNorm's code (None elsewhere)."""
        kind = type(module)
        if is_llama_norm(kind):
            return Norm(module.weight.detach(), float(module.variance_epsilon), NORM_LLAMA)
        if is_gemma_norm(kind):
            return Norm((1.0 + module.weight.detach().float()).contiguous(), float(module.eps), NORM_GEMMA)
        return None


def norm_args(norm: Norm | None) -> NormArgs:
    """`norm` as the kernels read it; None: a NULL weight, no norm."""
    return NormArgs() if norm is None else norm.args


def _norm_code(module_path: str, class_name: str) -> str | None:
    """The source of transformers' `class_name`.forward in `module_path` (None where it cannot be read)."""
    import importlib
    import inspect

    try:
        return inspect.getsource(getattr(importlib.import_module(module_path), class_name).forward)
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def _computes(kind: type, module_path: str, class_name: str) -> bool:
    """Whether class `kind` is an RMSNorm whose forward is the code of transformers' `class_name` (a copy of it in
    another model counts)."""
    import inspect

    reference = _norm_code(module_path, class_name)
    try:
        return (reference is not None and kind.__name__.endswith("RMSNorm")
                and inspect.getsource(kind.forward) == reference)
    except (OSError, TypeError):
        return False


@functools.cache
def is_llama_norm(kind: type) -> bool:
    """Whether modules of class `kind` compute LlamaRMSNorm's forward (its copies in Qwen2, Mistral, ...)."""
    return kind is KernelRMSNorm or _computes(kind, "transformers.models.llama.modeling_llama", "LlamaRMSNorm")


@functools.cache
def is_gemma_norm(kind: type) -> bool:
    """Whether modules of class `kind` compute Gemma 3's RMSNorm's forward (x * (1 + weight) in float32)."""
    return _computes(kind, "transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm")


def route_norms(model: torch.nn.Module) -> int:
    """Make every norm of `model` whose forward is LlamaRMSNorm's own code (its copies in other models, such as
    Qwen2's and Mistral's, included; anything else, such as Gemma's 1 + weight, is left alone) a
    `KernelRMSNorm`. Returns how many."""
    if build.library() is None:
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is not KernelRMSNorm and hasattr(module, "variance_epsilon") and is_llama_norm(type(module)):
            module.__class__ = KernelRMSNorm
            routed += 1
    return routed


class KernelRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm (same parameters, same arithmetic) whose CPU forward is one C call."""

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight, dtype = self.weight, hidden_states.dtype
        if (hidden_states.device.type == "cpu" and dtype is weight.dtype and dtype in DTYPE_CODES
                and not torch.compiler.is_compiling()):
            return ops.run_norm(build.load_variant(build.variant()), hidden_states, weight, self.variance_epsilon)
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = hidden_states.to(torch.float32) * torch.rsqrt(variance + self.variance_epsilon)
        return weight * normed.to(hidden_states.dtype)
