"""Checkpoints that need no download: `tiny-<family>` (small random models for tests and CI; `tiny` is
`tiny-smolvlm`) and `dummy:<preset>` (a real architecture at real size with random weights, for benchmarks:
speed does not depend on weight values).

Each preset is written as an ordinary Hugging Face checkpoint directory (config, weights, tokenizer, processor
with its chat template), so the engine loads it through exactly the same code path as a downloaded model.
A preset is a dataclass of its family's sizes; one builder function per family turns it into the model
class, its config and its processor.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# A byte-level BPE is trained on these few sentences: enough merges for readable random text.
_CORPUS = [
    "A person is walking across the street next to a blue bus.",
    "Two men in suits are standing on a football pitch and talking.",
    "The camera shows a woman with a red bag near the entrance.",
    "Describe the image in one sentence. What is the person doing?",
    "User: Describe this frame. Assistant: There are people in the picture.",
    "Nobody is in the room; the lights are on and the door is open.",
    "A cyclist rides past a parked car while a child waits at the corner.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
]

# Chat templates of the hub checkpoints, trimmed to text and images.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<start_of_image>' }}{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TextSizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    rope_theta: float = 100000.0
    max_positions: int = 8192
    tie_embeddings: bool = False


@dataclass(frozen=True)
class VisionSizes:
    """`image_px` is the tower's input side (a tile, or one view); Qwen2-VL towers take any size."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch_px: int
    image_px: int = 0


@dataclass(frozen=True, kw_only=True)
class Preset:
    """What every family's preset has. `lm_head_gain` scales the random lm_head: random weights give
    near-equal logits, and a larger gain keeps greedy choices from being decided by rounding, so exactness
    tests compare real decisions. `attention_gain` scales the text model's query and key projections: random
    weights give near-uniform attention, blind to positions, and sharper attention makes a wrong rotary
    position change the output. `dtype` is the dtype the weights are saved in. `tokenizer_vocab` is the size
    of the trained tokenizer; `None` makes it the text model's vocabulary, as in a real checkpoint, so that
    every token a random model picks decodes to text (clients that stream see every token)."""

    text: TextSizes
    vision: VisionSizes
    tokenizer_vocab: int | None = None
    lm_head_gain: float = 1.0
    attention_gain: float = 1.0
    dtype: str = "float32"

    @property
    def tokenizer_size(self) -> int:
        return self.tokenizer_vocab or self.text.vocab_size


@dataclass(frozen=True, kw_only=True)
class SmolVLMPreset(Preset):
    """The processor splits an image into tiles of `vision.image_px` (up to `max_tiles_per_side` a side) plus
    a global view; a pixel shuffle of `scale_factor` turns a tile into `image_seq_len` tokens."""

    scale_factor: int
    max_tiles_per_side: int

    @property
    def image_seq_len(self) -> int:
        return (self.vision.image_px // self.vision.patch_px) ** 2 // self.scale_factor**2


@dataclass(frozen=True, kw_only=True)
class Qwen2VLPreset(Preset):
    """Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5"). Images keep their aspect ratio and are resized to
    between `min_pixels` and `max_pixels`; 2x2 patches merge into one token. `mrope_section` splits the
    rotary half-dimension among the time, height and width streams. Qwen2.5-VL's tower attends within
    windows of `window_px` except in the `full_attention_blocks`."""

    version: str
    min_pixels: int
    max_pixels: int
    mrope_section: tuple[int, int, int]
    vision_out_hidden: int
    window_px: int = 112
    full_attention_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class LlavaPreset(Preset):
    """LLaVA-1.5: one `vision.image_px` view per image through a CLIP tower (CLS dropped, features of the
    second-to-last layer), a two-layer projector, a Llama text model."""


@dataclass(frozen=True, kw_only=True)
class LlavaOnevisionPreset(Preset):
    """LLaVA-OneVision: any-resolution tiling. A single image becomes a base view plus the tiles of the best
    grid among `grid_pinpoints` (all features through a SigLIP tower, unpadded, with an `image_newline` row
    end); several images in one prompt are each one base view. Qwen2 text model."""

    grid_pinpoints: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Gemma3Preset(Preset):
    """Gemma 3: one `vision.image_px` view per image through a SigLIP tower, average-pooled to
    `mm_tokens_per_image` tokens; text layers alternate `sliding_window` local attention (`local_per_global`
    local layers, then one global layer)."""

    mm_tokens_per_image: int
    sliding_window: int
    local_per_global: int = 5
    head_dim: int = 256


_TINY_TEXT = TextSizes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=512)
_TINY_VISION = VisionSizes(hidden=32, layers=2, heads=2, intermediate=64, patch_px=8)
_TINY = dict(text=_TINY_TEXT, tokenizer_vocab=512, lm_head_gain=8.0, attention_gain=4.0)
_TINY_QWEN = dict(
    _TINY,
    vision=_TINY_VISION,
    # 8 px patches merged 2x2: a token is 16x16 px, and a photo resized under 128x128 px is 50 to 70 tokens.
    min_pixels=32 * 32,
    max_pixels=128 * 128,
    mrope_section=(2, 3, 3),  # text head_dim 16: 8 rotary frequencies
    vision_out_hidden=_TINY_TEXT.hidden,
)
_REAL_QWEN_VISION = VisionSizes(hidden=1280, layers=32, heads=16, intermediate=3420, patch_px=14)
# Real sizes are saved in bfloat16 to halve the disk they take; tiny ones in float32, the tests' dtype.
_DUMMY = dict(dtype="bfloat16")

PRESETS: dict[str, Preset] = {
    # Small enough that a test builds, saves and loads it in about a second; 16 image tokens per tile and
    # up to 2x2 tiles plus the global view, so an image is 5 tiles and 80 image tokens.
    "tiny": SmolVLMPreset(
        **_TINY, vision=VisionSizes(hidden=32, layers=2, heads=2, intermediate=64, patch_px=8, image_px=64),
        scale_factor=2, max_tiles_per_side=2,
    ),
    # `tiny` with 30 text layers (SmolVLM-256M's depth) at tiny width: a forward that is mostly per-layer
    # overhead, as on a GPU, for `vlmcap bench host`.
    "tiny-deep": SmolVLMPreset(
        **{**_TINY, "text": TextSizes(**{**asdict(_TINY_TEXT), "layers": 30})},
        vision=VisionSizes(hidden=32, layers=2, heads=2, intermediate=64, patch_px=8, image_px=64),
        scale_factor=2, max_tiles_per_side=2,
    ),
    "tiny-qwen2-vl": Qwen2VLPreset(**_TINY_QWEN, version="2"),
    # Windows of 32 px are 2x2 merged tokens, so the windowed blocks really differ from full attention.
    "tiny-qwen2.5-vl": Qwen2VLPreset(**_TINY_QWEN, version="2.5", window_px=32, full_attention_blocks=(1,)),
    # 48 px views of 8 px patches: 36 image tokens an image.
    "tiny-llava": LlavaPreset(**_TINY, vision=VisionSizes(**{**asdict(_TINY_VISION), "image_px": 48})),
    # 32 px views of 8 px patches: 16 tokens a view; a single photo is a base view plus up to 3x3 tiles.
    "tiny-llava-onevision": LlavaOnevisionPreset(
        **_TINY, vision=VisionSizes(**{**asdict(_TINY_VISION), "image_px": 32}),
        grid_pinpoints=((32, 32), (32, 64), (64, 32), (64, 64), (64, 96), (96, 64), (96, 96)),
    ),
    # 32 px views of 8 px patches pooled to 2x2: 4 tokens an image; a window of 3 tokens on the local layer,
    # smaller than an image's span, so that the window and the image's two-way block both shape the mask.
    "tiny-gemma3": Gemma3Preset(
        **{**_TINY, "attention_gain": 1.0},  # q_norm and k_norm undo a gain on the projections
        vision=VisionSizes(**{**asdict(_TINY_VISION), "image_px": 32}),
        mm_tokens_per_image=4, sliding_window=3, local_per_global=1, head_dim=16,
    ),
    # HuggingFaceTB/SmolVLM-256M-Instruct: SigLIP-B/16 at 512 px, 64 tokens a tile, up to 4x4 tiles + global.
    "smolvlm-256m": SmolVLMPreset(
        text=TextSizes(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab_size=49280),
        vision=VisionSizes(hidden=768, layers=12, heads=12, intermediate=3072, patch_px=16, image_px=512),
        scale_factor=4, max_tiles_per_side=4,
    ),
    # HuggingFaceTB/SmolVLM-500M-Instruct: same vision tower, a wider and deeper text model.
    "smolvlm-500m": SmolVLMPreset(
        text=TextSizes(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, vocab_size=49280),
        vision=VisionSizes(hidden=768, layers=12, heads=12, intermediate=3072, patch_px=16, image_px=512),
        scale_factor=4, max_tiles_per_side=4,
    ),
    # Qwen/Qwen2-VL-2B-Instruct: a 675M ViT (embed 1280, mlp ratio 4) and a 1.5B Qwen2 text model.
    "qwen2-vl-2b": Qwen2VLPreset(
        **_DUMMY, version="2",
        text=TextSizes(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab_size=151936,
                       rope_theta=1e6, max_positions=32768, tie_embeddings=True),
        vision=VisionSizes(**{**asdict(_REAL_QWEN_VISION), "intermediate": 4 * 1280}),
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280, mrope_section=(16, 24, 24), vision_out_hidden=1536,
    ),
    # Qwen/Qwen2.5-VL-3B-Instruct: windowed ViT (112 px windows, full attention in 4 blocks), 3B text model.
    "qwen2.5-vl-3b": Qwen2VLPreset(
        **_DUMMY, version="2.5",
        text=TextSizes(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab_size=151936,
                       rope_theta=1e6, max_positions=128000, tie_embeddings=True),
        vision=_REAL_QWEN_VISION,
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280, mrope_section=(16, 24, 24), vision_out_hidden=2048,
        window_px=112, full_attention_blocks=(7, 15, 23, 31),
    ),
    # llava-hf/llava-onevision-qwen2-0.5b-ov-hf: SigLIP-so400m at 384 px (729 tokens a view), Qwen2-0.5B.
    "llava-onevision-0.5b": LlavaOnevisionPreset(
        **_DUMMY,
        text=TextSizes(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=152000,
                       rope_theta=1e6, max_positions=32768, tie_embeddings=True),
        vision=VisionSizes(hidden=1152, layers=26, heads=16, intermediate=4304, patch_px=14, image_px=384),
    ),
}


def _made_up_text(vocab_size: int) -> list[str]:
    """Lines of random lowercase words, enough distinct ones for `vocab_size` merges (none for small vocabularies,
    which `_CORPUS` alone fills)."""
    if vocab_size <= 1024:
        return []
    rng = random.Random(vocab_size)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2 * vocab_size)]
    return [" ".join(rng.choices(words, k=40)) for _ in range(vocab_size // 4)]


def train_tokenizer(
    vocab_size: int, special_tokens: list[str], *, eos: str, pad: str, bos: str | None = None, **named: Any
):
    """A byte-level BPE trained on `_CORPUS` (plus made-up words when `vocab_size` asks for more merges than
    those sentences hold), with `special_tokens` first in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS + _made_up_text(vocab_size), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=pad, **named
    )


def _text_config(preset: Preset, tokenizer) -> dict[str, Any]:
    text = preset.text
    return {
        "hidden_size": text.hidden,
        "intermediate_size": text.intermediate,
        "num_hidden_layers": text.layers,
        "num_attention_heads": text.heads,
        "num_key_value_heads": text.kv_heads,
        "vocab_size": text.vocab_size,
        "max_position_embeddings": text.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": text.rope_theta,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": text.tie_embeddings,
    }


def _vision_config(preset: Preset) -> dict[str, Any]:
    vision = preset.vision
    return {
        "hidden_size": vision.hidden,
        "intermediate_size": vision.intermediate,
        "num_hidden_layers": vision.layers,
        "num_attention_heads": vision.heads,
        "image_size": vision.image_px,
        "patch_size": vision.patch_px,
    }


# A family's builder returns (model class, config, processor) for a preset.
FamilyParts = tuple[type, Any, Any]


def smolvlm_parts(preset: SmolVLMPreset) -> FamilyParts:
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    special = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<global-img>"]
    special += ["<image>", "<video>"] + [f"<row_{r}_col_{c}>" for r in range(1, 9) for c in range(1, 9)]
    tokenizer = train_tokenizer(
        preset.tokenizer_size, special, bos="<|im_start|>", eos="<end_of_utterance>", pad="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )
    config = SmolVLMConfig(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=preset.scale_factor,
        tie_word_embeddings=preset.text.tie_embeddings,
        text_config=_text_config(preset, tokenizer) | {"model_type": "llama"},
        vision_config=_vision_config(preset),
    )
    tile = preset.vision.image_px
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(
            size={"longest_edge": tile * preset.max_tiles_per_side}, max_image_size={"longest_edge": tile}
        ),
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(size={"longest_edge": tile}, max_image_size={"longest_edge": tile}),
        image_seq_len=preset.image_seq_len,
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    return SmolVLMForConditionalGeneration, config, processor


def qwen2_vl_parts(preset: Qwen2VLPreset) -> FamilyParts:
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    prefix = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL"}[preset.version]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    special += ["<|image_pad|>", "<|video_pad|>"]
    tokenizer = train_tokenizer(preset.tokenizer_size, special, eos="<|im_end|>", pad="<|endoftext|>")
    vision = preset.vision
    if preset.version == "2":
        vision_config = {"embed_dim": vision.hidden, "mlp_ratio": vision.intermediate // vision.hidden}
    else:
        vision_config = {
            "intermediate_size": vision.intermediate,
            "window_size": preset.window_px,
            "fullatt_block_indexes": list(preset.full_attention_blocks),
            "out_hidden_size": preset.vision_out_hidden,
        }
    # Qwen2-VL's `hidden_size` is the merger's output width; Qwen2.5-VL's is the tower's width.
    vision_config |= {
        "depth": vision.layers,
        "hidden_size": preset.vision_out_hidden if preset.version == "2" else vision.hidden,
        "num_heads": vision.heads,
        "patch_size": vision.patch_px,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    text_config = _text_config(preset, tokenizer)
    text_config["rope_parameters"] = {
        "rope_type": "default", "rope_theta": text_config.pop("rope_theta"), "mrope_section": list(preset.mrope_section)
    }
    config = getattr(transformers, f"{prefix}Config")(
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=preset.text.tie_embeddings,
        text_config=text_config,
        vision_config=vision_config,
    )
    sizes = {"patch_size": vision.patch_px, "merge_size": 2, "temporal_patch_size": 2}
    processor = getattr(transformers, f"{prefix}Processor")(
        image_processor=Qwen2VLImageProcessor(min_pixels=preset.min_pixels, max_pixels=preset.max_pixels, **sizes),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes),
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    return getattr(transformers, f"{prefix}ForConditionalGeneration"), config, processor


def llava_parts(preset: LlavaPreset) -> FamilyParts:
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = train_tokenizer(
        preset.tokenizer_size, ["<unk>", "<s>", "</s>", "<image>", "<pad>"], bos="<s>", eos="</s>", pad="<pad>"
    )
    side = preset.vision.image_px
    config = LlavaConfig(
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(side // preset.vision.patch_px) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=preset.text.tie_embeddings,
        text_config=_text_config(preset, tokenizer) | {"model_type": "llama"},
        vision_config=_vision_config(preset)
        | {"model_type": "clip_vision_model", "projection_dim": preset.vision.hidden},
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        tokenizer=tokenizer,
        patch_size=preset.vision.patch_px,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return LlavaForConditionalGeneration, config, processor


def llava_onevision_parts(preset: LlavaOnevisionPreset) -> FamilyParts:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = train_tokenizer(
        preset.tokenizer_size, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"],
        eos="<|im_end|>", pad="<|endoftext|>",
    )
    side = preset.vision.image_px
    pinpoints = [list(p) for p in preset.grid_pinpoints] if preset.grid_pinpoints else None
    config = LlavaOnevisionConfig(
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints,
        tie_word_embeddings=preset.text.tie_embeddings,
        text_config=_text_config(preset, tokenizer) | {"model_type": "qwen2"},
        vision_config=_vision_config(preset) | {"model_type": "siglip_vision_model", "vision_use_head": False},
    )
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": side, "width": side}, image_grid_pinpoints=config.image_grid_pinpoints
    )
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": side, "width": side}),
        num_image_tokens=(side // preset.vision.patch_px) ** 2,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE,
    )
    return LlavaOnevisionForConditionalGeneration, config, processor


def gemma3_parts(preset: Gemma3Preset) -> FamilyParts:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    images = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = train_tokenizer(
        preset.tokenizer_size, ["<pad>", "<eos>", "<bos>", *images.values(), "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra_special_tokens=images,
    )
    text = _text_config(preset, tokenizer)
    del text["rope_theta"]  # Gemma 3 has its own local and global rotary bases
    pattern = ["sliding_attention"] * preset.local_per_global + ["full_attention"]
    config = Gemma3Config(
        text_config=text | {
            "head_dim": preset.head_dim,
            "query_pre_attn_scalar": preset.head_dim,
            "sliding_window": preset.sliding_window,
            "layer_types": [pattern[i % len(pattern)] for i in range(preset.text.layers)],
        },
        vision_config=_vision_config(preset) | {"model_type": "siglip_vision_model", "vision_use_head": False},
        mm_tokens_per_image=preset.mm_tokens_per_image,
        boi_token_index=tokenizer.convert_tokens_to_ids(images["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(images["eoi_token"]),
        image_token_index=tokenizer.convert_tokens_to_ids(images["image_token"]),
        tie_word_embeddings=preset.text.tie_embeddings,
    )
    side = preset.vision.image_px
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        image_seq_length=preset.mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    return Gemma3ForConditionalGeneration, config, processor


FAMILY_BUILDERS: dict[type[Preset], Callable[[Any], FamilyParts]] = {
    SmolVLMPreset: smolvlm_parts,
    Qwen2VLPreset: qwen2_vl_parts,
    LlavaPreset: llava_parts,
    LlavaOnevisionPreset: llava_onevision_parts,
    Gemma3Preset: gemma3_parts,
}


def build_checkpoint(preset: Preset, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of `preset`'s family and sizes to `out_dir` and return the path."""
    model_cls, config, processor = FAMILY_BUILDERS[type(preset)](preset)
    tokenizer = processor.tokenizer
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, preset.dtype))
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(preset.lm_head_gain)
        for name, param in model.named_parameters():
            in_text_model = "language_model." in name or "text_model." in name
            if in_text_model and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(preset.attention_gain)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def preset_checkpoint(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of preset `name`, built once and kept in a cache folder keyed by its sizes."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    described = {"family": type(preset).__name__, **asdict(preset)}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("VLMCAP_CACHE", Path(tempfile.gettempdir()) / "vlmcap-presets"))
    path = root / f"{name}-{key}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
        build_checkpoint(preset, staging)
        try:
            staging.rename(path)
        except OSError:  # another process built it first; theirs is as good as ours
            pass
    return path
