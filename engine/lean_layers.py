"""Llama-style and Gemma 3 decoder layers run as a handful of C calls on the CPU (`EngineConfig.lean_layers`).

A stock transformers decoder layer runs some 60 small operators a step (projections, rotary embedding, views,
residual adds, norms, activation): on a CPU a decode step's few rows make each cost more to dispatch than to
compute. The rule here: a layer that fits (`fits`: RMSNorms of Llama's or Gemma's arithmetic before attention and
MLP, and in Gemma 3 after each too; q/k/v/o projections with rotate-half RoPE, per-head q and k norms where the
layer has them; a gated MLP whose activation is SiLU or GELU's tanh approximation; causal attention, full or in a
sliding window; no logit soft-capping: Llama, Qwen2, Qwen2-VL, Mistral and Gemma 3 text models) runs as

    add_rms_norm -> linear(qkv) -> rope_store (q/k norms) -> attention -> linear(o) -> add_rms_norm
    -> linear(gate_up, glu) -> linear(down)

reading transformers' own weights: q/k/v (and gate/up) are copied once into one matrix whose row ranges become
the modules' weights (views), so one call computes them and the weights stay held once. The residual add of
each block is fused into the next norm (with Gemma's norm of the block's output before it). A step's buffers are
made once per step and shared by every layer; the rotary embedding's cos and sin come from the model's own
module (M-RoPE's sections, Gemma's local and global tables included). Layers that do not fit run stock, on the
same residual stream. Attention is the engine's own (engine/attention.py), so the results are those of the
stock layers: tests compare greedy tokens with both and with transformers' generate.

A step of decodes only (the steady state of every chat) runs all the layers and the final norm in one C call
(engine/csrc/decode_layers.c): the same kernels in the same order on the same buffers, so the same bits, without
the Python between 8 kernels a layer (`LeanTextModel.one_call`; a step with a prefill chunk, or rows past a
projection's kernel range, goes layer by layer).
"""

from __future__ import annotations

import ctypes
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionBatch
from engine.cpu import abi, build, ops, routing, tuning
from engine.cpu.routing import Norm
from engine.quantization import Int8Linear, Int8Weight, compute_dtype
from engine.rotary_tables import RotaryTables

log = logging.getLogger(__name__)

LEAN_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen2VLDecoderLayer",
                                "Qwen2_5_VLDecoderLayer", "MistralDecoderLayer", "Gemma3DecoderLayer"})
# Where a layer's norms sit: before attention, before the MLP, after attention and after the MLP (Gemma's
# sandwich norms of each block's output), per query and key head.
NORM_PLACES = ("input", "mlp", "attn_out", "mlp_out", "q", "k")


def _norm_modules(layer: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    attn = layer.self_attn
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: a norm before and after each block
        modules = dict(input=getattr(layer, "input_layernorm", None), mlp=layer.pre_feedforward_layernorm,
                       attn_out=getattr(layer, "post_attention_layernorm", None),
                       mlp_out=getattr(layer, "post_feedforward_layernorm", None))
    else:
        modules = dict(input=getattr(layer, "input_layernorm", None),
                       mlp=getattr(layer, "post_attention_layernorm", None), attn_out=None, mlp_out=None)
    return {**modules, "q": getattr(attn, "q_norm", None), "k": getattr(attn, "k_norm", None)}


def _norms(layer: torch.nn.Module, dtype: torch.dtype) -> dict[str, Norm | None] | None:
    """The layer's norms by place (None where it has none there), or None where one is of another arithmetic, a
    Llama-style one's weight is not of the layer's `dtype`, or it lacks a norm before attention or the MLP."""
    modules = _norm_modules(layer)
    norms = {place: None if module is None else Norm.of(module) for place, module in modules.items()}
    if any(modules[place] is not None and norms[place] is None for place in NORM_PLACES):
        return None
    if norms["input"] is None or norms["mlp"] is None:
        return None
    if any(n is not None and n.flavor == abi.NORM_LLAMA and n.weight.dtype != dtype for n in norms.values()):
        return None
    return norms


def fits(layer: torch.nn.Module) -> bool:
    """Whether `layer` computes exactly what `LeanLayer` computes (see the module's docstring)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in LEAN_LAYER_CLASSES or attn is None or mlp is None:
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not uniform_linears(linears):
        return False
    dtypes = {compute_dtype(m) for m in linears}
    window = getattr(attn, "sliding_window", None)
    return (len(dtypes) == 1 and dtypes <= set(routing.KERNEL_ROWS) and _norms(layer, next(iter(dtypes)))
            is not None and getattr(attn, "is_causal", True) and getattr(attn, "attn_logit_softcapping", None) is None
            and (window is None or (isinstance(window, int) and window > 0))
            and isinstance(getattr(attn, "scaling", None), float)
            and routing.activation_of(getattr(mlp, "act_fn", None)) in abi.GLU_ACTIVATIONS)


def uniform_linears(modules: list[torch.nn.Module | None]) -> bool:
    """Whether `modules` are all float Linear layers or all int8 ones (engine/quantization.py), in one dtype."""
    kinds = {type(m) is Int8Linear for m in modules}
    return (len(kinds) == 1 and all(compute_dtype(m) is not None for m in modules)
            and len({compute_dtype(m) for m in modules}) == 1)


def _rope_kind(text_model: torch.nn.Module, layer: torch.nn.Module) -> str | None:
    """Which of the model's rotary tables `layer` takes: its layer type where the rotary embedding makes one per
    type (Gemma 3: local and global), else None (one table)."""
    takes_type = "layer_type" in inspect.signature(text_model.rotary_emb.forward).parameters
    return getattr(layer.self_attn, "layer_type", None) if takes_type else None


@dataclass
class Projection:
    """One weight (maybe several modules' fused) as the kernel reads it, and up to how many rows it wins. An int8
    weight (engine/quantization.py) goes through the kernel at every row count: torch has no product that gives
    its numbers."""

    weight: torch.Tensor | Int8Weight  # [n, k], contiguous rows
    bias32: torch.Tensor | None
    rows: tuple[int, int]  # the row counts that go through the kernel (tuning.measure_row_range)

    def __post_init__(self) -> None:
        self.int8 = isinstance(self.weight, Int8Weight)
        if self.int8:
            return
        self.weight_t = self.weight.t()  # torch's path multiplies by this view, made once
        self.bias = None if self.bias32 is None else self.bias32.to(self.weight.dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, glu: str | None = None,
                 residual: torch.Tensor | None = None, act: str | None = None) -> None:
        """out = x W^T (+ b) (+ residual, out's shape: added as torch's `residual + linear(x)` adds it, in the
        kernel's epilogue where it can); with `glu` (an activation), act(x W_g^T) * (x W_u^T); with `act`
        ("gelu_tanh", no glu), ops.gelu_tanh of the product before any residual (in the int8 epilogue)."""
        if self.int8:
            ops.linear(x, self.weight, self.bias32, glu, out, residual, act=act)
            return
        if self.rows[0] <= x.shape[0] <= self.rows[1]:
            ops.run_linear(build.load_variant(build.variant()), x, self.weight, self.bias32, glu, out,
                           residual=residual, act=act)
            return
        if glu is None:
            if self.bias is None:
                torch.mm(x, self.weight_t, out=out)
            else:
                torch.addmm(self.bias, x, self.weight_t, out=out)
            if act is not None:
                ops.gelu_tanh(out)
            if residual is not None:
                out.add_(residual)
            return
        both = F.linear(x, self.weight, self.bias)
        half = both.shape[-1] // 2
        gate = F.silu(both[:, :half]) if glu == "silu" else F.gelu(both[:, :half], approximate="tanh")
        torch.mul(gate, both[:, half:], out=out)
        if residual is not None:
            out.add_(residual)


def fuse(modules: list[torch.nn.Module]) -> Projection:
    """One matrix of the modules' weights stacked (their biases likewise); each module's weight (and bias) becomes
    a view of its rows, so the weights are held once. Int8 layers (engine/quantization.py) stack their int8 rows,
    scales and row sums alike (quantized per row, so the stack is the stacked weight's quantization)."""
    if isinstance(modules[0], Int8Linear):
        return _fuse_int8(modules)
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
    return Projection(weight, None if bias is None else bias.to(torch.float32), routing.KERNEL_ROWS[weight.dtype])


def _fuse_int8(modules: list[Int8Linear]) -> Projection:
    parts = [m.weight for m in modules]
    weight = parts[0] if len(parts) == 1 else Int8Weight(*(torch.cat([getattr(p, name) for p in parts]) for name in
                                                           ("qweight", "scale", "row_sums")))
    biases = [m.bias32 for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat([
        b if b is not None else torch.zeros(m.out_features, dtype=torch.float32) for m, b in zip(modules, biases)])
    start = 0
    for module in modules:
        end = start + module.out_features
        module.weight = Int8Weight(weight.qweight[start:end], weight.scale[start:end], weight.row_sums[start:end])
        if module.bias32 is not None:
            module.bias32 = bias[start:end]
        start = end
    return Projection(weight, bias, (1, routing.ALL_ROWS))


def measure_projections(projections: list[Projection]) -> dict[str, tuple[int, int]]:
    """Each projection's `rows` measured here (tuning.measure_row_range), one measurement per shape;
    returns them by shape ("n x k dtype")."""
    ranges: dict[str, tuple[int, int]] = {}
    for projection in projections:
        if projection.int8:  # the kernel at every row count
            continue
        key = tuning.shape_key(projection.weight)
        if key not in ranges:
            ranges[key] = tuning.measure_row_range(projection.weight)
        projection.rows = ranges[key]
    return ranges


class LeanLayer:
    """A fitting decoder layer's weights as the lean forward reads them."""

    def __init__(self, layer: torch.nn.Module, rope: str | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = fuse([attn.o_proj])
        self.gate_up = fuse([mlp.gate_proj, mlp.up_proj])
        self.down = fuse([mlp.down_proj])
        norms = _norms(layer, compute_dtype(attn.q_proj))
        self.input_norm, self.mlp_norm = norms["input"], norms["mlp"]
        self.attn_out_norm, self.mlp_out_norm = norms["attn_out"], norms["mlp_out"]
        self.q_norm, self.k_norm = norms["q"], norms["k"]
        self.mlp_out_module = _norm_modules(layer)["mlp_out"]  # for a stock layer after this one
        self.scaling = float(attn.scaling)
        self.window: int | None = getattr(attn, "sliding_window", None)
        self.act: str = routing.activation_of(mlp.act_fn)
        self.rope = rope
        self.intermediate = mlp.gate_proj.out_features

    def projections(self) -> list[Projection]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def args(self, key_cache: torch.Tensor, value_cache: torch.Tensor, local_rope: bool,
             scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> abi.LeanLayerArgs:
        """This layer as decode_layers.c reads it (`scales`: an int8 cache's)."""
        _, key_scales, value_scales = ops.cache_code(key_cache, value_cache, scales)
        norm = routing.norm_args
        return abi.LeanLayerArgs(
            input_norm=norm(self.input_norm), mlp_norm=norm(self.mlp_norm), attn_out_norm=norm(self.attn_out_norm),
            mlp_out_norm=norm(self.mlp_out_norm), q_norm=norm(self.q_norm), k_norm=norm(self.k_norm),
            **{name: ops.projection_args(p.weight, p.bias32)
               for name, p in zip(("qkv", "o", "gate_up", "down"), self.projections())},
            key_cache=key_cache.data_ptr(), value_cache=value_cache.data_ptr(), key_scales=key_scales,
            value_scales=value_scales, scaling=self.scaling,
            window=self.window or 0, act=abi.GLU_ACTIVATIONS[self.act], local_rope=int(local_rope))


class LeanTextModel:
    """The text model's forward with every fitting layer lean (see the module's docstring)."""

    def __init__(self, text_model: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.text_model = text_model
        self.ropes = [_rope_kind(text_model, layer) for layer in text_model.layers]
        self.rope_kinds = sorted(set(self.ropes), key=str)  # the rotary tables a step makes
        self.rope_tables = RotaryTables(text_model.rotary_emb, self.rope_kinds, head_dim)  # decode steps' rows
        # the embedding's rows the one call gathers itself (`forward`'s ids): a plain torch Embedding's, whose rows
        # are the embeddings as they are (Gemma's scales them: the module embeds)
        self.embed = text_model.get_input_embeddings()  # the adapter's `embed_tokens`
        self.embedding = (self.embed.weight if type(self.embed) is torch.nn.Embedding
                          and self.embed.weight.is_contiguous() else None)
        self.layers = [LeanLayer(layer, rope) if fits(layer) else None
                       for layer, rope in zip(text_model.layers, self.ropes)]
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.final_norm = Norm.of(text_model.norm)
        self.count = sum(layer is not None for layer in self.layers)
        self.one_call = True  # decode steps through ops.decode_layers (False: a call per kernel)
        self._projections = self.projections()
        # (KV cache, its layers' arguments, the rows every projection's kernel takes)
        self._args: tuple[object, ctypes.Array | None, tuple[int, int]] | None = None
        self._step: abi.DecodeStepArgs | None = None  # refilled every step that runs in one call

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
        """Every layer's weights and KV cache as one C call reads them (ops.decode_layers), and the row
        counts every projection's kernel takes (their ranges, measured at start-up), made once per KV cache; None
        where a layer runs stock, the layers differ in MLP width, the model's last norm is of another arithmetic
        or it has more than two rotary tables."""
        cache = batch.kv_cache
        if self._args is not None and self._args[0] is cache:
            return self._args[1:]
        args = None
        widths = {layer.intermediate for layer in self.layers if layer is not None}
        if (self.count == len(self.layers) and self.final_norm is not None and len(widths) == 1
                and len(self.rope_kinds) <= 2):
            args = (abi.LeanLayerArgs * self.count)()
            for index, layer in enumerate(self.layers):
                key_cache, value_cache = cache.keys[index], cache.values[index]
                if not (key_cache.is_contiguous() and value_cache.is_contiguous()
                        and key_cache.shape[1:] == (self.kv_heads, self.head_dim)):
                    raise ValueError(f"layer {index}'s KV cache {tuple(key_cache.shape)} is not contiguous "
                                     f"[slots, {self.kv_heads}, {self.head_dim}]")
                args[index] = layer.args(key_cache, value_cache, self.rope_kinds.index(layer.rope) == 1,
                                         cache.scales(index))
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
        """Each projection's `rows` measured here (tuning.measure_row_range), one per shape."""
        return measure_projections(self.projections())

    def _rotary_tables(self, embeds: torch.Tensor, position_ids: torch.Tensor
                       ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary table the layers take (`rope_kinds`): cos and sin [T, head_dim], contiguous."""
        tokens = embeds.shape[0]
        tables = {}
        for kind in self.rope_kinds:
            extra = () if kind is None else (kind,)
            cos, sin = self.text_model.rotary_emb(embeds[None], position_ids.unsqueeze(-2), *extra)
            tables[kind] = (cos.reshape(tokens, self.head_dim).contiguous(),
                            sin.reshape(tokens, self.head_dim).contiguous())
        return tables

    def forward(self, embeds: torch.Tensor | None, position_ids: torch.Tensor, batch: AttentionBatch,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] embeddings, or None and the T token ids (int64) to embed -> [T, hidden] final hidden states
        (after the model's last norm). A step in one call gathers the ids' rows of a plain embedding itself."""
        if batch.kernel is not None:
            raise RuntimeError("lean layers run the CPU's attention, not the paged kernel's metadata")
        tokens = ids.shape[0] if embeds is None else embeds.shape[0]
        layer_args = self._in_one_call(batch, tokens)
        gather = embeds is None and layer_args is not None and self.embedding is not None
        if embeds is None and not gather:
            embeds = self.embed(ids)
        dtype, hidden = (self.embedding.dtype, self.embedding.shape[1]) if gather else (embeds.dtype, embeds.shape[1])
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # the residual stream, updated in place
        h = torch.empty(tokens, hidden, dtype=dtype) if gather else embeds.contiguous()
        new = h.new_empty
        normed, o, down = new(tokens, hidden), new(tokens, hidden), new(tokens, hidden)
        qkv, attended = new(tokens, q_width + 2 * kv_width), new(tokens, self.heads, self.head_dim)
        if layer_args is not None:
            gate_up = new(tokens, self.layers[0].intermediate)
            self._run_in_one_call(layer_args, batch, h, (normed, qkv, attended, o, gate_up, down), position_ids,
                                  ids if gather else None)
            return normed
        tables = self._rotary_tables(embeds, position_ids)
        queries = qkv[:, :q_width].view(tokens, self.heads, self.head_dim).transpose(0, 1)  # [heads, T, d]
        attended_rows = attended.view(tokens, q_width)
        gate_up = None
        pending: torch.Tensor | None = None  # the last layer's output, not yet added to h
        pending_layer: LeanLayer | None = None  # the lean layer that made it (its norm of it is still to apply)
        keys, values = batch.kv_cache.keys, batch.kv_cache.values
        for index, layer in enumerate(self.layers):
            if layer is None:
                if pending is not None:
                    norm = pending_layer.mlp_out_module
                    h.add_(pending if norm is None else norm(pending))
                    pending = None
                stock = self.text_model.layers[index]
                cos, sin = tables[self.ropes[index]]
                h = stock(h[None], position_embeddings=(cos[None], sin[None]), position_ids=position_ids.unsqueeze(-2),
                          vlmcap_batch=batch)[0].contiguous()
                continue
            if gate_up is None or gate_up.shape[1] != layer.intermediate:
                gate_up = new(tokens, layer.intermediate)
            cos, sin = tables[layer.rope]
            ops.add_rms_norm(h, pending, layer.input_norm, normed,
                             pending_layer.mlp_out_norm if pending is not None else None)
            layer.qkv(normed, qkv)
            scales = batch.kv_cache.scales(index)
            ops.rope_store(qkv, self.heads, self.kv_heads, self.head_dim, cos, sin, batch.slot_mapping,
                           keys[index], values[index], layer.q_norm, layer.k_norm, scales)
            batch.attend(queries, keys[index], values[index], batch, layer.window, layer.scaling, attended,
                         scales=scales)
            layer.o(attended_rows, o)
            ops.add_rms_norm(h, o, layer.mlp_norm, normed, layer.attn_out_norm)
            layer.gate_up(normed, gate_up, glu=layer.act)
            layer.down(gate_up, down)
            pending, pending_layer = down, layer
        if self.final_norm is None:
            if pending is not None:
                norm = pending_layer.mlp_out_module
                h.add_(pending if norm is None else norm(pending))
            return self.text_model.norm(h)
        ops.add_rms_norm(h, pending, self.final_norm, normed,
                         pending_layer.mlp_out_norm if pending is not None else None)
        return normed

    def _run_in_one_call(self, layer_args: ctypes.Array, batch: AttentionBatch, h: torch.Tensor,
                         buffers: tuple[torch.Tensor, ...], position_ids: torch.Tensor,
                         ids: torch.Tensor | None = None) -> None:
        """forward's layers and final norm in one C call: h (the embeddings, or where `ids` are given their rows of
        `embedding`, gathered in the call) and the buffers (normed, qkv, attended, o, gate_up, down) as forward
        made them, the rotary tables (the first kind's cos and sin, the second's the local ones: `rope_tables`
        read at the step's positions where they hold the module's values, else the module's rows for the step),
        the step's attention metadata checked as each kernel's wrapper checks it."""
        if self._step is None:
            self._step = abi.DecodeStepArgs()
        group, step, cache = batch.decodes[0], self._step, batch.kv_cache.keys[0]
        metadata = (batch.slot_mapping, group.query_index, group.block_tables, group.context_lens, position_ids)
        if ids is not None:
            metadata += (ids,)
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in metadata):
            raise ValueError(f"the decode step's slots, query index, block tables, context lengths, positions and "
                             f"ids must be contiguous int64, got {[t.dtype for t in metadata]}")
        step.ids, step.embedding, step.embedding_rows = (
            (None, None, 0) if ids is None else (ids.data_ptr(), self.embedding.data_ptr(), self.embedding.shape[0]))
        tokens, hidden = h.shape
        # a decode row's position is its context length less one (one position stream), within the block tables
        reach = group.block_tables.shape[1] * batch.kv_cache.block_size
        tables = self.rope_tables.covering(reach, h.dtype) if position_ids.dim() == 1 else None
        if tables is None:
            tables, step.positions, step.rope_rows = self._rotary_tables(h, position_ids), None, 0
        else:
            step.positions, step.rope_rows = position_ids.data_ptr(), self.rope_tables.rows
        (cos, sin), (local_cos, local_sin) = tables[self.rope_kinds[0]], tables[self.rope_kinds[-1]]
        codes = abi.DTYPE_CODES
        cache_dtype, _, _ = ops.cache_code(cache, batch.kv_cache.values[0], batch.kv_cache.scales(0))
        if h.dtype not in codes or not h.dtype == cos.dtype == local_cos.dtype:
            raise ValueError(f"one call runs the layers on hidden states and rotary tables of one dtype, got "
                             f"{h.dtype}, {cos.dtype} and {local_cos.dtype}")
        step.h, step.normed, step.qkv, step.attended, step.o, step.gate_up, step.down = (
            t.data_ptr() for t in (h, *buffers))
        step.cos, step.sin, step.local_cos, step.local_sin = (t.data_ptr() for t in (cos, sin, local_cos, local_sin))
        step.slots, step.query_index, step.block_tables, step.context_lens = (t.data_ptr() for t in metadata[:4])
        step.final_norm = self.final_norm.args
        step.tokens, step.hidden, step.heads, step.kv_heads, step.head_dim = (
            tokens, hidden, self.heads, self.kv_heads, self.head_dim)
        step.num_seqs, step.block_size, step.table_width = (
            group.query_index.shape[0], batch.kv_cache.block_size, group.block_tables.shape[1])
        step.io_dtype, step.cache_dtype = abi.DTYPE_CODES[h.dtype], cache_dtype
        ops.decode_layers(step, layer_args)
