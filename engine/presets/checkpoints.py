"""A preset written as an ordinary Hugging Face checkpoint directory (config, random weights, tokenizer,
processor with its chat template): one builder per family, and a cache of built checkpoints by name."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engine.presets.sizes import (
    PRESETS,
    Gemma3Preset,
    LlavaOnevisionPreset,
    LlavaPreset,
    Preset,
    Qwen2VLPreset,
    SmolVLMPreset,
    TextSizes,
    VisionSizes,
)
from engine.presets.tokenizer import (
    GEMMA3_CHAT_TEMPLATE,
    LLAVA_CHAT_TEMPLATE,
    LLAVA_ONEVISION_CHAT_TEMPLATE,
    QWEN2_VL_CHAT_TEMPLATE,
    train_tokenizer,
)


def _tower_config(sizes: TextSizes | VisionSizes) -> dict[str, Any]:
    """The config keys of the sizes that a text model and a vision tower both have."""
    return {
        "hidden_size": sizes.hidden,
        "intermediate_size": sizes.intermediate,
        "num_hidden_layers": sizes.layers,
        "num_attention_heads": sizes.heads,
    }


def _text_config(preset: Preset, tokenizer) -> dict[str, Any]:
    text = preset.text
    return _tower_config(text) | {
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
    return _tower_config(vision) | {
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
        # Frames within the images' pixel limits; `cap_pixels_per_frame` False keeps transformers' resizing rule
        # (and its warning quiet).
        video_processor=Qwen2VLVideoProcessor(min_pixels=preset.min_pixels, max_pixels=preset.max_pixels,
                                              cap_pixels_per_frame=False, **sizes),
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
    # The chat templates are part of what is built: a template that changes builds the checkpoint anew.
    templates = (QWEN2_VL_CHAT_TEMPLATE, LLAVA_CHAT_TEMPLATE, LLAVA_ONEVISION_CHAT_TEMPLATE, GEMMA3_CHAT_TEMPLATE)
    described = {"family": type(preset).__name__, **asdict(preset), "templates": templates}
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


# The shapes real checkpoints come in besides the complete one `build_checkpoint` writes: a base model saved
# without a chat template, one whose template sits only in tokenizer_config.json (no chat_template.jinja), one
# without generation_config.json, one whose tokenizer names no pad token.
CHECKPOINT_SHAPES = ("no_chat_template", "tokenizer_template_only", "no_generation_config", "no_pad_token")


def reshape_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, shape: str) -> Path:
    """A copy of checkpoint `source` in `out_dir`, its files changed into `shape` (`CHECKPOINT_SHAPES`) as such
    checkpoints are saved, so that loading them runs transformers' and the engine's real code."""
    import shutil

    if shape not in CHECKPOINT_SHAPES:
        raise ValueError(f"unknown checkpoint shape {shape!r}; known: {', '.join(CHECKPOINT_SHAPES)}")
    out = Path(out_dir)
    shutil.copytree(source, out, dirs_exist_ok=True)

    def edit(name: str, change: Callable[[dict], None]) -> None:
        path = out / name
        if path.exists():
            data = json.loads(path.read_text())
            change(data)
            path.write_text(json.dumps(data, indent=2))

    template_file = out / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else None
    if shape in ("no_chat_template", "tokenizer_template_only"):
        for name in ("chat_template.jinja", "chat_template.json"):
            (out / name).unlink(missing_ok=True)
        for name in ("processor_config.json", "tokenizer_config.json"):
            edit(name, lambda data: data.pop("chat_template", None))
        if shape == "tokenizer_template_only":
            if template is None:
                raise ValueError(f"checkpoint {str(source)!r} has no chat_template.jinja to move into its tokenizer")
            edit("tokenizer_config.json", lambda data: data.update(chat_template=template))
    elif shape == "no_generation_config":
        (out / "generation_config.json").unlink()
    else:  # no_pad_token

        def drop_pad(data: dict) -> None:
            data.pop("pad_token_id", None)
            data.pop("_pad_token_id", None)
            for nested in data.values():
                if isinstance(nested, dict):
                    drop_pad(nested)

        edit("tokenizer_config.json", lambda data: data.pop("pad_token", None))
        edit("config.json", drop_pad)
        edit("generation_config.json", drop_pad)
    return out
