"""What the engine needs from a model family: turn a prompt and images into tokens and encoder inputs,
run the vision encoder on some of those inputs, and run the stock text model on a packed batch."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from PIL import Image

from engine.attention import ATTN_IMPLEMENTATION, AttentionBatch
from engine.request import MultimodalPrompt, Request

# Model types whose image tokens attend to each other both ways in transformers (Gemma 3 puts a bidirectional
# block over each image's tokens; PaliGemma over its whole image-and-prompt prefix). A causal chunk boundary
# inside such a span would change what is computed, so their spans are kept whole (`atomic_units`).
BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3", "paligemma"})


def image_tokens_attend_bidirectionally(config: Any) -> bool:
    return getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODEL_TYPES


class VLMAdapter:
    """Wraps one transformers vision-language model; subclasses describe a family."""

    architectures: ClassVar[tuple[str, ...]] = ()
    image_marker: ClassVar[str] = "<image>"
    # Position streams of multimodal RoPE (3 for Qwen2-VL's time, height and width); None for plain RoPE.
    rope_streams: ClassVar[int | None] = None

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
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
        self.atomic_units = image_tokens_attend_bidirectionally(model.config)

    # -- family-specific ------------------------------------------------------------------------
    @property
    def text_model(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.lm_head

    def expand_prompt(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], MultimodalPrompt | None]:
        """The prompt's token ids as the model's processor expands them, and where its images go."""
        raise NotImplementedError

    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Vision features of each encoder input, one [rows, hidden] tensor each."""
        raise NotImplementedError

    # Families whose vision tower can run a slice at a time set this to the number of slices and
    # implement `encode_slices`.
    encoder_slices: int = 1

    def encode_slices(
        self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
    ) -> list[Any]:
        """Run slices first..end-1 of the vision tower on each input, starting from the state the previous
        slices left (None when `first` is 0). Returns the new states; when `end` is the last slice they are
        the features, one [rows, hidden] tensor each, exactly as `encode` gives them."""
        raise NotImplementedError(f"{type(self).__name__} runs its vision tower whole")

    # -- shared ---------------------------------------------------------------------------------
    def process(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], MultimodalPrompt | None]:
        token_ids, mm = self.expand_prompt(prompt, images)
        if mm is not None:
            mm.atomic_units = self.atomic_units
            mm.encoder_slices = self.encoder_slices
        return token_ids, mm

    def rope_positions(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Rotary positions of the request's tokens start..end-1: [n] for ordinary RoPE, [streams, n] for
        multimodal RoPE. A prompt's multimodal positions were computed once (`MultimodalPrompt.rope_positions`)
        and are sliced here; later tokens (generated, or replayed after preemption) continue the model's rule,
        token index plus the prompt's delta, and text-only prompts have the same position in every stream."""
        mm = request.mm
        if mm is None or mm.rope_positions is None:
            positions = torch.arange(start, end)
            return positions if self.rope_streams is None else positions.expand(self.rope_streams, -1)
        prompt_len = request.num_prompt_tokens
        in_prompt = mm.rope_positions[:, start : min(end, prompt_len)]
        after = torch.arange(max(start, prompt_len), max(end, prompt_len)) + mm.rope_position_delta
        return torch.cat([in_prompt, after.expand(in_prompt.shape[0], -1)], dim=1)

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

    def render_messages(self, messages: list[dict]) -> str:
        """The model's own chat template, ending with the assistant's turn."""
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def forward_text(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        out = self.text_model(
            inputs_embeds=inputs_embeds.unsqueeze(0),
            position_ids=position_ids.unsqueeze(-2),  # [T] -> [1, T]; [streams, T] -> [streams, 1, T]
            use_cache=False,
            vlmcap_batch=batch,
        )
        return out.last_hidden_state[0]
