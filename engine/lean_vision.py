"""SigLIP-style vision encoder layers run as a few fused calls on the CPU (`EngineConfig.lean_layers`).

A stock SigLIP encoder layer (SmolVLM's and Idefics3's tower) spends two thirds of a 512 px tile's time on a
CPU outside its matrix products: the bias broadcast copied into every product's output, GELU at about a
nanosecond a value (1,024 x 3,072 values a layer), the residual adds, three separate q/k/v products. The rule
here: a layer that fits (`fits`: LayerNorm before attention and MLP, q/k/v/out projections, an MLP fc1 ->
GELU (tanh) -> fc2) runs as

    layer_norm -> linear(qkv) -> attention on views of its heads -> linear(out) + residual -> layer_norm
    -> linear(fc1), GELU in place -> linear(fc2) + residual

reading transformers' own weights: q/k/v are copied once into one matrix whose row ranges become the modules'
weights (`lean_layers.fuse`), so the weights stay held once. Each product goes through the CPU's Linear kernel
for the row counts where it wins (measured at start-up, as the decoder's), else through oneDNN (torch's own CPU
library: the bias and the residual add in its epilogue) where it runs for the dtype no slower than F.linear
(`fused_products`), else through F.linear and an add; GELU is the C kernel (engine/csrc/gelu.c), in the
Linear kernel's epilogue where fc1 goes through it (int8 weights always: their output written once); attention is
the C kernel (engine/csrc/full_attention.c) where it beats SDPA here (`own_attention`), else SDPA. The arithmetic
is the stock layer's (float32 sums; in bfloat16 a fused residual add rounds once instead of twice): tests compare
the features with the stock tower's and greedy tokens with transformers' generate. An adapter
that runs its tower in slices (engine/models/smolvlm.py) calls the slice functions below on the layers that
fit.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from engine.cpu import build, ops, routing
from engine.cpu.tuning import fastest_seconds
from engine.lean_layers import Projection, fuse, measure_projections, uniform_linears
from engine.quantization import compute_dtype

log = logging.getLogger(__name__)

def fits(layer: torch.nn.Module) -> bool:
    """Whether `layer` computes exactly what `LeanVisionLayer` computes (see the module's docstring)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "layer_norm1", None), getattr(layer, "layer_norm2", None))
    if attn is None or mlp is None or not all(type(n) is torch.nn.LayerNorm for n in norms):
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    linears += [getattr(mlp, n, None) for n in ("fc1", "fc2")]
    if not uniform_linears(linears):
        return False
    dtypes = {compute_dtype(m) for m in linears}
    return (dtypes <= {torch.float32, torch.bfloat16}
            and routing.activation_of(getattr(mlp, "activation_fn", None)) == "gelu_tanh"
            and all(_device(m).type == "cpu" for m in linears)
            and not getattr(attn, "is_causal", False) and hasattr(attn, "head_dim") and hasattr(attn, "scale"))


def _device(linear: torch.nn.Module) -> torch.device:
    weight = linear.weight
    return getattr(weight, "qweight", weight).device  # an Int8Weight's values, or the float weight


@functools.cache
def fused_products(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN's Linear with a fused bias and residual add for `dtype` here, they
    give F.linear's result (checked once on a small product), and they are not slower than F.linear and an add
    on a tile-sized product (timed once: where oneDNN lacks the instructions for `dtype` it falls back to a
    reference path many times slower)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None or not hasattr(ops, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x, residual = (torch.randn(8, 32, generator=generator).to(dtype) for _ in range(2))
        weight, bias = torch.randn(16, 32, generator=generator).to(dtype), torch.randn(16).to(dtype)
        plain = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        added = torch.ops.mkldnn._linear_pointwise.binary(x, residual[:, :16].contiguous(), weight, bias, "add")
    except RuntimeError as exc:
        log.info("oneDNN's fused Linear does not run for %s here (%s): the vision tower uses F.linear", dtype, exc)
        return False
    expected = F.linear(x, weight, bias).float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    if not (torch.allclose(plain.float(), expected, atol=tolerance)
            and torch.allclose(added.float(), expected + residual[:, :16].float(), atol=2 * tolerance)):
        return False
    x, residual = (torch.randn(1024, 768, generator=generator).to(dtype) for _ in range(2))
    weight, bias = (torch.randn(768, 768, generator=generator) * 0.03).to(dtype), torch.zeros(768, dtype=dtype)
    with torch.inference_mode():
        fused, plain_seconds = fastest_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add"),
            lambda: residual + F.linear(x, weight, bias))
    if fused > 1.1 * plain_seconds:
        log.info("oneDNN's fused Linear takes %.1f ms against F.linear's %.1f for %s here: the vision tower uses "
                 "F.linear", fused * 1e3, plain_seconds * 1e3, dtype)
        return False
    return True


def own_attention(dtype: torch.dtype, heads: int, head_dim: int) -> bool:
    """Whether the CPU kernel's attention (engine/csrc/full_attention.c), in the build this process uses, runs a
    tile's attention (1,024 positions: a 512 px SigLIP tile) faster than torch's SDPA here and gives SDPA's result
    on it (where the build's vectors are narrow, SDPA's own kernels can be the faster): timed once per build and
    shape."""
    return _own_attention(build.variant(), dtype, heads, head_dim)


@functools.cache
def _own_attention(build: str | None, dtype: torch.dtype, heads: int, head_dim: int, patches: int = 1024) -> bool:
    if build is None:
        return False
    generator = torch.Generator().manual_seed(0)
    both = torch.randn(1, patches, 3, heads, head_dim, generator=generator).to(dtype)
    queries, keys, values = both.permute(2, 0, 3, 1, 4)
    scale = head_dim ** -0.5
    with torch.inference_mode():
        got = ops.full_attention(queries, keys, values, scale)
        if got is None:
            return False
        expected = F.scaled_dot_product_attention(queries, keys, values, scale=scale).transpose(1, 2)
        if not torch.allclose(got.float(), expected.float(), atol=1e-4 if dtype == torch.float32 else 2e-2):
            log.warning("the CPU kernel's attention differs from SDPA's for %s: the vision tower uses SDPA", dtype)
            return False
        own, sdpa = fastest_seconds(lambda: ops.full_attention(queries, keys, values, scale),
                                    lambda: F.scaled_dot_product_attention(queries, keys, values, scale=scale))
    log.info("vision attention (%d heads of %d, %d patches, %s, %s build): the CPU kernel %.1f ms, SDPA %.1f ms: %s",
             heads, head_dim, patches, dtype, build, own * 1e3, sdpa * 1e3, "the kernel" if own < sdpa else "SDPA")
    return own < sdpa


class LeanVisionLayer:
    """A fitting encoder layer's weights as the slice functions read them: each product a `Projection` (the
    CPU kernel for the row counts where it wins, measured at start-up like the decoder's), else oneDNN's fused
    Linear where it runs (`fused_products`), else torch's."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.out, self.fc1, self.fc2 = fuse([attn.out_proj]), fuse([mlp.fc1]), fuse([mlp.fc2])
        self.norm1, self.norm2 = layer.layer_norm1, layer.layer_norm2
        self.heads, self.head_dim, self.scale = attn.num_heads, attn.head_dim, float(attn.scale)
        # oneDNN's products are float ones: an int8 layer's go through the kernel (Projection)
        self.fused = not self.qkv.int8 and fused_products(self.qkv.weight.dtype)

    def projections(self) -> list[Projection]:
        return [self.qkv, self.out, self.fc1, self.fc2]

    def _linear(self, x: torch.Tensor, projection: Projection, residual: torch.Tensor | None = None,
                act: str | None = None) -> torch.Tensor:
        """projection(x [..., k]) (+ residual), a new tensor; with `act` ("gelu_tanh", no residual), its GELU (the
        C kernel's, in the int8 and kernel epilogues)."""
        rows = x.numel() // x.shape[-1]
        low, high = projection.rows
        if self.fused and not low <= rows <= high:
            if residual is None:
                out = torch.ops.mkldnn._linear_pointwise(x, projection.weight, projection.bias, "none", [], "")
                return ops.gelu_tanh(out.contiguous()) if act else out
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, projection.weight, projection.bias, "add")
        out = x.new_empty(*x.shape[:-1], projection.weight.shape[0])
        projection(x.reshape(rows, x.shape[-1]), out.view(rows, -1),
                   residual=None if residual is None else residual.reshape(rows, -1).contiguous(), act=act)
        return out

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[batch, patches, dim] -> queries, keys, values [batch, heads, patches, head_dim], views of one product."""
        normed = F.layer_norm(hidden, self.norm1.normalized_shape, self.norm1.weight, self.norm1.bias, self.norm1.eps)
        both = self._linear(normed, self.qkv)
        split = both.view(*hidden.shape[:-1], 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return split[0], split[1], split[2]

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               out: torch.Tensor) -> None:
        """Some heads' attention ([batch, heads, patches, head_dim] each) into `out` [batch, patches, heads,
        head_dim] (those heads of the layer's attended tensor): the CPU kernel's where it is the faster here
        (`own_attention`) and there is no mask, written in place, else SDPA's, copied there."""
        if mask is None and own_attention(queries.dtype, self.heads, self.head_dim):
            if ops.full_attention(queries, keys, values, self.scale, out=out) is not None:
                return
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        out.copy_(attended.transpose(1, 2))

    def attended_out(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + out_proj(attended [batch, patches, dim])."""
        return self._linear(attended, self.out, hidden)

    def mlp_in(self, hidden: torch.Tensor) -> torch.Tensor:
        """GELU(fc1(layer_norm2(hidden)))."""
        normed = F.layer_norm(hidden, self.norm2.normalized_shape, self.norm2.weight, self.norm2.bias, self.norm2.eps)
        return self._linear(normed, self.fc1, act="gelu_tanh")

    def mlp_out(self, activated: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + fc2(activated)."""
        return self._linear(activated, self.fc2, hidden)


def lean_vision_layers(layers: torch.nn.ModuleList) -> list[LeanVisionLayer | None]:
    """Each encoder layer lean where it fits (its q/k/v weights fused), None where it runs stock."""
    return [LeanVisionLayer(layer) if fits(layer) else None for layer in layers]


def measure(layers: list[LeanVisionLayer | None]) -> dict[str, tuple[int, int]]:
    """Each lean layer's products' `rows` measured here, one per shape (see `lean_layers.measure_projections`)."""
    return measure_projections([p for layer in layers if layer is not None for p in layer.projections()])
