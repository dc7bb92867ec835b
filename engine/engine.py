"""The engine: requests in, tokens out, one `step()` at a time.

`add_request` validates and preprocesses a request (template, tokens, image tiles) without holding the
engine's lock, so callers on other threads can add work while a step runs. `step` schedules, runs one
forward and hands what it sampled to the output processor (engine/output_processor.py: stop checks, text,
outputs).
"""

from __future__ import annotations

import inspect
import io
import itertools
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine.block_hash import MAX_CACHE_SALT, add_input_hashes
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.encoder_cache import EncoderOutputCache
from engine.grammar import GrammarCompiler, GrammarSpec, Matcher
from engine.kv_cache import BlockPool, KVCache
from engine.model_runner import ModelRunner
from engine.models import load_adapter
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput, StepTimings
from engine.platform import Platform
from engine.request import Preprocessed, Request
from engine.sampling import SamplingParams, make_generator
from engine.scheduler import Scheduler
from engine.step_costs import DEFAULT_ITL_TARGET_MS, StepCosts
from engine.video import VideoInput, VideoSampling, as_video

log = logging.getLogger(__name__)

ImageInput = Image.Image | bytes | bytearray | str | os.PathLike
# Where transformers' VLM configs name the token ids their image and video features fill.
PLACEHOLDER_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _load_image(image: ImageInput, index: int) -> Image.Image:
    """An RGB image from a Pillow image, encoded bytes or a file. Encoded images whose decode can be slow
    (progressive JPEGs, large or other formats: engine/media_box.py `decodes_inline`) are decoded in the media box,
    under its deadline and memory limit; its refusals are ValueErrors naming the image."""
    from engine.media_box import decodes_inline, default_box

    where = f"image {index}"
    try:
        if isinstance(image, Image.Image):
            image.load()
            return image.convert("RGB")
        if isinstance(image, (bytes, bytearray)):
            data = bytes(image)
        elif isinstance(image, (str, os.PathLike)):
            data = Path(image).read_bytes()
        else:
            raise ValueError(f"{where} has unsupported type {type(image).__name__}")
        with Image.open(io.BytesIO(data)) as opened:  # the header only
            if not decodes_inline(opened, data):
                return default_box().decode_image(data, where=where)
            opened.load()
            return opened.convert("RGB")
    except ValueError as exc:  # kept as raised (the box's MediaLimitError names its limit), naming the image
        if not str(exc).startswith(where):
            exc.args = (f"{where} could not be read: {exc}",)
        raise
    except Exception as exc:  # PIL raises many types for bad data, and plugins add their own
        raise ValueError(f"{where} could not be read: {type(exc).__name__}: {exc}") from exc


class Engine:
    """One model served: `add_request` / `step` / `abort` run requests; `embed` gives embeddings from the model's own
    tower; and what a server needs to know of the model without reaching into its adapter: `tokenize`,
    `user_prompt`, `render_messages`, `has_chat_template` / `chat_template`, `single_input_options`, `tiling_options`,
    `takes_videos`, `model_family`, `vocab_size`, `max_model_len`, `tokenizer`, `grammars`, `stats`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.num_threads = torch.get_num_threads()  # what the thread that runs the steps should use
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.platform = Platform(config, self.device)  # engine/platform.py: how the model runs on this device
        self.adapter = load_adapter(config.model, self.device, config.torch_dtype, config.chat_template,
                                    config.quantization)
        self.tokenizer = self.adapter.tokenizer
        self.eos_token_ids = self.adapter.eos_token_ids

        num_blocks = self._num_kv_blocks()
        model_limit = self.adapter.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's limit of {model_limit} positions"
            )
        self.max_model_len = config.max_model_len or model_limit
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv_cache = KVCache(
            self.adapter.num_layers, num_blocks, config.block_size, self.adapter.num_kv_heads,
            self.adapter.head_dim, config.torch_dtype, self.device, config.kv_cache_dtype,
        )
        self.encoder_outputs = (
            EncoderOutputCache(config.encoder_cache_tokens)
            if config.enable_prefix_caching and config.encoder_cache_tokens else None
        )
        self.step_costs = self._step_costs()
        self.scheduler = Scheduler(config, self.pool, self.encoder_outputs, self.step_costs)
        self.platform.prepare(self.adapter)
        self.compile_seconds = 0.0
        if config.compile_model:
            if self.device.type != "cpu":
                raise ValueError(f"compile_model runs on the CPU (device {config.device!r}); on CUDA the decode "
                                 "graphs take the per-operator overhead away")
            from engine.compiled import compile_text_model

            self.compile_seconds = compile_text_model(self.adapter, self.kv_cache, config.block_size)
            log.info("compiled the text model's decoder layers in %.1f s", self.compile_seconds)
        self.runner = ModelRunner(self.adapter, self.kv_cache, config.block_size, self.attention_backend,
                                  self.encoder_outputs)
        if self.platform.use_cuda_graphs():
            from engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs.capture(self.runner, config.max_num_seqs, self.max_model_len)
        if self.step_costs is not None:
            from engine.calibration import calibrate

            calibrate(self.step_costs, config, self.pool, self.runner, self.max_model_len,
                      self.tokenizer.eos_token_id or 0)
        self.platform.started()
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._lock = threading.RLock()  # held by a step; `enqueue` does not wait for it (`_incoming`)
        self._incoming: dict[str, Preprocessed] = {}  # queued while a step ran: in the next step, in this order
        self._incoming_lock = threading.Lock()
        self._steps = 0
        self._last_step_num_tokens = 0
        self.num_step_failures = 0  # steps whose forward raised (their requests ended with "error")
        self.output_processor = OutputProcessor(self.scheduler, self.requests, self.eos_token_ids, self.device)
        self.last_step_timings = StepTimings()
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._grammars_lock = threading.Lock()

    # The output processor's counters and held embeddings (engine/output_processor.py).
    @property
    def num_request_failures(self) -> int:
        return self.output_processor.num_request_failures

    @property
    def num_forced_tokens(self) -> int:
        return self.output_processor.num_forced_tokens

    @property
    def _image_embeddings(self) -> dict[str, list[list[float] | None]]:
        return self.output_processor.image_embeddings

    # The platform's choices (engine/platform.py), as the engine has always reported them.
    @property
    def attention_backend(self) -> str:
        return self.platform.attention_backend

    @property
    def cpu_linear(self) -> bool:
        return self.platform.cpu_linear

    @property
    def cpu_kernels(self) -> str | None:
        return self.platform.cpu_kernels

    @property
    def cpu_bf16_products(self) -> str | None:
        return self.platform.cpu_bf16_products

    @property
    def linear_rows(self) -> dict[str, tuple[int, int]]:
        return self.platform.linear_rows

    @property
    def lean_vision_layers(self) -> int:
        return self.platform.lean_vision_layers

    def _step_costs(self) -> StepCosts | None:
        """The step cost model for the inter-token-latency target (None: steps budgeted by tokens only)."""
        target = self.config.itl_target_ms
        if target is None:
            target = DEFAULT_ITL_TARGET_MS.get(self.device.type, DEFAULT_ITL_TARGET_MS["cuda"])
        return StepCosts(target / 1e3) if target else None

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = KVCache.bytes_per_block(
            self.adapter.num_layers, config.block_size, self.adapter.num_kv_heads, self.adapter.head_dim,
            config.torch_dtype, config.kv_cache_dtype,
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        by_memory = int(free * config.kv_cache_memory_fraction) // per_block
        max_len = config.max_model_len or self.adapter.max_position_embeddings
        by_use = config.max_num_seqs * -(-max_len // config.block_size)
        return max(1, min(by_memory, by_use))

    # -- requests -------------------------------------------------------------------------------
    def preprocess_request(
        self,
        prompt: str | None = None,
        images: list[ImageInput] | None = None,
        sampling: SamplingParams | None = None,
        priority: int = 0,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        videos: list[VideoInput] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
        embed_images: bool = False,
        itl_target_ms: float | None = None,
    ) -> Preprocessed:
        """A request checked and preprocessed (template, tokens, image tiles), not yet queued (`enqueue`): the
        first half of `add_request`, so that a caller can tell this torch work (safe on any thread, beside a step)
        from the queueing. Raises ValueError for a request that can never run.
        Give exactly one of `prompt` (text, with a marker per image and video), `messages` (rendered through the
        chat template) or `prompt_token_ids` (a text prompt already tokenized: taken as it is, no images).
        `cache_salt`: the request shares cached prefix blocks and image features only with requests of the same
        salt (engine/block_hash.py).
        `mm_processor_kwargs`: options for the model's processor that the family allows
        (`VLMAdapter.processor_options`; SmolVLM: `do_image_splitting`, and `size` as `tiling_options` gives it).
        `videos`: each a `engine.video.Video`, a list of frames (PIL images or arrays), or a file path or encoded
        bytes (read with OpenCV, frames sampled by `VideoSampling()`), one for each video marker of the prompt.
        `embed_images`: the finished output carries `image_embeddings`, each encoder input's features as this request's
        own steps computed them, pooled as `embed` pools an image's (engine/embeddings.py): the images' embeddings
        without a second run of the tower where each image is one encoder input (`single_input_options`).
        `itl_target_ms`: this request's own inter-token-latency target, held against less urgent work while it
        decodes (engine/scheduler.py: a fall alert's caption), where steps are budgeted by time."""
        if sum(given is not None for given in (prompt, messages, prompt_token_ids)) != 1:
            raise ValueError("give exactly one of prompt or messages (or prompt_token_ids)")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if itl_target_ms is not None and not (isinstance(itl_target_ms, (int, float)) and not isinstance(
                itl_target_ms, bool) and math.isfinite(itl_target_ms) and itl_target_ms > 0):
            raise ValueError(f"itl_target_ms must be a positive number of milliseconds or None, got {itl_target_ms!r}")
        if cache_salt is not None and not (isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got "
                             f"{str(cache_salt)[:80]!r}")
        if messages is not None:
            if not self.has_chat_template:
                self.render_messages(messages)  # its ValueError says what to send instead
            try:
                prompt = self.render_messages(messages)
            except Exception as exc:  # the template rejects malformed messages in many ways
                raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc
        vocab_size = self.vocab_size
        if prompt_token_ids is not None:
            self._check_token_ids(prompt_token_ids, vocab_size, images, videos)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
        if sampling.top_k > vocab_size:
            raise ValueError(f"top_k is {sampling.top_k}, over the model's vocabulary of {vocab_size} tokens "
                             "(0 or -1: all tokens)")
        if sampling.min_tokens:
            held = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
            sampling = replace(sampling, min_tokens_suppressed=tuple(sorted(held)))
        matcher = self._matcher(sampling.grammar) if sampling.grammar is not None else None
        if prompt_token_ids is not None:
            token_ids, mm = list(prompt_token_ids), None
        else:
            token_ids, mm = self._process(prompt, images, videos, mm_processor_kwargs)

        if mm is not None and self.config.enable_prefix_caching:
            add_input_hashes(mm, cache_salt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, at or above max_model_len {self.max_model_len}"
            )
        max_prompt_blocks = self.scheduler.kv_cache_manager.max_prompt_blocks()
        if self.pool.blocks_for(len(token_ids)) > max_prompt_blocks:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than the KV cache can ever hold "
                f"({max_prompt_blocks} blocks of {self.pool.block_size})"
            )
        request_id = request_id or uuid.uuid4().hex
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            priority=priority,
            arrival=next(self._arrivals),
            max_total_tokens=min(self.max_model_len, max_prompt_blocks * self.pool.block_size),
            mm=mm,
            generator=make_generator(sampling, self.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, sampling.stop),
            matcher=matcher,
            cache_salt=cache_salt,
            itl_target_ms=None if itl_target_ms is None else float(itl_target_ms),
        )
        return Preprocessed(request, embed_images)

    def add_request(self, *args: Any, **kwargs: Any) -> str:
        """Queue a request and return its id: `enqueue(preprocess_request(...))`, with `preprocess_request`'s
        arguments. Raises ValueError for a request that can never run."""
        return self.enqueue(self.preprocess_request(*args, **kwargs))

    add_request.__signature__ = inspect.signature(preprocess_request).replace(return_annotation="str")

    def enqueue(self, preprocessed: Preprocessed) -> str:
        """Queue a request `preprocess_request` made and return its id; raises ValueError if its id is in use. Never
        waits for a step in progress: a request queued meanwhile is taken in by the next step (or by `abort` and
        `stats`, which wait for it), so that a caller adding many requests is not held to one a step."""
        request_id = preprocessed.request.request_id
        with self._incoming_lock:
            if request_id in self.requests or request_id in self._incoming:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._incoming[request_id] = preprocessed
        if self._lock.acquire(blocking=False):  # no step in progress: in now
            try:
                self._take_incoming()
            finally:
                self._lock.release()
        return request_id

    def _take_incoming(self) -> None:
        """The requests queued since the last step into the scheduler's queue (held under `_lock`)."""
        with self._incoming_lock:
            incoming, self._incoming = self._incoming, {}
            for request_id, preprocessed in incoming.items():
                request = preprocessed.request
                self.requests[request_id] = request
                if preprocessed.embed_images:
                    inputs = request.mm.num_inputs if request.mm is not None else 0
                    self.output_processor.image_embeddings[request_id] = [None] * inputs
                self.scheduler.add(request)

    def _process(self, prompt: str, images: list[ImageInput] | None, videos: list[VideoInput] | None,
                 mm_processor_kwargs: dict[str, Any] | None) -> tuple[list[int], Any]:
        """A text prompt's token ids and its images' and videos' encoder inputs, as the model's processor gives them."""
        loaded = [_load_image(image, i) for i, image in enumerate(images or [])]
        markers = prompt.count(self.adapter.image_marker)
        if markers != len(loaded):
            raise ValueError(
                f"the prompt has {markers} {self.adapter.image_marker} marker(s) but {len(loaded)} image(s) were given"
            )
        clips = [as_video(video, f"video {i}", VideoSampling()) for i, video in enumerate(videos or [])]
        self._check_video_markers(prompt, clips)
        try:
            return self.adapter.process(prompt, loaded, clips, mm_processor_kwargs)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"the prompt and images could not be processed: {exc}") from exc

    def _check_token_ids(self, token_ids: Any, vocab_size: int, images: Any, videos: Any) -> None:
        """A tokenized prompt: a non-empty list of ids within the vocabulary, none of them an image's or a video's
        placeholder (their features come only with a text prompt's images and videos)."""
        if images or videos:
            raise ValueError("prompt_token_ids takes no images or videos: send a text prompt with their markers")
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError(f"prompt_token_ids must be a non-empty list of token ids, got {str(token_ids)[:80]!r}")
        config = self.adapter.model.config
        placeholders = {getattr(config, name) for name in PLACEHOLDER_TOKEN_FIELDS
                        if isinstance(getattr(config, name, None), int)}
        for index, token in enumerate(token_ids):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise ValueError(f"prompt_token_ids[{index}] is {token!r}, not a token id of the model's vocabulary "
                                 f"of {vocab_size}")
            if token in placeholders:
                raise ValueError(f"prompt_token_ids[{index}] is {token}, an image or video placeholder: send a text "
                                 "prompt with its images instead")

    def _check_video_markers(self, prompt: str, clips: list) -> None:
        """As many video markers as videos (a family without video refuses videos in `adapter.process`)."""
        marker = self.adapter.video_marker
        if marker is not None and prompt.count(marker) != len(clips):
            raise ValueError(f"the prompt has {prompt.count(marker)} {marker} marker(s) but {len(clips)} video(s) "
                             "were given")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now. False if it was not running or waiting."""
        with self._lock:
            self._take_incoming()
            request = self.requests.pop(request_id, None)
            if request is None:
                return False
            self.scheduler.finish(request, "abort")
            self.output_processor.image_embeddings.pop(request_id, None)
            return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._incoming)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, and report every request that gained a token or finished."""
        with self._lock:
            self._take_incoming()
            began = time.perf_counter()
            scheduled = self.scheduler.schedule()
            scheduled_at = time.perf_counter()
            try:
                result = self.runner.execute(scheduled)
            except Exception:
                # Input is validated in add_request, so this is a fault of the step itself (a bug, memory):
                # end the requests it carried, free their blocks, and keep serving the others.
                self.num_step_failures += 1
                carried = list(dict.fromkeys([c.request_id for c in scheduled.chunks]
                                             + [w.request_id for w in scheduled.encoder_work]))
                log.exception("step %d failed; ending the %d requests it carried", self._steps, len(carried))
                return [self.output_processor.fail(self.requests[rid]) for rid in carried]
            ran_at = time.perf_counter()
            self.scheduler.update(scheduled, result.sampled)
            self.output_processor.pool_features(scheduled.encoder_work, self.runner.encoder_features)
            self._steps += 1
            self._last_step_num_tokens = scheduled.num_tokens
            outputs = self.output_processor.step_outputs(result, self._steps, self.config.jump_forward)
            timings = self.runner.timings
            timings.schedule = scheduled_at - began
            timings.update = time.perf_counter() - ran_at
            self.last_step_timings = timings
            if self.step_costs is not None:
                self.step_costs.observe(scheduled.shape(), timings.total - timings.encode, timings.encode)
            return outputs

    # -- what the server asks of the model (api/ reads these, never `adapter`) ---------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests (`messages`) can be rendered: a checkpoint without a template serves prompts only."""
        return self.adapter.chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The chat template `messages` are rendered with (the checkpoint's or --chat-template's); None: none."""
        return self.adapter.chat_template

    def render_messages(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """`messages` through the chat template, ending with the assistant's turn; `template_kwargs` are the
        template's variables (`tools=...`). ValueError where the model has no template."""
        return self.adapter.render_messages(messages, **template_kwargs)

    @property
    def model_family(self) -> str:
        """The model's transformers class name (`SmolVLMForConditionalGeneration`), as messages name it."""
        return self.adapter.family

    @property
    def takes_videos(self) -> bool:
        """Whether the model has a video path (`videos=` of `add_request`); one without refuses videos."""
        return self.adapter.video_marker is not None

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits: every token id a prompt may hold is below it."""
        return self.adapter.lm_head.weight.shape[0]

    @property
    def single_input_options(self) -> dict[str, Any] | None:
        """The `mm_processor_kwargs` that make each image one encoder input (SmolVLM: one 512 px tile, not up to
        17); None where every image already is one (Qwen2-VL, LLaVA, Gemma 3)."""
        return dict(type(self.adapter).single_input_options) or None

    def tiling_options(self, width: int, height: int) -> dict[str, Any] | None:
        """The `mm_processor_kwargs` that tile an image of `width` x `height` pixels no finer than its own pixels
        (SmolVLM upscales every image to 2,048 px before tiling it: a 640 x 480 camera frame 13 tiles, 5 with
        these; one, as `single_input_options`, where a tile holds it); None where the processor's defaults already
        do (a large image, a family that does not tile)."""
        return self.adapter.tiling_options(width, height) or None

    def tokenize(self, prompt: str, images: list[ImageInput] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[int]:
        """A text prompt's token ids as `add_request` computes them (a marker per image, expanded by the model's
        processor), to size a prompt to the context before it is sent. ValueError as `add_request`'s."""
        token_ids, _ = self._process(prompt, images, None, mm_processor_kwargs)
        return token_ids

    def user_prompt(self, content: list[dict[str, Any]]) -> str:
        """One user turn of `content` parts (text, `{"type": "image"}`, `{"type": "video"}`) as a prompt: through
        the chat template where the model has one, else the family's own markers and the text
        (`VLMAdapter.plain_prompt`), so that captions run on any checkpoint."""
        if self.has_chat_template:
            return self.render_messages([{"role": "user", "content": content}])
        return self.adapter.plain_prompt(content)

    def embed(self, images: list[ImageInput] | None = None, texts: list[str] | None = None) -> list[list[float]]:
        """Embeddings of `images` then `texts` from the model's own vision tower and input embeddings, L2-normalised
        (engine/embeddings.py). Runs on the calling thread, not in the step loop; ValueError for a bad input."""
        from engine.embeddings import embed

        loaded = [_load_image(image, i) for i, image in enumerate(images or [])]
        return embed(self.adapter, loaded, list(texts or []), self.max_model_len)

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler (its child processes and cache), built at first use over the model's
        logits width; ValueError when xgrammar is not installed. Callers may compile a spec ahead of
        `add_request` (`grammars.compile`, from `grammars.executor`), which then finds it cached."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                                 self.config.grammar_limits)
            return self._grammars

    def _matcher(self, spec: GrammarSpec) -> Matcher:
        """A new request's matcher."""
        return self.grammars.matcher(spec)

    def close(self) -> None:
        """End the grammar compiler's child processes (the engine's other resources are freed with it)."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()
                self._grammars = None

    def stats(self) -> EngineStats:
        with self._lock:
            self._take_incoming()
            kv = self.scheduler.kv_cache_manager.stats()
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_blocks_used=kv.blocks_used,
                kv_blocks_total=kv.blocks_total,
                num_preemptions=self.scheduler.num_preemptions,
                last_step_num_tokens=self._last_step_num_tokens,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                encoder_inputs_encoded=self.runner.encoder_inputs_encoded,
                encoder_slices_run=self.runner.encoder_slices_run,
                encoder_seconds=self.runner.encoder_seconds,
                num_steps=self._steps,
                num_generated_tokens=self.output_processor.num_generated_tokens,
                prefix_cache_queried_tokens=kv.queried_tokens,
                prefix_cache_hit_tokens=kv.hit_tokens,
                prefix_cache_blocks=kv.cached_blocks,
                encoder_cache_hits=self.encoder_outputs.hits if self.encoder_outputs else 0,
                num_step_failures=self.num_step_failures,
                num_request_failures=self.num_request_failures,
                compile_seconds=self.compile_seconds,
                cpu_kernels=self.cpu_kernels,
                cpu_bf16_products=self.cpu_bf16_products,
                lean_layers=self.platform.lean_layers,
                lean_vision_layers=self.lean_vision_layers,
                linear_rows=dict(self.linear_rows),
                step_costs=self.step_costs.as_dict() if self.step_costs is not None and self.step_costs.ready else {},
            )
