"""The output processor: what each token a step appends to a request becomes (as vLLM v1's `OutputProcessor`, at
this engine's size): stop checks, text, and the `RequestOutput`s `Engine.step` returns.

The rule, for every token appended to a request, sampled or forced by its grammar (jump-forward): the request's
grammar must accept it, else the request fails ("error"); then it stops ("stop") on an end-of-sequence token
(unless `ignore_eos`), a stop token id or a grammar that terminated, else ends ("length") at `max_tokens` or a full
context; its text is detokenized incrementally (engine/detokenizer.py), and a stop string found there stops it too.
A request that stops is finished in the scheduler and leaves the engine's `requests`; its output is the last one
and carries its image embeddings where it asked for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling import draw_as_sampled
from engine.scheduler import Scheduler
from engine.scheduler_output import EncoderWork

if TYPE_CHECKING:
    from engine.model_runner import ModelRunnerOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    """Applies the rule above to the engine's `requests` (the engine's own dict: finished ones are removed from it),
    and keeps the output counters and the image embeddings requests asked for."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], eos_token_ids: set[int],
                 device: torch.device) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.num_generated_tokens = 0
        self.num_request_failures = 0  # requests ended alone because their token could not be sampled
        self.num_forced_tokens = 0  # output tokens appended by jump-forward, without sampling
        # Per request asking for its images' embeddings (`embed_images`): each encoder input's, once encoded.
        self.image_embeddings: dict[str, list[list[float] | None]] = {}

    def step_outputs(self, result: ModelRunnerOutput, step: int, jump_forward: bool) -> list[RequestOutput]:
        """The outputs of step number `step`: its sampled tokens (already appended by `Scheduler.update`), the forced
        tokens after them where `jump_forward` (`EngineConfig.jump_forward`), and the requests whose token could not
        be sampled (only those end; the others keep their tokens)."""
        for rid, scored in result.prompt_logprobs.items():
            self.requests[rid].prompt_logprobs.extend(scored)
        self.num_generated_tokens += len(result.sampled)
        outputs = [self._advance(self.requests[rid]) for rid in result.sampled]
        for output in outputs:
            if output.request_id in result.logprobs:
                output.new_logprobs = [result.logprobs[output.request_id]]
        if jump_forward:
            self._jump_forward(outputs)
        for rid, why in result.failed.items():
            self.num_request_failures += 1
            log.error("request %s failed in step %d: %s", rid, step, why)
            outputs.append(self.fail(self.requests[rid]))
        return outputs

    def fail(self, request: Request) -> RequestOutput:
        """End `request` with "error"."""
        self.scheduler.finish(request, "error")
        self.requests.pop(request.request_id, None)
        return self.output(request)

    def output(self, request: Request) -> RequestOutput:
        first = request.sampling.prompt_logprobs is not None and len(request.output_token_ids) == 1
        return RequestOutput(
            request_id=request.request_id,
            token_ids=list(request.output_token_ids),
            text=request.text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_token_ids=request.prompt_token_ids,
            image_embeddings=self.image_embeddings.pop(request.request_id, None) if request.is_finished else None,
            prompt_logprobs=[None, *request.prompt_logprobs] if first else None,
        )

    def pool_features(self, work: list[EncoderWork], features: dict[tuple[str, int], torch.Tensor]) -> None:
        """The features of each encoder input finished this step, pooled, for the requests that asked for them."""
        if not self.image_embeddings:
            return
        from engine.embeddings import pooled

        for encoding in work:
            slots = self.image_embeddings.get(encoding.request_id)
            encoded = features.get(encoding.key)
            if slots is not None and encoded is not None and (encoding.finishes or encoding.from_cache):
                slots[encoding.index] = pooled([encoded])

    def _advance(self, request: Request) -> RequestOutput:
        matcher = request.matcher
        if matcher is not None and not matcher.accept(request.output_token_ids[-1]):
            # The runner masks a constrained row before sampling, so a token outside the grammar is a fault.
            self.num_request_failures += 1
            token = request.output_token_ids[-1]
            log.error("request %s sampled token %d outside its grammar", request.request_id, token)
            return self.fail(request)
        self._conclude(request)
        return self.output(request)

    def _jump_forward(self, outputs: list[RequestOutput]) -> None:
        """Jump-forward (`EngineConfig.jump_forward`): while the grammar of a request that just gained a token allows
        exactly one next token (engine/grammar.py `forced_tokens`, which also keeps the masks for the next step's
        sampling), append it as if sampled (a seeded request's random stream drawn as the sampler would have) and
        apply the same rule; the run is computed with the next step's chunk. Not for requests that ask for
        logprobs, nor a token that min_tokens holds back (sampling would fail such a request: it still does)."""
        from engine.grammar import forced_tokens

        by_id = {output.request_id: output for output in outputs}
        live = [self.requests[rid] for rid, output in by_id.items() if not output.finished]
        live = [r for r in live if r.matcher is not None and r.sampling.logprobs is None]
        while live:
            going = []
            for request, token in zip(live, forced_tokens([r.matcher for r in live])):
                params = request.sampling
                if token is None or (token in params.min_tokens_suppressed
                                     and len(request.output_token_ids) < params.min_tokens):
                    continue
                request.output_token_ids.append(token)
                request.num_forced += 1
                self.num_generated_tokens += 1
                self.num_forced_tokens += 1
                if request.generator is not None:  # the sampler's draws for the token (engine/sampling.py)
                    draw_as_sampled(request.generator, self.device)
                output = by_id[request.request_id]
                if not request.matcher.accept(token):  # cannot happen: the grammar allows it
                    by_id[request.request_id] = self.fail(request)
                    continue
                self._conclude(request)
                output.token_ids, output.text = list(request.output_token_ids), request.text
                output.finished, output.finish_reason = request.is_finished, request.finish_reason
                if request.is_finished:
                    output.image_embeddings = self.image_embeddings.pop(request.request_id, None)
                else:
                    going.append(request)
            live = going
        outputs[:] = list(by_id.values())

    def _conclude(self, request: Request) -> None:
        """After a token was appended and its grammar accepted it: the stop conditions and the text; a request that
        ends is finished."""
        params = request.sampling
        matcher = request.matcher
        reason = None
        last = request.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            reason = "stop"
        elif matcher is not None and matcher.is_terminated:
            reason = "stop"
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_total_tokens:
            reason = "length"
        text, hit_stop = request.detokenizer.update(request.output_token_ids, reason is not None)
        if hit_stop:
            reason = "stop"
        request.text = text
        if reason is not None:
            self.scheduler.finish(request, reason)
            del self.requests[request.request_id]
