"""CUDA graphs for decode-only steps.

A step in which every scheduled request decodes one token (and samples it) runs the same kernels on the
same shapes whatever the contexts' lengths, once its batch is padded to a fixed size and the attention reads
the paged cache through the kernel path (engine/paged_kernel.py, whose launch depends only on the number of
sequences and the block table's width). Such steps replay a graph captured at start-up, one per padded
batch size (1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`), from static input buffers: token ids,
positions, cache slots, context lengths and block tables. Padding rows write and read the cache's scratch
block. The graph ends with the logits of every row; sampling runs after it, as in eager steps. Mixed steps
(prefill chunks) run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionBatch, PagedKernelMetadata, triton_attention
from engine.model_runner import cache_slots
from engine.scheduler_output import ScheduledChunk

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to `max_num_seqs` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        self.runner = runner
        adapter = runner.adapter
        device = runner.device
        n = max_num_seqs
        self.block_size = runner.block_size
        self.width = -(-max_model_len // self.block_size)
        self.streams = adapter.rope_streams or 1
        kv_cache = runner.kv_cache
        self.scratch_block = kv_cache.scratch_block
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.streams, n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.long, device=device)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.table = torch.full((n, self.width), self.scratch_block, dtype=torch.int32, device=device)
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    # -- capture --------------------------------------------------------------------------------
    def _forward(self, size: int) -> torch.Tensor:
        adapter = self.runner.adapter
        meta = PagedKernelMetadata(self.starts[: size + 1], self.seq_lens[:size], self.table[:size], 1, size)
        batch = AttentionBatch(self.runner.kv_cache, self.slots[:size], [], [], kernel=meta, attend=triton_attention)
        positions = self.positions[:, :size] if self.streams > 1 else self.positions[0, :size]
        hidden = adapter.forward_text(adapter.embed_tokens(self.ids[:size]), positions, batch)
        return adapter.lm_head(hidden).float()

    @classmethod
    def capture(cls, runner, max_num_seqs: int, max_model_len: int) -> DecodeGraphs | None:
        """Capture every size, largest first, sharing one memory pool; None (eager steps) if capture fails."""
        graphs = cls(runner, max_num_seqs, max_model_len)
        began = time.perf_counter()
        before = torch.cuda.memory_allocated(runner.device)
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(runner.device)
                side.wait_stream(torch.cuda.current_stream(runner.device))
                with torch.cuda.stream(side):  # compiles the kernel and sets up the libraries outside capture
                    for size in graphs.sizes:
                        graphs._forward(size)
                torch.cuda.current_stream(runner.device).wait_stream(side)
                pool = torch.cuda.graph_pool_handle()
                for size in reversed(graphs.sizes):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = graphs._forward(size)
                    graphs.graphs[size] = (graph, logits)
            torch.cuda.synchronize(runner.device)
        except Exception:
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        graphs.capture_seconds = time.perf_counter() - began
        graphs.capture_bytes = torch.cuda.memory_allocated(runner.device) - before
        log.info("captured %d CUDA graphs for decode batches %s in %.1f s, %.1f MiB", len(graphs.graphs),
                 graphs.sizes, graphs.capture_seconds, graphs.capture_bytes / 2**20)
        return graphs

    # -- replay ---------------------------------------------------------------------------------
    def lookup(self, chunks: list[ScheduledChunk]) -> int | None:
        """The padded batch size whose graph runs this step, or None if the step must run eagerly (a prefill
        chunk, a chunk that does not sample, image features to merge, or more sequences than captured)."""
        if len(chunks) > self.sizes[-1]:
            return None
        for chunk in chunks:
            if chunk.num_tokens != 1 or not chunk.samples:
                return None
            mm = chunk.mm
            if mm is not None and chunk.start < chunk.num_prompt_tokens and mm.inputs_in(chunk.start, chunk.end):
                return None
        return next(size for size in self.sizes if size >= len(chunks))

    def run(self, size: int, rows: int) -> torch.Tensor:
        """Replay the graph of `size` on the inputs `fill` left, and return the logits of the first `rows` rows."""
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:rows]

    def fill(self, size: int, chunks: list[ScheduledChunk]) -> None:
        """The static inputs of a padded batch of `size` for `chunks`, from one upload; padding rows write and
        read the scratch block."""
        runner = self.runner
        bs = self.block_size
        real = len(chunks)
        width = max(-(-chunk.end // bs) for chunk in chunks)
        ids, slots, seq_lens, table = [], [], [], []
        positions: list[list[int]] = [[] for _ in range(self.streams)]
        for chunk in chunks:
            position = chunk.start
            ids.append(chunk.token_ids[0])
            for stream, values in zip(positions, runner.adapter.rope_positions(chunk.mm, chunk.num_prompt_tokens,
                                                                               position, position + 1)):
                stream.extend(values)
            slots.extend(cache_slots(chunk.block_ids, position, position + 1, bs))
            seq_lens.append(chunk.end)
            blocks = chunk.block_ids[:width]
            table.extend(blocks + [self.scratch_block] * (width - len(blocks)))
        pad = size - real
        ids += [0] * pad
        for stream in positions:
            stream.extend([0] * pad)
        slots += [self.scratch_block * bs] * pad
        seq_lens += [1] * pad
        table += [self.scratch_block] * (width * pad)
        values = runner.uploader.upload(ids + [p for stream in positions for p in stream] + slots + seq_lens + table)
        at = 0
        for target in (self.ids[:size], *(self.positions[s, :size] for s in range(self.streams)), self.slots[:size]):
            target.copy_(values[at : at + size])
            at += size
        self.seq_lens[:size].copy_(values[at : at + size])
        at += size
        self.table[:size, :width].copy_(values[at:].view(size, width))
