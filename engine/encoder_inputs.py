"""The state of every request's encoder inputs, on the scheduler's side, in one place (`EncoderInputs`).

An encoder input (docs/glossary.md: a SmolVLM tile, a Qwen2-VL, LLaVA or Gemma 3 image) goes through: not
started; some slices of its tower run (the runner holds the tower's state between steps); finished (the runner
holds its features, or the encoder output cache does); freed (every chunk has passed its placeholders, or its
request ended or was preempted). This object records, per request and input, how many slices have run, and
which inputs the runner should drop, and answers whether an input's features can be taken from the shared
encoder output cache.

Progress is committed in `commit`, called by `Scheduler.update` with the step's tokens, after the runner ran the
step: a step that fails commits nothing, so what is recorded is always what the runner holds. The tensors
themselves stay in the runner (`ModelRunner.encoder_features`), which drops those `take_freed` lists (they come
to it in the next `SchedulerOutput`).
"""

from __future__ import annotations

from engine.encoder_cache import EncoderOutputCache
from engine.request import MultimodalPrompt, Request
from engine.scheduler_output import EncoderWork


class EncoderInputs:
    def __init__(self, shared: EncoderOutputCache | None = None) -> None:
        self.shared = shared  # features shared across requests by content (engine/encoder_cache.py)
        # Per request, the encoder inputs whose state or features the runner holds, and the slices run.
        self.progress: dict[str, dict[int, int]] = {}
        self._freed: list[tuple[str, int]] = []  # (request id, input) for the runner to drop

    def slices_done(self, request_id: str, index: int) -> int:
        """How many slices of input `index`'s tower have run (its features are ready at `encoder_slices`)."""
        return self.progress.get(request_id, {}).get(index, 0)

    def held(self, request: Request, index: int) -> bool:
        """The input's features are in the encoder output cache and its tower has not started."""
        shared = self.shared
        return (shared is not None and bool(request.mm.input_hashes) and request.mm.input_hashes[index] in shared
                and self.slices_done(request.request_id, index) == 0)

    def unfinished(self, request: Request, start: int, end: int) -> list[int]:
        """Encoder inputs with placeholders in prompt positions [start, end) whose features are not ready yet."""
        if request.mm is None or end <= start:
            return []
        progress = self.progress.get(request.request_id, {})
        slices = request.mm.encoder_slices
        return [i for i in request.mm.inputs_in(start, end) if progress.get(i, 0) < slices]

    def commit(self, work: list[EncoderWork], live: dict[str, Request]) -> None:
        """Record the slices a step ran (the runner has their results), for requests still `live`."""
        for item in work:
            if item.request_id in live:
                self.progress.setdefault(item.request_id, {})[item.index] = item.end

    def passed(self, request_id: str, mm: MultimodalPrompt, computed: int) -> None:
        """Free the inputs of a request whose every placeholder lies before position `computed`."""
        progress = self.progress.get(request_id)
        if progress:
            for index in sorted(i for i in progress if mm.input_last_position(i) < computed):
                del progress[index]
                self._freed.append((request_id, index))

    def release(self, request_id: str) -> None:
        """Free every input of a request that ended or was preempted."""
        for index in sorted(self.progress.pop(request_id, ())):
            self._freed.append((request_id, index))

    def take_freed(self) -> list[tuple[str, int]]:
        """The inputs freed since the last call, for the runner to drop."""
        freed, self._freed = self._freed, []
        return freed
