"""The model runner executes what the scheduler chose: it runs the vision encoder on the chosen inputs,
packs every chunk of the step into one flat batch, runs the text model once, and samples one token for
each request whose chunk reached its last token."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from engine.attention import AttentionBatch, DecodeGroup, PrefillSpan
from engine.kv_cache import KVCache
from engine.models.base import VLMAdapter
from engine.sampling import sample
from engine.scheduler import EncoderWork, ScheduledChunk, SchedulerOutput

# A decode batch's padded keys may be at most this many times its real ones (see `_decode_groups`).
PADDED_KEYS_LIMIT = 1.5


class ModelRunner:
    def __init__(self, adapter: VLMAdapter, kv_cache: KVCache, block_size: int) -> None:
        self.adapter = adapter
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = adapter.device
        self.encoder_cache: dict[tuple[str, int], torch.Tensor] = {}
        self.encoder_inputs_encoded = 0  # inputs whose tower ran to the end
        self.encoder_slices_run = 0  # slices of the tower run (a whole tower counts as all of its slices)
        self.encoder_seconds = 0.0

    def drop_encoder_outputs(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            self.encoder_cache.pop(key, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        if out.encoder_work:
            self._encode(out.encoder_work)
        if not out.chunks:
            return {}
        token_ids, rope_positions, slot_mapping = [], [], []
        decodes: list[tuple[int, int, list[int]]] = []  # (query index, context length, block ids)
        prefills = []
        sample_rows: list[tuple[int, ScheduledChunk]] = []
        for chunk in out.chunks:
            request = chunk.request
            query_start = len(token_ids)
            token_ids.extend(request.token_at(p) for p in range(chunk.start, chunk.end))
            rope_positions.append(self.adapter.rope_positions(request, chunk.start, chunk.end))
            slot_mapping.append(self._slots(request.block_ids, chunk.start, chunk.end))
            blocks = request.block_ids[: -(-chunk.end // self.block_size)]
            if chunk.num_tokens == 1:  # a single query sees every cached key: batch it with the decodes
                decodes.append((query_start, chunk.end, blocks))
            else:
                table = torch.tensor(blocks, device=self.device)
                prefills.append(PrefillSpan(query_start, len(token_ids), table, chunk.end, *self._prefill_masks(chunk)))
            if chunk.samples:
                sample_rows.append((len(token_ids) - 1, chunk))

        ids = torch.tensor(token_ids, device=self.device)
        embeds = self.adapter.embed_tokens(ids)
        self._merge_encoder_outputs(out.chunks, embeds)
        batch = AttentionBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat(slot_mapping),
            decodes=self._decode_groups(decodes),
            prefills=prefills,
        )
        hidden = self.adapter.forward_text(embeds, torch.cat(rope_positions, dim=-1).to(self.device), batch)
        if not sample_rows:
            return {}
        rows = torch.tensor([row for row, _ in sample_rows], device=self.device)
        logits = self.adapter.lm_head(hidden[rows]).float()
        return {
            chunk.request.request_id: sample(logits[i], chunk.request.sampling, chunk.request.generator)
            for i, (_, chunk) in enumerate(sample_rows)
        }

    def _decode_groups(self, decodes: list[tuple[int, int, list[int]]]) -> list[DecodeGroup]:
        """Decodes in padded batches, longest contexts first; a sequence starts a new batch when joining would
        make the batch's padded keys more than `PADDED_KEYS_LIMIT` times its real ones (one long context among
        short ones would otherwise have every short one read as many keys as it)."""
        groups: list[list[tuple[int, int, list[int]]]] = []
        for decode in sorted(decodes, key=lambda d: d[1], reverse=True):
            group = groups[-1] if groups else []
            longest = group[0][1] if group else 0
            if group and (len(group) + 1) * longest <= PADDED_KEYS_LIMIT * (sum(d[1] for d in group) + decode[1]):
                group.append(decode)
            else:
                groups.append([decode])
        return [self._decode_group(group) for group in groups]

    def _decode_group(self, group: list[tuple[int, int, list[int]]]) -> DecodeGroup:
        width = max(len(blocks) for _, _, blocks in group)
        tables = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(group), 1, 1, width * self.block_size, dtype=torch.bool, device=self.device)
        for i, (_, context_len, blocks) in enumerate(group):
            tables[i, : len(blocks)] = torch.tensor(blocks, device=self.device)
            mask[i, ..., :context_len] = True
        sliding_mask = None
        if self.adapter.sliding_window is not None:
            # The query is at position context_len - 1: keys back to context_len - window.
            query_positions = torch.tensor([context_len - 1 for _, context_len, _ in group], device=self.device)
            keys = torch.arange(mask.shape[-1], device=self.device)
            sliding_mask = mask & (keys > query_positions[:, None] - self.adapter.sliding_window)[:, None, None]
        query_index = torch.tensor([index for index, _, _ in group], device=self.device)
        return DecodeGroup(query_index, tables, mask, sliding_mask)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions start..end-1 of a request."""
        positions = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_ids, device=self.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

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

    def _encode(self, work: list[EncoderWork]) -> None:
        """Whole towers in one call, as transformers runs them; slices batched by slice range, each input
        resuming from the state its previous slices left in the encoder cache."""
        began = time.perf_counter()
        groups: dict[tuple[int, int] | None, list[EncoderWork]] = defaultdict(list)
        for item in work:
            groups[None if item.first == 0 and item.finishes else (item.first, item.end)].append(item)
        for key, items in groups.items():
            inputs = [item.request.mm.encoder_inputs[item.unit] for item in items]
            if key is None:
                results = self.adapter.encode(inputs)
            else:
                states = [self.encoder_cache.get((item.request.request_id, item.unit)) for item in items]
                results = self.adapter.encode_stages(inputs, states, *key)
            for item, result in zip(items, results):
                self.encoder_cache[(item.request.request_id, item.unit)] = result
        self.encoder_inputs_encoded += sum(item.finishes for item in work)
        self.encoder_slices_run += sum(item.end - item.first for item in work)
        self.encoder_seconds += time.perf_counter() - began

    def _merge_encoder_outputs(self, chunks: list[ScheduledChunk], embeds: torch.Tensor) -> None:
        """Put each chunk's slice of vision features where its placeholder tokens are."""
        query_start = 0
        for chunk in chunks:
            mm = chunk.request.mm
            if mm is not None:
                first_row, end_row = mm.rows_in(chunk.start, chunk.end)
                for unit in mm.units_in(chunk.start, chunk.end):
                    unit_start = mm.unit_row_starts[unit]
                    lo = max(first_row, unit_start)
                    hi = min(end_row, unit_start + mm.unit_rows[unit])
                    positions = torch.tensor(mm.placeholder_positions[lo:hi], device=self.device)
                    where = positions - chunk.start + query_start
                    feature = self.encoder_cache[(chunk.request.request_id, unit)]
                    embeds[where] = feature[lo - unit_start : hi - unit_start].to(embeds.dtype)
            query_start += chunk.num_tokens
