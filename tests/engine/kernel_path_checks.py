"""Checks of the kernel attention path and the decode graphs' inputs, run on the CPU through Triton's
interpreter (`TRITON_INTERPRET=1` must be set before Triton is imported, so test_kernel_path.py runs this
file in its own process). Each check prints one line `ok <name>` or raises."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.attention import AttentionBatch, PagedKernelMetadata, PrefillSpan, reference_attention  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.paged_kernel import paged_attention  # noqa: E402
from engine.scheduler_output import ScheduledChunk  # noqa: E402


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def check_kernel_matches_reference_attention() -> None:
    """Mixed decodes and chunks (a chunk after the first, a whole prompt), grouped-query heads, with and
    without a sliding window, on blocks scattered through the cache."""
    torch.manual_seed(0)
    bs, kv_heads, heads, d = 16, 3, 9, 64
    cache = KVCache(1, 64, bs, kv_heads, d, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    seqs = [(1, 37), (1, 5), (20, 20), (7, 50), (1, 16)]  # (queries, context length)
    order = torch.randperm(64).tolist()
    tables, used = [], 0
    for _, n in seqs:
        tables.append(order[used : used + -(-n // bs)])
        used += len(tables[-1])
    width = max(len(t) for t in tables)
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], heads, d)
    meta = PagedKernelMetadata(
        torch.tensor(starts, dtype=torch.int32), torch.tensor([n for _, n in seqs], dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), 20, len(seqs),
    )
    for window in (None, 6):
        out = paged_attention(query, cache.keys[0], cache.values[0], meta, bs, None, window)

        spans = []
        for i, (q, n) in enumerate(seqs):
            positions = torch.arange(n - q, n)[:, None]
            keys = torch.arange(n)[None, :]
            mask = keys <= positions
            sliding = mask & (keys > positions - window) if window else None
            spans.append(PrefillSpan(starts[i], starts[i] + q, torch.tensor(tables[i]), n, mask, sliding))
        batch = AttentionBatch(cache, torch.zeros(0, dtype=torch.long), [], spans)
        ref = reference_attention(query.transpose(0, 1), cache.keys[0], cache.values[0], batch, window, None)
        error = (out - ref).abs().max().item()
        assert error < 1e-5, f"kernel differs from the reference by {error} (window {window})"
    print("ok kernel_matches_reference_attention")


def check_engine_tokens_equal_reference(checkpoint: str) -> None:
    """Greedy tokens through the whole engine: kernel path == reference path, float32, chunked prefill over
    image tiles with requests arriving mid-way."""
    from PIL import Image

    photo = Image.new("RGB", (96, 64), (200, 30, 40))
    prompts = [
        ("User: What is in a street scene?<end_of_utterance>\nAssistant:", []),
        ("User:<image>Describe the people.<end_of_utterance>\nAssistant:", [photo]),
        ("User: Say something long about the weather today.<end_of_utterance>\nAssistant:", []),
    ]
    results = {}
    for backend in ("reference", "kernel"):
        engine = Engine(EngineConfig(model=checkpoint, dtype="float32", attention_backend=backend,
                                     max_num_batched_tokens=24, max_num_seqs=4))
        assert engine.attention_backend == backend
        ids = {}
        for step in range(400):
            if step < len(prompts):
                prompt, images = prompts[step]
                ids[engine.add_request(prompt=prompt, images=images,
                                       sampling=SamplingParams(max_tokens=8, ignore_eos=True))] = step
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    results.setdefault(backend, {})[ids[out.request_id]] = out.token_ids
            if step >= len(prompts) and not engine.has_unfinished_requests():
                break
    assert results["kernel"] == results["reference"], results
    print("ok engine_tokens_equal_reference")


class RecordedGraphs(DecodeGraphs):
    """Decode graphs that run their forward eagerly from the static inputs (no CUDA here), recording its ops."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.traces: list[tuple[int, list[int], list]] = []

    def fill(self, size: int, chunks: list[ScheduledChunk]) -> None:
        super().fill(size, chunks)
        self.contexts = [chunk.end for chunk in chunks]

    def run(self, size: int, rows: int) -> torch.Tensor:
        recorder = OpRecorder()
        with recorder:
            logits = self._forward(size)
        self.traces.append((size, self.contexts, recorder.ops))
        return logits[:rows]


def check_decode_steps_issue_the_same_ops(checkpoint: str) -> None:
    """What CUDA graph capture needs: two decode steps with different context lengths and the same padded
    batch run the same ops on the same shapes, and nothing in the forward reads a value back; and the decode
    steps that go through the graphs' static inputs give the reference path's tokens."""
    prompts = ["User: Hi<end_of_utterance>\nAssistant:", "User: Tell me about the street outside.<end_of_utterance>\n"
               "Assistant:", "User: Count to ten slowly please.<end_of_utterance>\nAssistant:"]
    tokens = {}
    for backend in ("reference", "kernel"):
        engine = Engine(EngineConfig(model=checkpoint, dtype="float32", attention_backend=backend, max_num_seqs=8,
                                     itl_target_ms=0))  # token budgets: the same steps whatever the machine
        if backend == "kernel":
            engine.runner.graphs = graphs = RecordedGraphs(engine.runner, 8, engine.max_model_len)
        ids = {engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=24, ignore_eos=True)): i
               for i, p in enumerate(prompts)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(backend, {})[ids[out.request_id]] = out.token_ids
    assert tokens["kernel"] == tokens["reference"], tokens
    by_size = [t for t in graphs.traces if t[0] == 4]
    assert len(by_size) >= 20, [t[:2] for t in graphs.traces]
    (_, first_contexts, first), (_, last_contexts, last) = by_size[0], by_size[-1]
    assert max(last_contexts) > max(first_contexts) + 16  # across a block boundary
    assert first == last, "the decode forward's ops or shapes changed with the context"
    readbacks = [op for op, _ in first if "_local_scalar_dense" in op or "nonzero" in op or ".item" in op]
    assert not readbacks, readbacks
    print("ok decode_steps_issue_the_same_ops")


def check_kernel_reads_an_int8_cache_as_its_dequantized_values() -> None:
    """An int8 cache read in place: the same outputs, bit for bit, as over a cache of the queries' dtype holding
    the dequantized values (engine/kv_cache.py), decodes and a chunk, grouped-query heads."""
    from engine.kv_cache import dequantize_kv

    torch.manual_seed(1)
    bs, kv_heads, heads, d = 16, 2, 6, 32
    int8 = KVCache(1, 8, bs, kv_heads, d, torch.float32, torch.device("cpu"), "int8")
    plain = KVCache(1, 8, bs, kv_heads, d, torch.float32, torch.device("cpu"))
    slots = torch.arange(int8.keys[0].shape[0])
    int8.write(0, slots, torch.randn(len(slots), kv_heads, d) * 3, torch.randn(len(slots), kv_heads, d))
    plain.keys[0].copy_(dequantize_kv(int8.keys[0], int8.key_scales[0], torch.float32))
    plain.values[0].copy_(dequantize_kv(int8.values[0], int8.value_scales[0], torch.float32))
    meta = PagedKernelMetadata(torch.tensor([0, 1, 13], dtype=torch.int32), torch.tensor([40, 30], dtype=torch.int32),
                               torch.tensor([[5, 1, 7], [2, 6, 0]], dtype=torch.int32), 12, 2)
    query = torch.randn(13, heads, d)
    got = paged_attention(query, int8.keys[0], int8.values[0], meta, bs, None, None, scales=int8.scales(0))
    want = paged_attention(query, plain.keys[0], plain.values[0], meta, bs, None, None)
    assert torch.equal(got, want), (got - want).abs().max()
    print("ok kernel_reads_an_int8_cache_as_its_dequantized_values")


if __name__ == "__main__":
    checkpoint, wanted = sys.argv[1], sys.argv[2:]
    alone = ("kernel_matches_reference_attention", "kernel_reads_an_int8_cache_as_its_dequantized_values")
    for name in (*alone, "engine_tokens_equal_reference", "decode_steps_issue_the_same_ops"):
        if not wanted or name in wanted:
            check = globals()[f"check_{name}"]
            check() if name in alone else check(checkpoint)
