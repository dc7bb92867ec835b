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

import contextlib
import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

            if torch.compiler.is_compiling():  # an opaque operator in the graph (engine/compiled.py)
                w = self.weight
                return torch.ops.vlmcap.linear_int8(x, w.qweight, w.scale, w.row_sums, self.bias32)
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


# -- pre-quantized checkpoints: compressed-tensors W8A8 (the format vLLM loads) -------------------------------------

COMPRESSED_TENSORS = "compressed-tensors"
RUNNABLE_SCHEME = ("int8 weights, symmetric, per output channel (or per tensor); int8 input activations, symmetric, "
                   "dynamic, per token")


@dataclass(frozen=True)
class CompressedScheme:
    """Which Linear layers a compressed-tensors checkpoint holds quantized: `targets` (class names, or `re:`
    patterns of module names) less `ignore` (module names, or `re:` patterns)."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def covers(self, names: tuple[str, ...], module: torch.nn.Module) -> bool:
        """Whether the Linear `module`, named any of `names` (the model's name, the checkpoint's), is quantized."""
        def matches(pattern: str) -> bool:
            if pattern.startswith("re:"):
                return any(re.match(pattern[3:], name) for name in names)
            return pattern in names or pattern == type(module).__name__ or (
                pattern == "Linear" and isinstance(module, torch.nn.Linear))

        return any(matches(p) for p in self.targets) and not any(matches(p) for p in self.ignore)


def compressed_scheme(quantization_config: dict | None) -> CompressedScheme | None:
    """The checkpoint's compressed-tensors scheme where config.json's `quantization_config` names one (None for a
    checkpoint of float weights or of another quantization method); ValueError, naming the scheme, for one the
    engine cannot run exactly (anything but `RUNNABLE_SCHEME`: static or asymmetric activations, group or block
    scales, other bit widths, floats, sparsity, a quantized KV cache)."""
    if not quantization_config or quantization_config.get("quant_method") != COMPRESSED_TENSORS:
        return None  # float weights, or another method, which transformers' own loading handles as it does
    groups = quantization_config.get("config_groups") or {}
    problems = []
    fmt = quantization_config.get("format")
    if fmt not in ("int-quantized", None):
        problems.append(f"format {fmt!r}")
    if quantization_config.get("kv_cache_scheme"):
        problems.append(f"kv_cache_scheme {quantization_config['kv_cache_scheme']}")
    if (quantization_config.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        problems.append(f"sparsity_config {quantization_config['sparsity_config']}")
    if not groups:
        problems.append("no config_groups")
    targets: list[str] = []
    for name, group in groups.items():
        targets += group.get("targets") or []
        problems += [f"{name}: {p}" for p in _group_problems(group)]
    if problems:
        raise ValueError(f"the checkpoint's compressed-tensors scheme cannot run exactly here ({'; '.join(problems)}): "
                         f"the engine runs {RUNNABLE_SCHEME}")
    return CompressedScheme(tuple(targets), tuple(quantization_config.get("ignore") or ()))


def _group_problems(group: dict) -> list[str]:
    weights, inputs = group.get("weights"), group.get("input_activations")
    problems = []
    if group.get("format") not in (None, "int-quantized"):
        problems.append(f"format {group['format']!r}")
    for what, args, strategies, dynamic in (("weights", weights, ("channel", "tensor"), False),
                                            ("input_activations", inputs, ("token",), True)):
        if not args:
            problems.append(f"{what} not quantized" if what == "input_activations" else "weights not quantized")
            continue
        if args.get("num_bits") != 8 or args.get("type", "int") != "int":
            problems.append(f"{what} {args.get('type', 'int')}{args.get('num_bits')}")
        if not args.get("symmetric", True):
            problems.append(f"{what} asymmetric")
        if args.get("strategy") not in strategies:
            problems.append(f"{what} strategy {args.get('strategy')!r}"
                            + (f" (group_size {args.get('group_size')})" if args.get("group_size") else ""))
        elif args.get("group_size") or args.get("block_structure"):
            problems.append(f"{what} group_size {args.get('group_size')} block_structure "
                            f"{args.get('block_structure')}")
        if bool(args.get("dynamic", False)) != dynamic:
            problems.append(f"{what} {'static' if dynamic else 'dynamic'}")
    if group.get("output_activations"):
        problems.append("output_activations quantized")
    return problems


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (nothing allocated for them; buffers, such
    as rotary tables, are made for real as their modules compute them)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _key_renamer(model: torch.nn.Module) -> Callable[[str], str]:
    """Checkpoint key -> the model's parameter name, by transformers' own renaming of the family's saved names
    (its internal API; without it, names as they are)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: key
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    names = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    names |= dict.fromkeys(name for name, _ in model.named_buffers())

    def rename(key: str) -> str:
        renamed, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if converter is not None:
            raise ValueError(f"checkpoint tensor {key!r} needs transformers' weight conversion, which a "
                             "pre-quantized checkpoint's int8 weights cannot go through")
        return key if renamed not in names and key in names else renamed

    return rename


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"the compressed-tensors checkpoint {str(path)!r} has no .safetensors files")
    return files


def load_compressed_model(path: str, config: Any, scheme: CompressedScheme, dtype: torch.dtype,
                          device: torch.device) -> torch.nn.Module:
    """A compressed-tensors W8A8 checkpoint (`compressed_scheme`) as transformers' own model of its architecture:
    the layers the scheme covers as `Int8Linear`s read straight from the checkpoint's int8 `weight` and
    `weight_scale` (no float copy of them ever made), every other tensor in `dtype`."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    config = copy.deepcopy(config)
    del config.quantization_config
    with _parameters_on_meta():
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    rename = _key_renamer(model)
    modules = dict(model.named_modules())
    layers: dict[str, dict[str, torch.Tensor]] = {}  # a quantized layer's name -> its tensors
    loaded: set[str] = set()
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                stem, _, leaf = key.rpartition(".")
                if leaf in ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point"):
                    name = rename(f"{stem}.weight").rpartition(".")[0]
                    layers.setdefault(name, {})[leaf] = tensors.get_tensor(key)
                    continue
                name, _, leaf = rename(key).rpartition(".")
                module = modules.get(name)
                if module is None:
                    raise ValueError(f"checkpoint tensor {key!r} ({name}.{leaf}) is no tensor of the model")
                if isinstance(module, torch.nn.Linear) and scheme.covers((name, stem), module):
                    layers.setdefault(name, {})[leaf] = tensors.get_tensor(key)
                    continue
                tensor = tensors.get_tensor(key)
                tensor = tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
                if leaf in module._parameters:
                    module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
                else:
                    module._buffers[leaf] = tensor
                loaded.add(f"{name}.{leaf}")
    for name, tensors in layers.items():
        _place_int8_layer(model, modules, name, tensors, dtype, device)
    _tie_or_refuse(model, config, loaded)
    return model.to(device).eval()


def _place_int8_layer(model: torch.nn.Module, modules: dict[str, torch.nn.Module], name: str,
                      tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    q, scale, zero = tensors.get("weight"), tensors.get("weight_scale"), tensors.get("weight_zero_point")
    if q is None or q.dtype != torch.int8 or scale is None:
        raise ValueError(f"the compressed-tensors layer {name!r} lacks an int8 weight and its weight_scale "
                         f"(has {sorted(tensors)}, weight {None if q is None else q.dtype})")
    if zero is not None and bool(zero.any()):
        raise ValueError(f"the compressed-tensors layer {name!r} has nonzero weight zero points (asymmetric)")
    if scale.numel() == 1:  # one scale for the tensor: the same for every row
        scale = scale.reshape(1).expand(q.shape[0])
    if scale.numel() != q.shape[0]:
        raise ValueError(f"the compressed-tensors layer {name!r} has {scale.numel()} weight scales for "
                         f"{q.shape[0]} rows (per-channel or per-tensor scales run here)")
    linear = modules[name]
    bias = tensors.get("bias")
    weight = Int8Weight.of(q.to(device), scale.to(device, torch.float32))
    parent, _, child = name.rpartition(".")
    setattr(modules[parent] if parent else model, child,
            Int8Linear(weight, None if bias is None else bias.to(device), dtype))
    modules[name] = getattr(modules[parent] if parent else model, child)
    del linear


def _tie_or_refuse(model: torch.nn.Module, config: Any, loaded: set[str]) -> None:
    """The output head tied to the embeddings where the config says so and the checkpoint has no head of its own;
    ValueError naming any parameter the checkpoint left unset."""
    head = getattr(model, "lm_head", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    if isinstance(head, torch.nn.Linear) and head.weight.device.type == "meta" and tied:
        head.weight = model.get_input_embeddings().weight
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"the compressed-tensors checkpoint has no tensor for {len(missing)} parameters of the "
                         f"model: {missing[:5]}")
