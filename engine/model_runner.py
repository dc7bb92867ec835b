"""The model runner executes what the scheduler chose: it runs the vision encoder on the chosen inputs,
packs every chunk of the step into one flat batch, runs the text model once, and samples one token for
each request whose chunk reached its last token.

A step's metadata is built once, from Python lists: every integer the step needs (token ids, positions,
cache slots, block tables, context lengths, query starts, the rows to sample) goes into one list, becomes
one tensor and, on CUDA, one non-blocking upload from a reused pinned buffer; everything the layers read is
a view of it. Nothing in the forward reads a device value back; sampling reads back once per step.
A decode-only step on CUDA replays a captured graph (engine/cuda_graphs.py) when one fits its batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionBatch, DecodeGroup, PagedKernelMetadata, PrefillSpan
from engine.encoder_cache import EncoderOutputCache
from engine.kv_cache import KVCache
from engine.models.base import VLMAdapter
from engine.outputs import StepTimings
from engine.sampling import TokenLogprobs, sample
from engine.scheduler import EncoderWork, ScheduledChunk, SchedulerOutput

# A decode batch's padded keys may be at most this many times its real ones (see `_decode_groups`).
PADDED_KEYS_LIMIT = 1.5


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> its next token
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why no token could be sampled
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of the sampled token, requests that ask


class IntPacker:
    """Integers of one step gathered into one list; `take` returns where a run of them lies."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def take(self, values) -> slice:
        start = len(self.values)
        self.values.extend(values)
        return slice(start, len(self.values))


class Uploader:
    """One host tensor a step to the device: through a reused pinned buffer and a non-blocking copy on CUDA
    (the buffer is rewritten only after the previous copy from it has finished), as is on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def upload(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        if self.pinned is None or self.pinned.numel() < host.numel():
            self.pinned = torch.empty(max(host.numel(), 2 * (self.pinned.numel() if self.pinned is not None else 0),
                                          4096), dtype=torch.long, pin_memory=True)
        if self.done is not None:
            self.done.synchronize()
        staged = self.pinned[: host.numel()]
        staged.copy_(host)
        on_device = staged.to(self.device, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        return on_device


class ModelRunner:
    def __init__(self, adapter: VLMAdapter, kv_cache: KVCache, block_size: int, attention_backend: str = "reference",
                 encoder_outputs: EncoderOutputCache | None = None) -> None:
        self.adapter = adapter
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = adapter.device
        self.attention_backend = attention_backend  # "kernel", "cpu" or "reference", resolved by the engine
        self.uploader = Uploader(self.device)
        self.graphs = None  # engine/cuda_graphs.DecodeGraphs, set by the engine when it captures them
        self.encoder_outputs = encoder_outputs  # features shared across requests (engine/encoder_cache.py)
        self.encoder_cache: dict[tuple[str, int], torch.Tensor] = {}
        self.encoder_inputs_encoded = 0  # inputs whose tower ran to the end
        self.encoder_slices_run = 0  # slices of the tower run (a whole tower counts as all of its slices)
        self.encoder_seconds = 0.0
        self.timings = StepTimings()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        timings = self.timings = StepTimings()
        began = time.perf_counter()
        for key in out.freed_encoder_inputs:
            self.encoder_cache.pop(key, None)
        if out.encoder_work:
            self._encode(out.encoder_work)
        prepared = time.perf_counter()
        timings.encode = prepared - began
        if not out.chunks:
            return ModelRunnerOutput()
        sampled_chunks = [chunk for chunk in out.chunks if chunk.samples]
        graph = self.graphs.lookup(out.chunks) if self.graphs is not None else None
        if graph is not None:
            self.graphs.fill(graph, out.chunks)
            run_at = time.perf_counter()
            timings.prepare = run_at - prepared
            logits = self.graphs.run(graph, len(out.chunks))
        else:
            ids, positions, batch, sample_index, merges = self._prepare(out.chunks)
            embeds = self.adapter.embed_tokens(ids)
            if merges is not None:
                where, features = merges
                embeds[where] = torch.cat(features).to(embeds.dtype)
            run_at = time.perf_counter()
            timings.prepare = run_at - prepared
            hidden = self.adapter.forward_text(embeds, positions, batch)
            logits = self.adapter.lm_head(hidden[sample_index]).float() if sampled_chunks else None
        forwarded = time.perf_counter()
        timings.forward = forwarded - run_at
        result = ModelRunnerOutput()
        if sampled_chunks:
            requests = [chunk.request for chunk in sampled_chunks]
            if any(r.matcher is not None for r in requests):
                from engine.grammar import apply_token_masks

                apply_token_masks(logits, [r.matcher for r in requests])
            histories = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
            tokens, failed, logprobs = sample(logits, [r.sampling for r in requests], [r.generator for r in requests],
                                              histories)
            for row, token_logprobs in logprobs.items():
                result.logprobs[requests[row].request_id] = token_logprobs
            for request, token, bad in zip(requests, tokens, failed):
                if bad:
                    result.failed[request.request_id] = "the sampling distribution had no finite probability mass"
                else:
                    result.sampled[request.request_id] = token
        timings.sample = time.perf_counter() - forwarded
        return result

    # -- the step's inputs ----------------------------------------------------------------------
    def _prepare(self, chunks: list[ScheduledChunk]):
        """Token ids, positions, attention metadata, the rows to sample and the encoder features to merge,
        from one upload."""
        bs = self.block_size
        packer = IntPacker()
        streams = self.adapter.rope_streams or 1
        token_ids: list[int] = []
        slots: list[int] = []
        positions: list[list[int]] = [[] for _ in range(streams)]
        samples: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []  # (query index, context length, block ids)
        prefills: list[tuple[int, ScheduledChunk, list[int]]] = []  # (query start, chunk, block ids)
        where: list[int] = []
        features: list[torch.Tensor] = []
        kernel = self.attention_backend == "kernel" and not any(self._needs_masks(chunk) for chunk in chunks)
        for chunk in chunks:
            request, start, end = chunk.request, chunk.start, chunk.end
            query_start = len(token_ids)
            token_ids.extend(request.token_ids_between(start, end))
            for stream, values in zip(positions, self.adapter.rope_positions(request, start, end)):
                stream.extend(values)
            slots.extend(cache_slots(request.block_ids, start, end, bs))
            blocks = request.block_ids[: -(-end // bs)]
            if kernel:
                prefills.append((query_start, chunk, blocks))
            elif chunk.num_tokens == 1:  # a single query sees every cached key: batch it with the decodes
                decodes.append((query_start, end, blocks))
            else:
                prefills.append((query_start, chunk, blocks))
            if chunk.samples:
                samples.append(len(token_ids) - 1)
            if request.mm is not None:
                self._features(chunk, query_start, where, features)

        at_ids = packer.take(token_ids)
        at_slots = packer.take(slots)
        at_positions = [packer.take(stream) for stream in positions]
        at_samples = packer.take(samples)
        at_where = packer.take(where)
        layout = []
        if kernel:
            width = max(len(blocks) for _, _, blocks in prefills)
            starts = [query_start for query_start, _, _ in prefills] + [len(token_ids)]
            layout.append(packer.take(starts))
            layout.append(packer.take(chunk.end for _, chunk, _ in prefills))
            layout.append(packer.take(b for _, _, blocks in prefills for b in _padded(blocks, width)))
        else:
            # The CPU kernel reads each context's own blocks only: one batch, unsorted and unpadded in keys.
            groups = ([decodes] if decodes else []) if self.attention_backend == "cpu" else self._decode_groups(decodes)
            for group in groups:
                width = max(len(blocks) for _, _, blocks in group)
                layout.append((
                    packer.take(index for index, _, _ in group),
                    packer.take(context for _, context, _ in group),
                    packer.take(b for _, _, blocks in group for b in _padded(blocks, width)),
                ))
            tables = [packer.take(blocks) for _, _, blocks in prefills]

        values = self.uploader.upload(packer.values)
        ids = values[at_ids]
        slot_mapping = values[at_slots]
        position_ids = torch.stack([values[s] for s in at_positions]) if streams > 1 else values[at_positions[0]]
        sample_index = values[at_samples]
        merges = (values[at_where], features) if features else None
        if kernel:
            starts, seq_lens, table = (values[s] for s in layout)
            meta = PagedKernelMetadata(
                query_start_loc=starts.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                block_table=table.view(len(prefills), -1).to(torch.int32),
                max_query_len=max(chunk.num_tokens for _, chunk, _ in prefills), num_seqs=len(prefills),
            )
            batch = AttentionBatch(self.kv_cache, slot_mapping, [], [], kernel=meta)
        else:
            decode_groups = [self._decode_group(values[i], values[c], values[t].view(len(values[i]), -1))
                             for i, c, t in layout]
            spans = [
                PrefillSpan(query_start, query_start + chunk.num_tokens, values[table], chunk.end,
                            *self._prefill_masks(chunk))
                for (query_start, chunk, _), table in zip(prefills, tables)
            ]
            batch = AttentionBatch(self.kv_cache, slot_mapping, decode_groups, spans)
        return ids, position_ids, batch, sample_index, merges

    def _needs_masks(self, chunk: ScheduledChunk) -> bool:
        """A prefill chunk whose image tokens attend both ways needs the reference path's explicit masks."""
        mm = chunk.request.mm
        return chunk.num_tokens > 1 and mm is not None and mm.atomic_units and bool(mm.units_in(chunk.start, chunk.end))

    def _features(
        self, chunk: ScheduledChunk, query_start: int, where: list[int], features: list[torch.Tensor]
    ) -> None:
        """Where this chunk's slice of vision features goes in the packed batch (placeholder positions)."""
        mm = chunk.request.mm
        first_row, end_row = mm.rows_in(chunk.start, chunk.end)
        for unit in mm.units_in(chunk.start, chunk.end):
            unit_start = mm.unit_row_starts[unit]
            lo = max(first_row, unit_start)
            hi = min(end_row, unit_start + mm.unit_rows[unit])
            where.extend(p - chunk.start + query_start for p in mm.placeholder_positions[lo:hi])
            features.append(self.encoder_cache[(chunk.request.request_id, unit)][lo - unit_start : hi - unit_start])

    def _decode_groups(self, decodes: list[tuple[int, int, list[int]]]) -> list[list[tuple[int, int, list[int]]]]:
        """Decodes in padded batches, longest contexts first; a sequence starts a new batch when joining would
        make the batch's padded keys more than `PADDED_KEYS_LIMIT` times its real ones (one long context among
        short ones would otherwise have every short one read as many keys as it)."""
        groups: list[list[tuple[int, int, list[int]]]] = []
        total = 0
        for decode in sorted(decodes, key=lambda d: d[1], reverse=True):
            group = groups[-1] if groups else []
            longest = group[0][1] if group else 0
            if group and (len(group) + 1) * longest <= PADDED_KEYS_LIMIT * (total + decode[1]):
                group.append(decode)
                total += decode[1]
            else:
                groups.append([decode])
                total = decode[1]
        return groups

    def _decode_group(self, query_index: torch.Tensor, context_lens: torch.Tensor, tables: torch.Tensor) -> DecodeGroup:
        """A decode batch's masks from its context lengths: key k is real for a sequence of context n when k < n,
        and in a sliding-window layer when also k > n - 1 - window. The CPU kernel takes the lengths instead."""
        if self.attention_backend == "cpu":
            return DecodeGroup(query_index, tables, None, context_lens=context_lens)
        keys = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        mask = keys < context_lens[:, None]
        sliding_mask = None
        if self.adapter.sliding_window is not None:
            sliding_mask = (mask & (keys > context_lens[:, None] - 1 - self.adapter.sliding_window))[:, None, None]
        return DecodeGroup(query_index, tables, mask[:, None, None], sliding_mask)

    def _prefill_masks(self, chunk: ScheduledChunk) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Which keys each query of a prefill chunk sees: causally the positions up to its own, and where image
        tokens attend both ways (`atomic_units`, whose spans a chunk holds whole) every token of its own
        image too. None for plain causal attention over a chunk that starts the sequence. Then the same
        within the sliding window, for models with sliding-window layers (None otherwise)."""
        start, end, mm = chunk.start, chunk.end, chunk.request.mm
        images = mm.units_in(start, end) if mm is not None and mm.atomic_units else []
        window = self.adapter.sliding_window
        plain_causal = start == 0 and not images
        if plain_causal and window is None:
            return None, None
        mask = torch.ones(chunk.num_tokens, end, dtype=torch.bool, device=self.device).tril(start)
        for unit in images:
            first, last = mm.unit_first_position(unit), mm.unit_last_position(unit) + 1
            mask[max(first, start) - start : last - start, first:last] = True
        sliding_mask = None
        if window is not None:
            queries = torch.arange(start, end, device=self.device)[:, None]
            sliding_mask = mask & (torch.arange(end, device=self.device)[None, :] > queries - window)
        return (None if plain_causal else mask), sliding_mask

    # -- the vision encoder ---------------------------------------------------------------------
    def _encode(self, work: list[EncoderWork]) -> None:
        """Whole towers in one call, as transformers runs them; slices batched by slice range, each input
        resuming from the state its previous slices left in the encoder cache."""
        began = time.perf_counter()
        shared = self.encoder_outputs
        groups: dict[tuple[int, int] | None, list[EncoderWork]] = defaultdict(list)
        for item in work:  # features found in the shared cache first: nothing encoded below can drop them
            if item.from_cache:
                key = item.request.mm.unit_hashes[item.unit]
                self.encoder_cache[(item.request.request_id, item.unit)] = shared.get(key)
        work = [item for item in work if not item.from_cache]
        for item in work:
            groups[None if item.first == 0 and item.finishes else (item.first, item.end)].append(item)
        for key, items in groups.items():
            inputs = [item.request.mm.encoder_inputs[item.unit] for item in items]
            if key is None:
                results = self.adapter.encode(inputs)
            else:
                states = [self.encoder_cache.get((item.request.request_id, item.unit)) for item in items]
                results = self.adapter.encode_slices(inputs, states, *key)
            for item, result in zip(items, results):
                self.encoder_cache[(item.request.request_id, item.unit)] = result
                if shared is not None and item.finishes and item.request.mm.unit_hashes:
                    shared.put(item.request.mm.unit_hashes[item.unit], result)
        self.encoder_inputs_encoded += sum(item.finishes for item in work)
        self.encoder_slices_run += sum(item.end - item.first for item in work)
        self.encoder_seconds += time.perf_counter() - began


def cache_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 of a request, a block's run at a time."""
    slots: list[int] = []
    position = start
    while position < end:
        block, offset = divmod(position, block_size)
        run = min(block_size - offset, end - position)
        base = block_ids[block] * block_size + offset
        slots.extend(range(base, base + run))
        position += run
    return slots


def _padded(blocks: list[int], width: int) -> list[int]:
    return blocks + [0] * (width - len(blocks))
