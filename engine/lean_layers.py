"""Llama-style decoder layers run as a handful of C calls on the CPU (`EngineConfig.lean_layers`).

A stock transformers decoder layer runs some 60 small operators a step (projections, rotary embedding, views,
residual adds, norms, activation): on a CPU a decode step's few rows make each cost more to dispatch than to
compute. The rule here: a layer that fits (`fits`: Llama's structure: RMSNorm before attention and MLP, q/k/v/o
projections with rotate-half RoPE and no norms of their own, a SiLU-gated MLP, full causal attention; Llama,
Qwen2, Qwen2-VL, Mistral text models) runs as

    add_rms_norm -> linear(qkv) -> rope_store -> attention -> linear(o) -> add_rms_norm -> linear(gate_up, glu)
    -> linear(down)

reading transformers' own weights: q/k/v (and gate/up) are copied once into one matrix whose row ranges become
the modules' weights (views), so one call computes them and the weights stay held once. The residual add of
each layer is fused into the next norm. A step's buffers are made once per step and shared by every layer;
the rotary embedding's cos and sin come from the model's own module, M-RoPE sections included. Layers that do
not fit run stock, on the same residual stream. Attention is the engine's own (engine/attention.py), so the
results are those of the stock layers: tests compare greedy tokens with both and with transformers' generate.

A step of decodes only (the steady state of every chat) runs all the layers and the final norm in one C call
(engine/csrc/decode_layers.c): the same kernels in the same order on the same buffers, so the same bits, without
the Python between 8 kernels a layer (`LeanTextModel.one_call`; a step with a prefill chunk, or rows past a
projection's kernel range, goes layer by layer).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_kernel
from engine.attention import AttentionBatch, reference_attention

log = logging.getLogger(__name__)

LEAN_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen2VLDecoderLayer",
                                "Qwen2_5_VLDecoderLayer", "MistralDecoderLayer"})


def _silu(module: torch.nn.Module) -> bool:
    return type(module).__name__ in ("SiLU", "SiLUActivation")


def fits(layer: torch.nn.Module) -> bool:
    """Whether `layer` computes exactly what `LeanLayer` computes (see the module's docstring)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in LEAN_LAYER_CLASSES or attn is None or mlp is None:
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        return False
    dtypes = {m.weight.dtype for m in linears}
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return (len(dtypes) == 1 and dtypes <= set(cpu_kernel.KERNEL_ROWS)
            and all(n is not None and cpu_kernel.is_llama_norm(type(n)) for n in norms)
            and not hasattr(attn, "q_norm") and getattr(attn, "sliding_window", None) is None
            and getattr(attn, "is_causal", True) and _silu(getattr(mlp, "act_fn", None)))


@dataclass
class Projection:
    """One weight (maybe several modules' fused) as the kernel reads it, and up to how many rows it wins."""

    weight: torch.Tensor  # [n, k], contiguous rows
    bias32: torch.Tensor | None
    rows: tuple[int, int]  # the row counts that go through the kernel (cpu_kernel.measure_row_range)

    def __post_init__(self) -> None:
        self.weight_t = self.weight.t()  # torch's path multiplies by this view, made once
        self.bias = None if self.bias32 is None else self.bias32.to(self.weight.dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, glu: bool = False) -> None:
        if self.rows[0] <= x.shape[0] <= self.rows[1]:
            cpu_kernel._run_linear(cpu_kernel.load_variant(cpu_kernel.variant()), x, self.weight, self.bias32,
                                   glu, out)
            return
        if not glu:
            if self.bias is None:
                torch.mm(x, self.weight_t, out=out)
            else:
                torch.addmm(self.bias, x, self.weight_t, out=out)
            return
        both = F.linear(x, self.weight, self.bias)
        half = both.shape[-1] // 2
        torch.mul(F.silu(both[:, :half]), both[:, half:], out=out)


def fuse(modules: list[torch.nn.Linear]) -> Projection:
    """One matrix of the modules' weights stacked (their biases likewise); each module's weight (and bias) becomes
    a view of its rows, so the weights are held once."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype)
        for m, b in zip(modules, biases)])
    start = 0
    for module in modules:
        end = start + module.out_features
        module.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return Projection(weight, None if bias is None else bias.to(torch.float32), cpu_kernel.KERNEL_ROWS[weight.dtype])


def measure_projections(projections: list[Projection]) -> dict[str, tuple[int, int]]:
    """Each projection's `rows` measured here (cpu_kernel.measure_row_range), one measurement per shape;
    returns them by shape ("n x k dtype")."""
    ranges: dict[str, tuple[int, int]] = {}
    for projection in projections:
        key = cpu_kernel.shape_key(projection.weight)
        if key not in ranges:
            ranges[key] = cpu_kernel.measure_row_range(projection.weight)
        projection.rows = ranges[key]
    return ranges


class LeanLayer:
    """A fitting decoder layer's weights as the lean forward reads them."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = fuse([attn.o_proj])
        self.gate_up = fuse([mlp.gate_proj, mlp.up_proj])
        self.down = fuse([mlp.down_proj])
        self.input_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
        self.scaling = float(attn.scaling)
        self.intermediate = mlp.gate_proj.out_features

    def projections(self) -> list[Projection]:
        return [self.qkv, self.o, self.gate_up, self.down]


class LeanTextModel:
    """The text model's forward with every fitting layer lean (see the module's docstring)."""

    def __init__(self, text_model: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.text_model = text_model
        self.layers = [LeanLayer(layer) if fits(layer) else None for layer in text_model.layers]
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        norm = text_model.norm
        self.final_norm = (norm.weight, float(norm.variance_epsilon)) if cpu_kernel.is_llama_norm(type(norm)) else None
        self.count = sum(layer is not None for layer in self.layers)
        self.one_call = True  # decode steps through cpu_kernel.decode_layers (False: a call per kernel)
        self._projections = self.projections()
        # (KV cache, its layers' arguments, the rows every projection's kernel takes)
        self._args: tuple[object, ctypes.Array | None, tuple[int, int]] | None = None
        self._step: cpu_kernel.DecodeStepArgs | None = None  # refilled every step that runs in one call

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy of the adapter) leaves the one call's arguments behind: they point at this
        object's weights and cache; the copy makes its own."""
        return {**self.__dict__, "_args": None, "_step": None}

    @staticmethod
    def applies(text_model: torch.nn.Module) -> bool:
        """Whether the text model has a layer that fits and the parts the lean forward reads."""
        layers = getattr(text_model, "layers", None)
        return (layers is not None and hasattr(text_model, "rotary_emb") and hasattr(text_model, "norm")
                and any(fits(layer) for layer in layers))

    def projections(self) -> list[Projection]:
        return [p for layer in self.layers if layer is not None for p in layer.projections()]

    def _layer_args(self, batch: AttentionBatch) -> tuple[ctypes.Array | None, tuple[int, int]]:
        """Every layer's weights and KV cache as one C call reads them (cpu_kernel.decode_layers), and the row
        counts every projection's kernel takes (their ranges, measured at start-up), made once per KV cache; None
        where a layer runs stock, the layers differ in MLP width or the model's last norm is not Llama's."""
        cache = batch.kv_cache
        if self._args is not None and self._args[0] is cache:
            return self._args[1:]
        args = None
        widths = {layer.intermediate for layer in self.layers if layer is not None}
        norms = [norm for layer in self.layers if layer is not None for norm in (layer.input_norm, layer.post_norm)]
        norms += [self.final_norm] if self.final_norm is not None else []
        norm_dtypes = {weight.dtype for weight, _ in norms}
        if self.count == len(self.layers) and self.final_norm is not None and len(widths) == 1:
            if len(norm_dtypes) != 1 or not all(weight.is_contiguous() for weight, _ in norms):
                raise ValueError(f"the lean layers' norm weights must be contiguous, of one dtype, got {norm_dtypes}")
            args = (cpu_kernel.LeanLayerArgs * self.count)()
            for index, layer in enumerate(self.layers):
                key_cache, value_cache = cache.keys[index], cache.values[index]
                if not (key_cache.is_contiguous() and value_cache.is_contiguous()
                        and key_cache.shape[1:] == (self.kv_heads, self.head_dim)):
                    raise ValueError(f"layer {index}'s KV cache {tuple(key_cache.shape)} is not contiguous "
                                     f"[slots, {self.kv_heads}, {self.head_dim}]")
                args[index] = cpu_kernel.LeanLayerArgs(
                    layer.input_norm[0].data_ptr(), layer.post_norm[0].data_ptr(), layer.input_norm[1],
                    layer.post_norm[1], *(cpu_kernel.projection_args(p.weight, p.bias32) for p in layer.projections()),
                    key_cache.data_ptr(), value_cache.data_ptr(), layer.scaling)
        rows = (max(p.rows[0] for p in self._projections), min(p.rows[1] for p in self._projections))
        self._args = (cache, args, rows)
        return args, rows

    def _in_one_call(self, batch: AttentionBatch, tokens: int) -> ctypes.Array | None:
        """The layers' arguments where this step runs them in one C call (`one_call`, a step of decodes only,
        in one group read by the CPU's decode kernel, every projection's kernel rows including `tokens`)."""
        if not self.one_call or batch.prefills or len(batch.decodes) != 1 or batch.decodes[0].context_lens is None:
            return None
        args, (low, high) = self._layer_args(batch)
        return args if low <= tokens <= high else None

    def measure(self) -> dict[str, tuple[int, int]]:
        """Each projection's `rows` measured here (cpu_kernel.measure_row_range), one per shape."""
        return measure_projections(self.projections())

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """[T, hidden] embeddings -> [T, hidden] final hidden states (after the model's last norm)."""
        if batch.kernel is not None:
            raise RuntimeError("lean layers run the CPU's attention, not the paged kernel's metadata")
        tokens, hidden = embeds.shape
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = self.text_model.rotary_emb(embeds[None], position_ids.unsqueeze(-2))
        cos, sin = cos.reshape(tokens, self.head_dim).contiguous(), sin.reshape(tokens, self.head_dim).contiguous()
        h = embeds.contiguous()  # the residual stream, updated in place
        new = embeds.new_empty
        normed, o, down = new(tokens, hidden), new(tokens, hidden), new(tokens, hidden)
        qkv, attended = new(tokens, q_width + 2 * kv_width), new(tokens, self.heads, self.head_dim)
        layer_args = self._in_one_call(batch, tokens)
        if layer_args is not None:
            gate_up = new(tokens, self.layers[0].intermediate)
            self._run_in_one_call(layer_args, batch, h, (normed, qkv, attended, o, gate_up, down), cos, sin)
            return normed
        queries = qkv[:, :q_width].view(tokens, self.heads, self.head_dim).transpose(0, 1)  # [heads, T, d]
        attended_rows = attended.view(tokens, q_width)
        gate_up = None
        pending: torch.Tensor | None = None  # the last layer's output, not yet added to h
        keys, values = batch.kv_cache.keys, batch.kv_cache.values
        for index, layer in enumerate(self.layers):
            if layer is None:
                if pending is not None:
                    h.add_(pending)
                    pending = None
                stock = self.text_model.layers[index]
                h = stock(h[None], position_embeddings=(cos[None], sin[None]), position_ids=position_ids.unsqueeze(-2),
                          vlmcap_batch=batch)[0].contiguous()
                continue
            if gate_up is None or gate_up.shape[1] != layer.intermediate:
                gate_up = new(tokens, layer.intermediate)
            cpu_kernel.add_rms_norm(h, pending, *layer.input_norm, normed)
            layer.qkv(normed, qkv)
            cpu_kernel.rope_store(qkv, self.heads, self.kv_heads, self.head_dim, cos, sin, batch.slot_mapping,
                                  keys[index], values[index])
            reference_attention(queries, keys[index], values[index], batch, None, layer.scaling, attended)
            layer.o(attended_rows, o)
            cpu_kernel.add_rms_norm(h, o, *layer.post_norm, normed)
            layer.gate_up(normed, gate_up, glu=True)
            layer.down(gate_up, down)
            pending = down
        if self.final_norm is None:
            if pending is not None:
                h.add_(pending)
            return self.text_model.norm(h)
        cpu_kernel.add_rms_norm(h, pending, *self.final_norm, normed)
        return normed

    def _run_in_one_call(self, layer_args: ctypes.Array, batch: AttentionBatch, h: torch.Tensor,
                         buffers: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor) -> None:
        """forward's layers and final norm in one C call: h and the buffers (normed, qkv, attended, o, gate_up,
        down) as forward made them, the step's attention metadata checked as each kernel's wrapper checks it."""
        if self._step is None:
            self._step = cpu_kernel.DecodeStepArgs()
        group, step, cache = batch.decodes[0], self._step, batch.kv_cache.keys[0]
        metadata = (batch.slot_mapping, group.query_index, group.block_tables, group.context_lens)
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in metadata):
            raise ValueError(f"the decode step's slots, query index, block tables and context lengths must be "
                             f"contiguous int64, got {[t.dtype for t in metadata]}")
        tokens, hidden = h.shape
        norm_dtype = self.final_norm[0].dtype
        codes = cpu_kernel.DTYPE_CODES
        if cache.dtype not in codes or h.dtype not in codes or not h.dtype == cos.dtype == sin.dtype == norm_dtype:
            raise ValueError(f"one call runs the layers on hidden states, rotary tables and norm weights of one "
                             f"dtype and a float32, bfloat16 or float16 cache, got {h.dtype}, {cos.dtype}, "
                             f"{norm_dtype} and {cache.dtype}")
        step.h, step.normed, step.qkv, step.attended, step.o, step.gate_up, step.down = (
            t.data_ptr() for t in (h, *buffers))
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slots, step.query_index, step.block_tables, step.context_lens = (t.data_ptr() for t in metadata)
        step.final_norm, step.final_eps = self.final_norm[0].data_ptr(), self.final_norm[1]
        step.tokens, step.hidden, step.heads, step.kv_heads, step.head_dim = (
            tokens, hidden, self.heads, self.kv_heads, self.head_dim)
        step.num_seqs, step.block_size, step.table_width = (
            group.query_index.shape[0], batch.kv_cache.block_size, group.block_tables.shape[1])
        step.io_dtype, step.cache_dtype = cpu_kernel.DTYPE_CODES[h.dtype], cpu_kernel.DTYPE_CODES[cache.dtype]
        cpu_kernel.decode_layers(step, layer_args)
