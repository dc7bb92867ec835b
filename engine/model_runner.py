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

from engine.attention_backends import BACKENDS, ChunkLayout, IntPacker, ReferenceBackend
from engine.encoder_cache import EncoderOutputCache
from engine.kv_cache import KVCache
from engine.models.base import VLMAdapter
from engine.outputs import StepTimings
from engine.sampling import TokenLogprobs, host_tensor, prompt_token_logprobs, sample
from engine.scheduler_output import EncoderWork, ScheduledChunk, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> its next token
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why no token could be sampled
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of the sampled token, requests that ask
    # Scores of the prompt tokens after each chunk's scored positions (ScheduledChunk.scoring), in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class Uploader:
    """One host tensor a step to the device: through a reused pinned buffer and a non-blocking copy on CUDA
    (the buffer is rewritten only after the previous copy from it has finished), as is on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def upload(self, values: list[int]) -> torch.Tensor:
        host = host_tensor(values, torch.long)
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
        # That backend builds each step's attention metadata; steps whose chunks need explicit masks take the
        # reference's (engine/attention_backends.py).
        parts = (kv_cache, block_size, self.device, adapter.sliding_window, adapter.num_heads)
        self.backend = BACKENDS[attention_backend](*parts)
        self.masked_backend = ReferenceBackend(*parts)
        self.uploader = Uploader(self.device)
        self.graphs = None  # engine/cuda_graphs.DecodeGraphs, set by the engine when it captures them
        self.encoder_outputs = encoder_outputs  # features shared across requests (engine/encoder_cache.py)
        # Per request and encoder input: its features, or its tower's state between slices, until the chunks pass it.
        self.encoder_features: dict[tuple[str, int], torch.Tensor] = {}
        self.encoder_inputs_encoded = 0  # inputs whose tower ran to the end
        self.encoder_slices_run = 0  # slices of the tower run (a whole tower counts as all of its slices)
        self.encoder_seconds = 0.0
        self.timings = StepTimings()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        timings = self.timings = StepTimings()
        began = time.perf_counter()
        for key in out.freed_encoder_inputs:
            self.encoder_features.pop(key, None)
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
            embeds = None
            if merges is not None:
                embeds = self.adapter.embed_tokens(ids)
                where, features = merges
                embeds[where] = torch.cat(features).to(embeds.dtype)
            run_at = time.perf_counter()
            timings.prepare = run_at - prepared
            if embeds is None:  # the embeddings' rows gathered where the forward can (the lean layers' one call)
                hidden = self.adapter.forward_tokens(ids, positions, batch)
            else:
                hidden = self.adapter.forward_text(embeds, positions, batch)
            rows = hidden if sample_index is None else hidden[sample_index]
            logits = self.adapter.lm_head(rows) if sampled_chunks else None  # `sample` takes bfloat16 as it is
        forwarded = time.perf_counter()
        timings.forward = forwarded - run_at
        result = ModelRunnerOutput()
        if graph is None:
            self._score_prompts(out.chunks, hidden, result)
        if sampled_chunks:
            inputs = [chunk.sample for chunk in sampled_chunks]
            if any(s.matcher is not None for s in inputs):
                from engine.grammar import apply_token_masks

                logits = logits.float()  # xgrammar's masks take float32
                apply_token_masks(logits, [s.matcher for s in inputs])
            histories = [(s.prompt_ids, s.output_token_ids) for s in inputs]
            tokens, failed, logprobs = sample(logits, [s.sampling for s in inputs], [s.generator for s in inputs],
                                              histories)
            for row, token_logprobs in logprobs.items():
                result.logprobs[sampled_chunks[row].request_id] = token_logprobs
            for chunk, token, bad in zip(sampled_chunks, tokens, failed):
                if bad:
                    result.failed[chunk.request_id] = "the sampling distribution had no finite probability mass"
                else:
                    result.sampled[chunk.request_id] = token
        timings.sample = time.perf_counter() - forwarded
        return result

    def _score_prompts(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """The lm head over the prompt positions that chunks score (only theirs), as their tokens' log-probabilities."""
        query_start = 0
        for chunk in chunks:
            scoring = chunk.scoring
            if scoring is not None:
                rows = hidden[query_start + scoring.first - chunk.start : query_start + scoring.end - chunk.start]
                result.prompt_logprobs[chunk.request_id] = prompt_token_logprobs(
                    rows, self.adapter.lm_head, scoring.targets, scoring.top)
            query_start += chunk.num_tokens

    # -- the step's inputs ----------------------------------------------------------------------
    def _prepare(self, chunks: list[ScheduledChunk]):
        """Token ids, positions, attention metadata (engine/attention_backends.py), the rows to sample (None: every
        row, in order) and the encoder features to merge, from one upload."""
        bs = self.block_size
        packer = IntPacker()
        streams = self.adapter.rope_streams or 1
        token_ids: list[int] = []
        slots: list[int] = []
        positions: list[list[int]] = [[] for _ in range(streams)]
        samples: list[int] = []
        layouts: list[ChunkLayout] = []
        where: list[int] = []
        features: list[torch.Tensor] = []
        for chunk in chunks:
            start, end = chunk.start, chunk.end
            query_start = len(token_ids)
            token_ids.extend(chunk.token_ids)
            for stream, values in zip(positions, self.adapter.rope_positions(chunk.mm, chunk.num_prompt_tokens, start,
                                                                             end)):
                stream.extend(values)
            slots.extend(cache_slots(chunk.block_ids, start, end, bs))
            layouts.append(ChunkLayout(query_start, chunk, chunk.block_ids))
            if chunk.samples:
                samples.append(len(token_ids) - 1)
            if chunk.mm is not None:
                self._features(chunk, query_start, where, features)

        at_ids = packer.take(token_ids)
        at_slots = packer.take(slots)
        at_positions = [packer.take(stream) for stream in positions]
        at_samples = packer.take(samples)
        at_where = packer.take(where)
        builder = self.backend if self.backend.accepts(chunks) else self.masked_backend
        reserved = builder.reserve(layouts, len(token_ids), packer)

        values = self.uploader.upload(packer.values)
        ids = values[at_ids]
        slot_mapping = values[at_slots]
        position_ids = torch.stack([values[s] for s in at_positions]) if streams > 1 else values[at_positions[0]]
        # every row samples only where every chunk is one token (a step of decodes): no gather of the rows then
        sample_index = None if len(samples) == len(token_ids) else values[at_samples]
        merges = (values[at_where], features) if features else None
        return ids, position_ids, builder.build(reserved, values, slot_mapping), sample_index, merges

    def _features(
        self, chunk: ScheduledChunk, query_start: int, where: list[int], features: list[torch.Tensor]
    ) -> None:
        """Where this chunk's slice of vision features goes in the packed batch (placeholder positions)."""
        mm = chunk.mm
        first_row, end_row = mm.rows_in(chunk.start, chunk.end)
        for index in mm.inputs_in(chunk.start, chunk.end):
            row_start = mm.input_row_starts[index]
            lo = max(first_row, row_start)
            hi = min(end_row, row_start + mm.input_rows[index])
            where.extend(p - chunk.start + query_start for p in mm.placeholder_positions[lo:hi])
            features.append(self.encoder_features[(chunk.request_id, index)][lo - row_start : hi - row_start])

    # -- the vision encoder ---------------------------------------------------------------------
    def _encode(self, work: list[EncoderWork]) -> None:
        """Whole towers in one call, as transformers runs them; slices batched by slice range, each input
        resuming from the state its previous slices left in `encoder_features`."""
        began = time.perf_counter()
        shared = self.encoder_outputs
        groups: dict[tuple[int, int] | None, list[EncoderWork]] = defaultdict(list)
        for encoding in work:  # features found in the shared cache first: nothing encoded below can drop them
            if encoding.from_cache:
                self.encoder_features[encoding.key] = shared.get(encoding.mm.input_hashes[encoding.index])
        work = [encoding for encoding in work if not encoding.from_cache]
        for encoding in work:
            whole = encoding.first == 0 and encoding.finishes
            groups[None if whole else (encoding.first, encoding.end)].append(encoding)
        for key, encodings in groups.items():
            inputs = [encoding.mm.encoder_inputs[encoding.index] for encoding in encodings]
            if key is None:
                results = self.adapter.encode(inputs)
            else:
                states = [self.encoder_features.get(encoding.key) for encoding in encodings]
                results = self.adapter.encode_slices(inputs, states, *key)
            for encoding, result in zip(encodings, results):
                self.encoder_features[encoding.key] = result
                if shared is not None and encoding.finishes and encoding.mm.input_hashes:
                    shared.put(encoding.mm.input_hashes[encoding.index], result)
        self.encoder_inputs_encoded += sum(encoding.finishes for encoding in work)
        self.encoder_slices_run += sum(encoding.end - encoding.first for encoding in work)
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

