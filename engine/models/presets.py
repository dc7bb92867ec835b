"""Checkpoints that need no download: `tiny` (a small random SmolVLM for tests and CI) and `dummy:<preset>`
(a real architecture at real size with random weights, for benchmarks: speed does not depend on weight values).

Each preset is written as an ordinary Hugging Face checkpoint directory (config, weights, tokenizer,
processor), so the engine loads it through exactly the same code path as a downloaded model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

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

SMOLVLM_SPECIAL_TOKENS = (
    ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<global-img>", "<image>"]
    + ["<video>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 9) for c in range(1, 9)]
)


@dataclass(frozen=True)
class SmolVLMPreset:
    """The sizes that define a SmolVLM checkpoint. `tile_px` is the vision tower's input side; the
    processor splits an image into tiles of that side (up to `max_tiles_per_side` a side) plus a global view."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    vocab_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    tile_px: int
    patch_px: int
    scale_factor: int
    max_tiles_per_side: int
    tokenizer_vocab: int
    lm_head_gain: float = 1.0

    @property
    def image_seq_len(self) -> int:
        return (self.tile_px // self.patch_px) ** 2 // self.scale_factor**2


PRESETS: dict[str, SmolVLMPreset] = {
    # Small enough that a test builds, saves and loads it in about a second; 16 image tokens per tile and
    # up to 2x2 tiles plus the global view, so an image is 5 tiles and 80 image tokens.
    "tiny": SmolVLMPreset(
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128, vocab_size=512,
        vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
        tile_px=64, patch_px=8, scale_factor=2, max_tiles_per_side=2, tokenizer_vocab=512,
        # Random lm_head weights give near-equal logits; a larger gain keeps greedy choices from being
        # decided by rounding, so exactness tests compare real decisions.
        lm_head_gain=8.0,
    ),
    # HuggingFaceTB/SmolVLM-256M-Instruct: SigLIP-B/16 at 512 px, 64 tokens a tile, up to 4x4 tiles + global.
    "smolvlm-256m": SmolVLMPreset(
        text_hidden=576, text_layers=30, text_heads=9, text_kv_heads=3, text_intermediate=1536, vocab_size=49280,
        vision_hidden=768, vision_layers=12, vision_heads=12, vision_intermediate=3072,
        tile_px=512, patch_px=16, scale_factor=4, max_tiles_per_side=4, tokenizer_vocab=2048,
    ),
    # HuggingFaceTB/SmolVLM-500M-Instruct: same vision tower, a wider and deeper text model.
    "smolvlm-500m": SmolVLMPreset(
        text_hidden=960, text_layers=32, text_heads=15, text_kv_heads=5, text_intermediate=2560, vocab_size=49280,
        vision_hidden=768, vision_layers=12, vision_heads=12, vision_intermediate=3072,
        tile_px=512, patch_px=16, scale_factor=4, max_tiles_per_side=4, tokenizer_vocab=2048,
    ),
}


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SMOLVLM_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )


def build_smolvlm_checkpoint(preset: SmolVLMPreset, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a random-weight SmolVLM checkpoint of `preset`'s sizes to `out_dir` and return the path."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    out = Path(out_dir)
    tokenizer = _train_tokenizer(preset.tokenizer_vocab)
    config = SmolVLMConfig(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=preset.scale_factor,
        tie_word_embeddings=False,
        text_config={
            "model_type": "llama",
            "hidden_size": preset.text_hidden,
            "intermediate_size": preset.text_intermediate,
            "num_hidden_layers": preset.text_layers,
            "num_attention_heads": preset.text_heads,
            "num_key_value_heads": preset.text_kv_heads,
            "vocab_size": preset.vocab_size,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": preset.vision_hidden,
            "intermediate_size": preset.vision_intermediate,
            "num_hidden_layers": preset.vision_layers,
            "num_attention_heads": preset.vision_heads,
            "image_size": preset.tile_px,
            "patch_size": preset.patch_px,
        },
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(preset.lm_head_gain)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)

    image_processor = SmolVLMImageProcessor(
        size={"longest_edge": preset.tile_px * preset.max_tiles_per_side},
        max_image_size={"longest_edge": preset.tile_px},
    )
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": preset.tile_px}, max_image_size={"longest_edge": preset.tile_px}
    )
    processor = SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=preset.image_seq_len,
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


def preset_checkpoint(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of preset `name`, built once and kept in a cache folder keyed by its sizes."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    key = hashlib.sha256(json.dumps(asdict(preset), sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("VLMCAP_CACHE", Path(tempfile.gettempdir()) / "vlmcap-presets"))
    path = root / f"{name}-{key}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
        build_smolvlm_checkpoint(preset, staging)
        try:
            staging.rename(path)
        except OSError:  # another process built it first; theirs is as good as ours
            pass
    return path
