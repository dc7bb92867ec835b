"""What the engine needs from a model family: turn a prompt, images and videos into tokens and encoder
inputs, run the vision encoder on some of those inputs, and run the stock text model on a packed batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from engine import lean_paths
from engine.attention import ATTN_IMPLEMENTATION, AttentionBatch
from engine.request import MultimodalPrompt
from engine.video import Video

# Model types whose image tokens attend to each other both ways in transformers (Gemma 3 puts a bidirectional
# block over each image's tokens), among the families with an adapter. A causal chunk boundary
# inside such a span would change what is computed, so their spans are kept whole (`atomic_inputs`).
BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3"})


def image_tokens_attend_bidirectionally(config: Any) -> bool:
    return getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODEL_TYPES


@dataclass
class EncoderInput:
    """One encoder input (a tile, an image, a video's frame or temporal patch) and how many placeholder
    tokens its features fill."""

    rows: int
    inputs: dict[str, torch.Tensor]


def checkpoint_chat_template(processor: Any) -> str | None:
    """The chat template a checkpoint came with: its processor's, else its tokenizer's (a dict of named templates
    gives its "default"); None where it has none."""
    for owner in (processor, getattr(processor, "tokenizer", None)):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if isinstance(template, str) and template.strip():
            return template
    return None


def video_processor_kwargs(videos: Sequence[Video]) -> dict[str, Any]:
    """What a transformers processor takes for one prompt's videos whose frames are already sampled
    (engine/video.py), so that it samples none again; nothing without videos. The videos are nested as a batch of
    one prompt: SmolVLM's processor in transformers 5.17 counts a flat list's frames as videos, and every version
    reads the nested form alike."""
    if not videos:
        return {}
    return {"videos": [[v.frames for v in videos]], "video_metadata": [[v.metadata() for v in videos]],
            "do_sample_frames": False}


def place_inputs(ids: list[int], inputs_by_token: dict[int, list[EncoderInput]]) -> MultimodalPrompt:
    """The prompt's placeholders matched to encoder inputs: `inputs_by_token[token]` are the inputs whose features
    fill the placeholders of that token id (an image token, a video token), in the prompt's order, `rows`
    placeholders each. The processor puts every input's placeholders in one run of its token (other tokens
    may lie between them, never another input's placeholders), so inputs follow one another in the prompt."""
    positions: list[int] = []
    row_starts: list[int] = []
    rows: list[int] = []
    inputs: list[dict[str, torch.Tensor]] = []
    queues = {token: iter(listed) for token, listed in inputs_by_token.items()}
    open_token, left = None, 0
    for position, token in enumerate(ids):
        if token not in queues:
            continue
        if left == 0:
            encoder_input = next(queues[token], None)
            if encoder_input is None:
                break
            row_starts.append(len(positions))
            rows.append(encoder_input.rows)
            inputs.append(encoder_input.inputs)
            open_token, left = token, encoder_input.rows
        elif token != open_token:
            break
        positions.append(position)
        left -= 1
    expected = sum(encoder_input.rows for listed in inputs_by_token.values() for encoder_input in listed)
    if len(positions) != expected or sum(1 for t in ids if t in queues) != expected:
        found = sum(1 for t in ids if t in queues)
        raise ValueError(f"the prompt expands to {found} image and video tokens, but its images and videos give "
                         f"{expected} rows of features")
    return MultimodalPrompt(placeholder_positions=positions, input_row_starts=row_starts, input_rows=rows,
                            encoder_inputs=inputs)


class VLMAdapter:
    """Wraps one transformers vision-language model; subclasses describe a family."""

    architectures: ClassVar[tuple[str, ...]] = ()
    image_marker: ClassVar[str] = "<image>"
    # What a video is in a prompt; None for families without a video path (they refuse videos by name).
    video_marker: ClassVar[str | None] = None
    # The markers as they stand in a prompt written without a chat template (`plain_prompt`), where a family's
    # template wraps them (Qwen2-VL's vision start and end tokens); None: the marker alone.
    image_prompt: ClassVar[str | None] = None
    video_prompt: ClassVar[str | None] = None
    # Position streams of multimodal RoPE (3 for Qwen2-VL's time, height and width); None for plain RoPE.
    rope_streams: ClassVar[int | None] = None

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        # The chat template `render_messages` uses: the processor's, else the tokenizer's (a checkpoint saved with
        # its template only in tokenizer_config.json); None serves prompts only. `load_adapter` may override it.
        self.chat_template: str | None = checkpoint_chat_template(processor)
        self.device = device
        self.dtype = dtype
        text_config = self.text_model.config
        # Only the text model's attention is replaced; the vision tower keeps its own.
        text_config._attn_implementation = ATTN_IMPLEMENTATION
        self.num_layers = text_config.num_hidden_layers
        self.num_heads = text_config.num_attention_heads
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // self.num_heads
        self.max_position_embeddings = int(getattr(text_config, "max_position_embeddings", 4096))
        self.embed_tokens = self.text_model.get_input_embeddings()
        # The window of the text model's sliding-window layers (Gemma 3's local layers); None without any.
        layer_types = getattr(text_config, "layer_types", None) or []
        self.sliding_window: int | None = (
            text_config.sliding_window if "sliding_attention" in layer_types else None
        )
        self.atomic_inputs = image_tokens_attend_bidirectionally(model.config)

    # -- family-specific ------------------------------------------------------------------------
    @property
    def text_model(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.lm_head

    def expand_prompt(
        self, prompt: str, images: list[Image.Image], videos: list[Video]
    ) -> tuple[list[int], MultimodalPrompt | None]:
        """The prompt's token ids as the model's processor expands them, and where its images and videos go."""
        raise NotImplementedError

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Vision features of each encoder input, one [rows, hidden] tensor each: the tower whole
        (`encode_whole`), or, where its layers run lean, all of its slices, which are the lean layers' path."""
        if lean_paths.vision_layers(self.vision_layers) is not None:
            return self.encode_slices(inputs, [None] * len(inputs), 0, self.encoder_slices)
        return self.encode_whole(inputs)

    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The family's vision features of each encoder input, the tower run whole as transformers runs it."""
        raise NotImplementedError

    # Families whose vision tower can run a slice at a time set this to the number of slices and
    # implement `encode_slices`; `slices_per_layer` of them make one layer of the tower.
    encoder_slices: int = 1
    slices_per_layer: int = 1

    def encode_slices(
        self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
    ) -> list[Any]:
        """Run slices first..end-1 of the vision tower on each input, starting from the state the previous
        slices left (None when `first` is 0). Returns the new states; when `end` is the last slice they are
        the features, one [rows, hidden] tensor each, exactly as `encode` gives them."""
        raise NotImplementedError(f"{type(self).__name__} runs its vision tower whole")

    # The vision tower's encoder layers, for families whose `encode_slices` runs them lean
    # (engine/lean_vision.py); None elsewhere.
    vision_layers: torch.nn.ModuleList | None = None

    # -- shared ---------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return type(self.model).__name__

    # Keyword arguments of the processor a request may set (`Engine.add_request(mm_processor_kwargs=...)`), by
    # name and type; and those that make each image one encoder input (an event's frames: a few hundred image
    # tokens, not thousands).
    processor_options: ClassVar[dict[str, type]] = {}
    single_input_options: ClassVar[dict[str, Any]] = {}

    def option_problem(self, name: str, value: Any) -> str | None:
        """What is wrong with processor option `name`'s `value` besides its type (`processor_options`), said after
        the option's name; None: nothing."""
        return None

    def tiling_options(self, width: int, height: int) -> dict[str, Any]:
        """The processor options that tile an image of `width` x `height` pixels no finer than its own pixels: the
        fewest tiles that hold every pixel, where the processor's defaults would upscale it to more; {} where the
        defaults already do (or the family does not tile)."""
        return {}

    def process(
        self, prompt: str, images: list[Image.Image], videos: Sequence[Video] = (),
        options: dict[str, Any] | None = None,
    ) -> tuple[list[int], MultimodalPrompt | None]:
        if videos and self.video_marker is None:
            raise ValueError(f"{self.family} has no video input; send the frames as images instead")
        for name, value in (options or {}).items():
            kind = self.processor_options.get(name)
            if kind is None:
                raise ValueError(f"mm_processor_kwargs: {name!r} is not an option {self.family}'s processor takes "
                                 f"here (allowed: {sorted(self.processor_options) or 'none'})")
            if type(value) is not kind:
                raise ValueError(f"mm_processor_kwargs: {name!r} must be a {kind.__name__}, got {value!r:.80}")
            problem = self.option_problem(name, value)
            if problem is not None:
                raise ValueError(f"mm_processor_kwargs: {name!r} {problem}")
        extra = {"options": dict(options)} if options else {}
        token_ids, mm = self.expand_prompt(prompt, images, list(videos), **extra)
        if mm is not None:
            mm.atomic_inputs = self.atomic_inputs
            mm.encoder_slices = self.encoder_slices
        return token_ids, mm

    def rope_positions(self, mm: MultimodalPrompt | None, num_prompt_tokens: int, start: int, end: int
                       ) -> list[Sequence[int]]:
        """Rotary positions of a request's tokens start..end-1 (its prompt's encoder inputs `mm`, of
        `num_prompt_tokens` tokens), one sequence per position stream (one for
        ordinary RoPE, `rope_streams` for multimodal RoPE). A prompt's multimodal positions were computed once
        by the model's own rule (`MultimodalPrompt.rope_positions`) and are sliced here; later tokens
        (generated, or replayed after preemption) continue that rule, token index plus the prompt's delta;
        text-only prompts have the token index in every stream."""
        streams = self.rope_streams or 1
        if mm is None or mm.rope_positions is None:
            return [range(start, end)] * streams
        delta, prompt_len = mm.rope_position_delta, num_prompt_tokens
        after = range(max(start, prompt_len) + delta, max(end, prompt_len) + delta)
        if start >= prompt_len:
            return [after] * streams
        return [row + list(after) for row in mm.rope_positions[:, start : min(end, prompt_len)].tolist()]

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def render_messages(self, messages: list[dict], **template_kwargs: Any) -> str:
        """`messages` through the chat template (`self.chat_template`), ending with the assistant's turn;
        `template_kwargs` go to the template as its variables (`tools=...`). ValueError where there is none."""
        if self.chat_template is None:
            raise ValueError(f"the model {self.family} has no chat template (neither its processor nor its tokenizer "
                             "has one): send a prompt instead of messages, or start the server with "
                             "--chat-template FILE")
        return self.processor.apply_chat_template(messages, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False, **template_kwargs)

    def plain_prompt(self, content: list[dict]) -> str:
        """A prompt of one user turn's `content` parts without a chat template: each image and video part as the
        family's own marker (`image_prompt`, `video_prompt`), each text part as its text, one a line. Start-up's
        probe (engine/calibration.py) and captions on a checkpoint without a chat template are built this way."""
        lines: list[str] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                lines.append(self.image_prompt or self.image_marker)
            elif kind == "video" and self.video_marker is not None:
                lines.append(self.video_prompt or self.video_marker)
            elif kind == "text" and isinstance(part.get("text"), str):
                lines.append(part["text"])
            else:
                raise ValueError(f"content part {index} ({str(part)[:80]}) is not an image, a video or a text part "
                                 f"that {self.family} takes")
        return "\n".join(lines)

    def forward_tokens(self, ids: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """`forward_text` of the token ids' embeddings (a step that merges no encoder features): the lean layers'
        one call gathers the rows itself where it can."""
        lean = lean_paths.text(self.text_model)
        if lean is not None:
            return lean.forward(None, position_ids, batch, ids=ids)
        return self.forward_text(self.embed_tokens(ids), position_ids, batch)

    def forward_text(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        lean = lean_paths.text(self.text_model)  # engine/lean_layers.py, where the platform runs it
        if lean is not None:
            return lean.forward(inputs_embeds, position_ids, batch)
        out = self.text_model(
            inputs_embeds=inputs_embeds.unsqueeze(0),
            position_ids=position_ids.unsqueeze(-2),  # [T] -> [1, T]; [streams, T] -> [streams, 1, T]
            use_cache=False,
            vlmcap_batch=batch,
        )
        return out.last_hidden_state[0]
