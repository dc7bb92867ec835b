"""`vlmcap bench host`: where a decode step's time goes, and how it compares with a bare transformers forward.

`decodes` requests with prompts of about `context` tokens are prefilled, then decode together. For the
steps measured, each step's time is split into phases: scheduling, the vision encoder, the runner's input
preparation (packing, embedding, the output head: what the runner does outside the text model and the
sampler), the text model's forward, sampling, detokenizing, and the rest (the scheduler's update, stop
conditions, outputs). The phases are timed by wrapping the methods that do them (`Scheduler.schedule`,
`ModelRunner.execute`, `adapter.forward_text` and `forward_tokens`, the sampler, the detokenizer); where the
runner reports its own per-step timings (`runner.timings`), its split of the runner's time is used instead.

A few steps are then run under a counter of aten ops (a `TorchDispatchMode`) and of device read-backs
(`aten._local_scalar_dense`, a copy from the device to the host, and the Python calls that read a tensor's
values: `.tolist()`, `.item()`, `.cpu()`, `.numpy()`; on the CPU every such call is counted, as each would be
a synchronising read-back on a GPU).

The same batch (`decodes` sequences, one new token each, at the same context) then runs through the model
itself: transformers' text model with SDPA over a preallocated `StaticCache`, the output head and an argmax
read back once: the floor a step could reach with the same model code. The engine's step is measured early
(at `context`) and again `later` tokens later; the bare forward likewise, with a cache as long as each.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch

from bench.configs import HostConfig
from bench.report import machine, pyplot, save_figure
from engine import Engine, EngineConfig, SamplingParams, lean_paths
from engine.cpu import build, ops
from engine.host_memory import resident_bytes

PHASES = ("schedule", "encode", "prepare", "forward", "sample", "detokenize", "rest")
WORDS = ("a person walks past the blue bus while two friends talk near the station entrance in the rain "
         "and the camera shows a woman with a red bag").split()


class Phases:
    """Seconds spent inside wrapped callables, by phase, since the last `take`."""

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - began

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = dict(self.spent), Counter()
        return spent


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    """Set `target.name` for the duration; afterwards it is as it was (an instance or subclass attribute that
    was only inherited is removed again)."""
    own = name in vars(target)
    saved = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        if own:
            setattr(target, name, saved)
        else:
            delattr(target, name)


@contextlib.contextmanager
def timed_phases(engine: Engine, phases: Phases) -> Iterator[None]:
    """Wrap the engine's phase methods (on its instances, and the sampler and detokenizer where they live)."""
    import engine.model_runner as model_runner
    from engine.detokenizer import IncrementalDetokenizer

    runner = engine.runner
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(engine.scheduler, "schedule", phases.wrap("schedule", engine.scheduler.schedule)))
        stack.enter_context(_patched(runner, "execute", phases.wrap("execute", runner.execute)))
        if hasattr(runner, "_encode"):
            stack.enter_context(_patched(runner, "_encode", phases.wrap("encode", runner._encode)))
        adapter = runner.adapter
        for entry in ("forward_text", "forward_tokens"):  # a step calls one of them (model_runner's rule)
            stack.enter_context(_patched(adapter, entry, phases.wrap("forward", getattr(adapter, entry))))
        if callable(getattr(model_runner, "sample", None)):
            stack.enter_context(_patched(model_runner, "sample", phases.wrap("sample", model_runner.sample)))
        stack.enter_context(_patched(IncrementalDetokenizer, "update",
                                     phases.wrap("detokenize", IncrementalDetokenizer.update)))
        yield


def _split(total: float, spent: dict[str, float], reported: Any) -> dict[str, float]:
    """One step's phases in seconds, from the wrappers' times and, where present, the runner's own."""
    execute = spent.get("execute", 0.0)
    split = {"schedule": spent.get("schedule", 0.0), "detokenize": spent.get("detokenize", 0.0)}
    if reported is not None and all(hasattr(reported, p) for p in ("encode", "prepare", "forward", "sample")):
        split |= {p: float(getattr(reported, p)) for p in ("encode", "prepare", "forward", "sample")}
    else:
        split |= {p: spent.get(p, 0.0) for p in ("encode", "forward", "sample")}
        split["prepare"] = max(0.0, execute - split["encode"] - split["forward"] - split["sample"])
    split["rest"] = max(0.0, total - sum(split[p] for p in PHASES if p != "rest"))
    return split


def measure_steps(engine: Engine, steps: int) -> list[dict[str, float]]:
    """Per step: its wall time and phases, in seconds."""
    phases = Phases()
    measured = []
    with timed_phases(engine, phases):
        for _ in range(steps):
            phases.take()
            began = time.perf_counter()
            engine.step()
            total = time.perf_counter() - began
            split = _split(total, phases.take(), getattr(engine.runner, "timings", None))
            measured.append({"total": total, **split})
    return measured


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops, and read-backs from `device` (value reads and device-to-host copies)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: Counter[str] = Counter()
        self.readbacks: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if name == "_local_scalar_dense":
            self.readbacks["_local_scalar_dense"] += 1
        elif self.device.type != "cpu" and name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None \
                    and torch.device(dst_device).type == "cpu":
                self.readbacks["device_to_host_copy"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counted_value_reads(device: torch.device, readbacks: Counter[str]) -> Iterator[None]:
    """Count `.tolist()`, `.item()`, `.cpu()` and `.numpy()` on tensors on `device`'s type (Python-level calls,
    which on the CPU do not reach the dispatcher)."""

    def counting(name: str, original: Callable) -> Callable:
        def method(self, *args, **kwargs):
            if self.device.type == device.type:
                readbacks[f".{name}()"] += 1
            return original(self, *args, **kwargs)

        return method

    with contextlib.ExitStack() as stack:
        for name in ("tolist", "item", "cpu", "numpy"):
            stack.enter_context(_patched(torch.Tensor, name, counting(name, getattr(torch.Tensor, name))))
        yield


def count_ops(engine: Engine, steps: int) -> dict[str, Any]:
    """aten ops and read-backs per step, over `steps` steps."""
    counter = OpCounter(engine.device)
    with counted_value_reads(engine.device, counter.readbacks), counter:
        for _ in range(steps):
            engine.step()
    per_step = {name: n / steps for name, n in counter.ops.most_common()}
    return {
        "aten_ops_per_step": sum(counter.ops.values()) / steps,
        "readbacks_per_step": sum(counter.readbacks.values()) / steps,
        "readbacks_by_kind_per_step": {k: v / steps for k, v in counter.readbacks.items()},
        "top_ops_per_step": dict(list(per_step.items())[:15]),
    }


def _prompt(engine: Engine, tokens: int, seed: int) -> str:
    """Plain text of about `tokens` tokens."""
    words = [WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(tokens * 2)]
    ids = engine.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


def bare_forward_ms(engine: Engine, decodes: int, context: int, steps: int, warmup: int) -> list[float]:
    """Milliseconds per step of transformers' text model on `decodes` sequences, one new token each at position
    `context`, with SDPA over a `StaticCache` of `context + 1` tokens, then the output head and one read-back."""
    from transformers import StaticCache

    adapter = engine.adapter
    model = adapter.text_model
    config = model.config
    cache = StaticCache(config=config, max_cache_len=context + 1)
    ids = torch.randint(0, config.vocab_size, (decodes, 1), device=engine.device)
    positions = torch.full((decodes, 1), context, device=engine.device)
    cache_position = torch.tensor([context], device=engine.device)
    saved = config._attn_implementation
    config._attn_implementation = "sdpa"
    times = []
    try:
        with torch.inference_mode():
            for i in range(warmup + steps):
                _rewind(cache, context)
                began = time.perf_counter()
                hidden = model(inputs_embeds=adapter.embed_tokens(ids), position_ids=positions,
                               cache_position=cache_position, cache=cache, use_cache=True).last_hidden_state
                adapter.lm_head(hidden[:, -1]).float().argmax(-1).tolist()
                if i >= warmup:
                    times.append((time.perf_counter() - began) * 1000.0)
    finally:
        config._attn_implementation = saved
    return times


def _rewind(cache: Any, length: int) -> None:
    """Each layer of a transformers `StaticCache` set to write its next token at `length`: transformers 5's layers
    write where their own count of tokens written stands, whatever `cache_position` says, so the bare forward's
    steps, all at one position, would fill the cache up and overflow it after `length + 1` (older layers have no
    count and honour `cache_position`)."""
    for layer in getattr(cache, "layers", ()):
        written = getattr(layer, "cumulative_length", None)
        if isinstance(written, torch.Tensor):
            written.fill_(length)


def _summary_of(steps: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "step_ms_median": statistics.median(s["total"] for s in steps) * 1000.0,
        "phases_ms_median": {p: statistics.median(s[p] for s in steps) * 1000.0 for p in PHASES},
    }


def read_rates(threads: int | None, megabytes: int = 512, device: str = "cpu") -> dict[str, float]:
    """Bytes a second `device` reads from its memory (on the CPU with torch's threads), three ways, each the best of
    three passes over an array larger than any cache: "sum" (summed in float32), "row_product" (a bfloat16 matrix
    multiplied by one row) and, where the CPU kernels build, "kernel" (the same matrix by 8 rows in the engine's
    own Linear kernel: a decode step's own kind of read; on the AMX machine 15-20% faster than torch's two)."""
    if threads:
        torch.set_num_threads(threads)
    array = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    array.sum()
    rates = {"sum": array.numel() * 4 / min(_timed(array.sum, device) for _ in range(3))}
    del array
    matrix = torch.zeros(megabytes * 2**20 // 2 // 4096, 4096, dtype=torch.bfloat16, device=device)
    row = torch.zeros(1, 4096, dtype=torch.bfloat16, device=device)
    torch.nn.functional.linear(row, matrix)
    rates["row_product"] = matrix.numel() * 2 / min(
        _timed(lambda: torch.nn.functional.linear(row, matrix), device) for _ in range(3))
    if build.available(torch.device(device)):
        rows = torch.zeros(8, 4096, dtype=torch.bfloat16)
        ops.linear(rows, matrix)
        rates["kernel"] = matrix.numel() * 2 / min(_timed(lambda: ops.linear(rows, matrix)) for _ in range(3))
    return rates


def read_bandwidth(threads: int | None, megabytes: int = 512, device: str = "cpu") -> float:
    """The fastest of `read_rates`: the read floor's bandwidth."""
    return max(read_rates(threads, megabytes, device).values())


def _timed(fn: Callable, device: str = "cpu") -> float:
    """Seconds `fn()` takes, waiting for a GPU to finish it."""
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    synchronize()
    began = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - began


def step_read_bytes(engine: Engine, decodes: int, context: float) -> dict[str, float]:
    """What a decode step must read at least: the text model's weights and output head once (int8 layers' values,
    scales and row sums where the weights are quantized; the input embeddings, of which a step reads a row a
    sequence, only where they are the output head's weight), and each sequence's keys and values."""
    from engine.quantization import int8_bytes

    adapter = engine.adapter
    embedding = adapter.embed_tokens.weight
    head = list(adapter.lm_head.parameters())
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in adapter.text_model.parameters()
               if p is not embedding or any(p is h for h in head)}
    weights |= {p.data_ptr(): p.numel() * p.element_size() for p in head}
    quantized = int8_bytes(adapter.text_model) + int8_bytes(adapter.lm_head)
    per_position = sum(t[0].numel() * t.element_size() for t in kv_tensors(engine))  # one slot of each
    return {"weights": float(sum(weights.values()) + quantized), "kv": decodes * context * per_position}


def kv_tensors(engine: Engine) -> list[torch.Tensor]:
    """The KV cache's tensors: every layer's keys and values (and an int8 cache's scales), [slots, ...] each."""
    cache = engine.kv_cache
    return [*cache.keys, *cache.values, *(cache.key_scales or []), *(cache.value_scales or [])]


def held_bytes(device: str) -> int:
    """The memory the engine's tensors live in: the process's resident memory on the CPU, the device's allocated
    memory on a GPU (where the process's resident memory holds neither weights nor KV cache)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    return resident_bytes()


def file_backed_bytes() -> int:
    """The process's resident pages that map files (/proc/self/status RssFile: libraries' code and data; 0 where
    there is none): shared with other processes and dropped by the kernel under pressure, unlike its own memory."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_besides_kv(engine: Engine, before: int, before_files: int | None = None) -> dict[str, float]:
    """What the engine holds once started, in MB: `held_bytes` less what it held before the engine was built
    (`before`: on the CPU the interpreter, torch and transformers, the benchmark) and less the KV cache, against
    the bytes of the model's own tensors (parameters, buffers, int8 layers). With `before_files` (the CPU's
    `file_backed_bytes` before the engine), also the file-backed part of that (libraries' pages the start-up
    touched first, torch's kernels among them) and the ratio without it."""
    from engine.quantization import int8_bytes

    model = engine.adapter.model
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    weights = sum(storages.values()) + int8_bytes(model)
    kv = sum(t.numel() * t.element_size() for t in kv_tensors(engine))
    held = held_bytes(str(engine.device)) - before
    memory = {"engine_mb": held / 1e6, "before_engine_mb": before / 1e6, "kv_cache_mb": kv / 1e6,
              "weights_mb": weights / 1e6, "besides_kv_mb": (held - kv) / 1e6,
              "besides_kv_vs_weights": (held - kv) / weights}
    if before_files is not None:
        files = file_backed_bytes() - before_files
        memory |= {"file_backed_mb": files / 1e6, "besides_kv_and_files_vs_weights": (held - kv - files) / weights}
    return memory


def read_floor(engine: Engine, cfg: HostConfig, context: float, late_context: float) -> dict[str, Any]:
    rates = read_rates(cfg.threads, device=cfg.device)
    bandwidth = max(rates.values())
    early, late = step_read_bytes(engine, cfg.decodes, context), step_read_bytes(engine, cfg.decodes, late_context)
    return {"bandwidth_gb_s": bandwidth / 1e9, "reads_gb_s": {name: rate / 1e9 for name, rate in rates.items()},
            "weights_mb": early["weights"] / 1e6, "kv_mb_early": early["kv"] / 1e6,
            "kv_mb_late": late["kv"] / 1e6, "early_ms": sum(early.values()) / bandwidth * 1e3,
            "late_ms": sum(late.values()) / bandwidth * 1e3}


def vision_inputs(engine: Engine, tiles: int) -> tuple[list, int] | None:
    """`tiles` encoder inputs of one 512 px photo (a tile for SmolVLM), as the scheduler batches them for the
    adapter's `encode`, and the rows each gives; None for a model without images or tiles 0."""
    adapter = engine.adapter
    if tiles < 1 or adapter.image_marker is None:
        return None
    from PIL import Image

    photo = Image.new("RGB", (512, 512), (120, 90, 60))
    prompt = adapter.render_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}])
    _, mm = adapter.process(prompt, [photo], options=dict(adapter.single_input_options) or None)
    return mm.encoder_inputs[:1] * tiles, mm.input_rows[0]


@torch.inference_mode()
def vision_tile_ms(engine: Engine, tiles: int, repeats: int = 2) -> dict[str, float]:
    """The vision tower's time per encoder input (one photo as one input: a 512 px tile for SmolVLM), `tiles`
    inputs encoded together as the scheduler batches them: through the engine's path (lean layers where it runs
    them) and through the stock layers. Empty for a model without images or tiles 0."""
    adapter = engine.adapter
    made = vision_inputs(engine, tiles)
    if made is None:
        return {}
    inputs, rows = made
    lean = lean_paths.vision_layers(adapter.vision_layers)
    result = {}
    for name, layers in (("engine", lean), ("stock", None)):
        lean_paths.set_vision(adapter.vision_layers, layers)
        adapter.encode(inputs)
        began = time.perf_counter()
        for _ in range(repeats):
            adapter.encode(inputs)
        result[f"{name}_ms_per_input"] = (time.perf_counter() - began) / repeats / tiles * 1e3
    lean_paths.set_vision(adapter.vision_layers, lean)
    result["lean_layers"] = sum(layer is not None for layer in lean or ())
    result["input_rows"] = rows
    return result


def run_host(cfg: HostConfig) -> dict[str, Any]:
    if cfg.decodes < 1 or cfg.context < 2 or cfg.steps < 1 or cfg.later < 0:
        raise ValueError(f"decodes, steps must be positive, context at least 2 and later non-negative: {cfg}")
    # tokens a request may need: the measured steps, and as many as the prompt's length for the steps of the others'
    # prefill (a step budgeted by time can give each prompt only a chunk while the first ones already decode)
    extra = cfg.warmup + 2 * cfg.steps + cfg.counted_steps + cfg.later + 8 + cfg.context
    before = held_bytes(cfg.device)
    before_files = file_backed_bytes() if torch.device(cfg.device).type == "cpu" else None
    engine = Engine(EngineConfig(
        model=cfg.model, device=cfg.device, dtype=cfg.dtype, max_num_batched_tokens=max(cfg.budget, cfg.decodes),
        max_num_seqs=cfg.decodes, max_model_len=cfg.context + extra + 16, num_threads=cfg.threads,
        compile_model=cfg.compile_model, cpu_kernels=cfg.cpu_kernels, lean_layers=cfg.lean_layers,
        quantization=cfg.quantization,
        **({} if cfg.cpu_linear is None else {"cpu_linear": cfg.cpu_linear}),
        **({} if cfg.attention_backend is None else {"attention_backend": cfg.attention_backend}),
        **({} if cfg.kv_cache_dtype is None else {"kv_cache_dtype": cfg.kv_cache_dtype}),
    ))
    memory = memory_besides_kv(engine, before, before_files)
    params = SamplingParams(max_tokens=extra, ignore_eos=True)
    ids = [engine.add_request(prompt=_prompt(engine, cfg.context, i), sampling=params) for i in range(cfg.decodes)]
    prefill_began = time.perf_counter()
    while not all(engine.requests[r].is_decoding for r in ids):
        engine.step()
    prefill_s = time.perf_counter() - prefill_began
    context = statistics.median(engine.requests[r].num_tokens for r in ids)
    for _ in range(cfg.warmup):
        engine.step()
    early = measure_steps(engine, cfg.steps)
    counts = count_ops(engine, cfg.counted_steps)
    for _ in range(cfg.later):
        engine.step()
    late_context = statistics.median(engine.requests[r].num_tokens for r in ids)
    late = measure_steps(engine, cfg.steps)
    bare_early = bare_forward_ms(engine, cfg.decodes, int(context), cfg.steps, cfg.warmup)
    bare_late = bare_forward_ms(engine, cfg.decodes, int(late_context), cfg.steps, cfg.warmup)
    early_s, late_s = _summary_of(early), _summary_of(late)
    bare = {"early_ms_median": statistics.median(bare_early), "late_ms_median": statistics.median(bare_late)}
    floor = read_floor(engine, cfg, context, late_context)
    vision = vision_tile_ms(engine, cfg.vision_tiles)
    stats = engine.stats()
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "engine": {"attention_backend": engine.attention_backend, "cpu_linear": engine.cpu_linear,
                   "compile_seconds": engine.compile_seconds, "cpu_kernels": stats.cpu_kernels,
                   "cpu_bf16_products": stats.cpu_bf16_products,
                   "lean_layers": stats.lean_layers, "linear_rows": stats.linear_rows},
        "read_floor": floor,
        "memory": memory,
        "vision": vision,
        "prefill_s": prefill_s,
        "context_early": context,
        "context_late": late_context,
        "early": early_s,
        "late": late_s,
        "ops": counts,
        "bare_static_cache": bare,
        "ratios": {
            "engine_vs_bare_early": early_s["step_ms_median"] / bare["early_ms_median"],
            "engine_vs_bare_late": late_s["step_ms_median"] / bare["late_ms_median"],
            "engine_late_vs_early": late_s["step_ms_median"] / early_s["step_ms_median"],
            "bare_late_vs_early": bare["late_ms_median"] / bare["early_ms_median"],
            "engine_vs_floor_early": early_s["step_ms_median"] / floor["early_ms"],
            "engine_vs_floor_late": late_s["step_ms_median"] / floor["late_ms"],
        },
        "samples_ms": {
            "early": [s["total"] * 1000.0 for s in early],
            "late": [s["total"] * 1000.0 for s in late],
            "bare_early": bare_early,
            "bare_late": bare_late,
        },
    }


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    eng = result["engine"]
    weights = " int8 weights" if cfg.get("quantization") else ""
    weights += " int8 KV cache" if cfg.get("kv_cache_dtype") == "int8" else ""
    lines = [f"{cfg['model']} {cfg['dtype']}{weights} on {cfg['device']}: {cfg['decodes']} decodes, context "
             f"{result['context_early']:.0f} then {result['context_late']:.0f}; attention {eng['attention_backend']}, "
             f"cpu_linear {eng['cpu_linear']}, compiled {cfg['compile_model']} ({eng['compile_seconds']:.1f} s)",
             f"{'ms per step':<14}{'total':>8}" + "".join(f"{p:>11}" for p in PHASES)]
    for name in ("early", "late"):
        run = result[name]
        lines.append(f"{name:<14}{run['step_ms_median']:>8.2f}"
                     + "".join(f"{run['phases_ms_median'][p]:>11.2f}" for p in PHASES))
    bare, ratios, ops = result["bare_static_cache"], result["ratios"], result["ops"]
    lines += [
        f"{'bare forward':<14}{bare['early_ms_median']:>8.2f} early, {bare['late_ms_median']:.2f} late "
        "(transformers, SDPA over a StaticCache)",
        f"engine / bare: {ratios['engine_vs_bare_early']:.2f}x early, {ratios['engine_vs_bare_late']:.2f}x late; "
        f"late / early step: engine {ratios['engine_late_vs_early']:.2f}x, bare {ratios['bare_late_vs_early']:.2f}x",
        f"per step: {ops['aten_ops_per_step']:.0f} aten ops, {ops['readbacks_per_step']:.1f} read-backs "
        f"{ops['readbacks_by_kind_per_step']}",
    ]
    floor = result.get("read_floor")
    if floor:
        reads = ", ".join(f"{name} {rate:.1f}" for name, rate in floor.get("reads_gb_s", {}).items())
        lines.append(
            f"read floor: {floor['weights_mb']:.0f} MB of weights + {floor['kv_mb_early']:.0f} / "
            f"{floor['kv_mb_late']:.0f} MB of keys and values at {floor['bandwidth_gb_s']:.1f} GB/s (the fastest of "
            f"{reads}) = {floor['early_ms']:.2f} / {floor['late_ms']:.2f} ms; engine / floor: "
            f"{ratios['engine_vs_floor_early']:.2f}x early, {ratios['engine_vs_floor_late']:.2f}x late")
        lines.append(f"CPU kernels: {eng.get('cpu_kernels')} build (bfloat16 products: "
                     f"{eng.get('cpu_bf16_products')}), {eng.get('lean_layers')} lean decoder layers, "
                     f"kernel rows by weight shape {eng.get('linear_rows')}")
    memory = result.get("memory")
    if memory:
        lines.append(f"memory after start: the engine holds {memory['engine_mb']:.0f} MB (over "
                     f"{memory['before_engine_mb']:.0f} MB before it), {memory['kv_cache_mb']:.0f} MB of KV cache, "
                     f"{memory['besides_kv_mb']:.0f} MB besides it for {memory['weights_mb']:.0f} MB of the model's "
                     f"tensors ({memory['besides_kv_vs_weights']:.2f}x"
                     + (f"; {memory['file_backed_mb']:.0f} MB of it libraries' pages, "
                        f"{memory['besides_kv_and_files_vs_weights']:.2f}x without them)"
                        if "file_backed_mb" in memory else ")"))
    vision = result.get("vision")
    if vision:
        lines.append(f"vision tower: {vision['engine_ms_per_input']:.1f} ms per input ({vision['input_rows']} image "
                     f"tokens), {vision['lean_layers']} lean layers; stock layers "
                     f"{vision['stock_ms_per_input']:.1f} ms ({result['config']['vision_tiles']} inputs at once)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Stacked phases of the median early and late step, beside the bare forward."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = ["engine early", "engine late"]
    bottoms = [0.0, 0.0]
    for phase in PHASES:
        values = [result[k]["phases_ms_median"][phase] for k in ("early", "late")]
        ax.bar(names, values, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    bare = result["bare_static_cache"]
    ax.bar(["bare early", "bare late"], [bare["early_ms_median"], bare["late_ms_median"]], color="grey",
           label="bare forward")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{result['config']['model']}: {result['config']['decodes']} decodes", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
