"""int8 weights (`--quantization int8`): the numeric rule, written once, that the CPU kernels
(engine/csrc/linear_int8.c) and the test-only PyTorch reference below both follow, bit for bit.

- Weights, per output channel, symmetric, at load: scale[c] = max|W[c]| / 127 (1.0 for an all-zero row),
  q[c] = round(W[c] / scale[c]) clamped to [-127, 127] (round half to even); kept as `Int8Weight`: q int8 [n, k]
  row-major, scale float32 [n], row_sums int32 [n] = q.sum(1) (the kernels' compensation for their unsigned
  offset of x, computed once here, never per call).
- Activations, per row of x (per token), symmetric, at every call: s = max|x| / 127 (1.0 for an all-zero row),
  qx = round(x / s) clamped to [-127, 127] (a division, not a product by a reciprocal; half to even).
- Product: acc = qx q^T summed exactly in int32; y = float32(acc) * (s * scale[c]) (that product in float32
  first), + bias[c] (float32); then the float `linear`'s epilogue: rounded to x's dtype, or in glu mode gate and
  up rounded to it, act(gate) in float32 rounded, times up, rounded.

The kernel call: `engine.cpu.ops.linear(x, weight, bias=None, glu=None, out=None)` with `weight` an `Int8Weight`
(x float32, bfloat16 or float16 [..., k]; the result in x's dtype), the same call as for a float weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 127  # the largest int8 magnitude used: symmetric, so -128 never occurs


@dataclass(frozen=True)
class Int8Weight:
    """One Linear's weight quantized per output channel: `qweight` int8 [n, k] (contiguous), `scale` float32 [n],
    `row_sums` int32 [n] (each row's sum of `qweight`)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    row_sums: torch.Tensor

    def __post_init__(self) -> None:
        q, scale, sums = self.qweight, self.scale, self.row_sums
        if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
            raise ValueError(f"an int8 weight is a contiguous 2-d int8 tensor, got {q.dtype} {tuple(q.shape)} "
                             f"(contiguous: {q.is_contiguous()})")
        for name, tensor, dtype in (("scale", scale, torch.float32), ("row_sums", sums, torch.int32)):
            if tensor.dtype != dtype or tensor.shape != (q.shape[0],) or not tensor.is_contiguous():
                raise ValueError(f"an int8 weight's {name} is a contiguous {dtype} [{q.shape[0]}], got "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")

    @property
    def shape(self) -> torch.Size:
        """[n, k], as a float weight's."""
        return self.qweight.shape

    @classmethod
    def of(cls, qweight: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        """A pre-quantized weight (q int8 [n, k], scale [n] or [n, 1]) with its row sums computed."""
        q = qweight.contiguous()
        return cls(q, scale.reshape(-1).float().contiguous(), q.sum(1, dtype=torch.int32))


def _symmetric(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `rows` [r, k] quantized symmetrically: (int8 [r, k], float32 scales [r])."""
    x32 = rows.float()
    amax = x32.abs().amax(dim=1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX)
    q = torch.round(x32 / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """A float weight [n, k] quantized per output channel (the rule above)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight takes a 2-d float weight, got {weight.dtype} {tuple(weight.shape)}")
    q, scale = _symmetric(weight)
    return Int8Weight(q.contiguous(), scale.contiguous(), q.sum(1, dtype=torch.int32))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] quantized per row as the kernels do at every call: (qx int8 [m, k], s float32 [m])."""
    return _symmetric(x.reshape(-1, x.shape[-1]))


def reference_linear_int8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                          glu: str | None = None) -> torch.Tensor:
    """The int8 `linear` in plain PyTorch (test-only): [..., k] -> [..., n] (glu "silu" / "gelu_tanh":
    [..., n / 2]), in x's dtype, the kernels' bits (the rule above; the activations as linear.c computes them)."""
    qx, s = quantize_activations(x)
    acc = qx.double() @ weight.qweight.double().T  # exact: |acc| <= 127^2 k < 2^53
    y = acc.float() * (s[:, None] * weight.scale[None, :])
    if bias is not None:
        y = y + bias.float()
    dtype = x.dtype
    if glu is None:
        return y.to(dtype).reshape(*x.shape[:-1], -1)
    half = y.shape[1] // 2
    gate, up = (part.to(dtype).float() for part in (y[:, :half], y[:, half:]))
    if glu == "silu":
        act = gate / (1.0 + torch.exp(-gate))
    elif glu == "gelu_tanh":  # 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate / (1.0 + torch.exp(-2.0 * 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        raise ValueError(f"glu is 'silu' or 'gelu_tanh', got {glu!r}")
    out = act.to(dtype).float() * up
    return out.to(dtype).reshape(*x.shape[:-1], half)


# -- int8 weights in the model (the engine's wiring of the rule above) ---------------------------------------------


class Int8Linear(torch.nn.Module):
    """A Linear layer whose weight is an `Int8Weight` (its float weight dropped): x [..., k] -> [..., n] in x's
    dtype by the rule above. Through the CPU's C kernel where routing made it so (`kernel`, set by
    `engine.cpu.routing.route_linears`), else through `reference_linear_int8`, which gives the same numbers on any
    device. `weight` and `bias32` are plain attributes, not parameters or buffers: a dtype cast of the model must
    not touch the int8 values or their float32 scales."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.dtype = dtype  # the float dtype of the weight it was quantized from, the dtype it computes in
        self.kernel = False

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> Int8Linear:
        """`linear` quantized (the rule above); its own weight is not kept."""
        weight = linear.weight.detach()
        return cls(quantize_weight(weight), linear.bias, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.device.type == "cpu":
            from engine.cpu import ops

            return ops.linear(x, self.weight, self.bias32)
        return reference_linear_int8(x, self.weight, self.bias32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 from {self.dtype}, " \
               f"bias={self.bias32 is not None}"


def compute_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The float dtype a Linear layer (`nn.Linear` or `Int8Linear`) computes in; None for another module."""
    if isinstance(module, Int8Linear):
        return module.dtype
    if isinstance(module, torch.nn.Linear):
        return module.weight.dtype
    return None


def quantize_linears(model: torch.nn.Module) -> int:
    """Every `nn.Linear` of `model` replaced by an `Int8Linear` of its weight, the float weight dropped (a weight
    tied to an embedding stays the embedding's, the Linear gets its own int8 copy). Returns how many. Tests run
    transformers' own model through this, the kernels off, as the int8 engine's reference."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear.of(child))
                count += 1
    return count


def int8_bytes(model: torch.nn.Module) -> int:
    """Bytes the `Int8Linear` layers of `model` hold (int8 values, scales, row sums, float32 biases), each storage
    counted once (fused layers' weights are views of one)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            w = module.weight
            for t in (w.qweight, w.scale, w.row_sums) + (() if module.bias32 is None else (module.bias32,)):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
