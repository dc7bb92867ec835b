"""The presets' sizes: one frozen dataclass per family, and the table of named presets (`PRESETS`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    # google/gemma-3-4b-it: SigLIP-so400m at 896 px pooled to 256 tokens an image; a 34-layer text model, five
    # local layers (1,024-token window) to one global.
    "gemma3-4b": Gemma3Preset(
        **_DUMMY,
        text=TextSizes(hidden=2560, layers=34, heads=8, kv_heads=4, intermediate=10240, vocab_size=262208,
                       max_positions=131072, tie_embeddings=True),
        vision=VisionSizes(hidden=1152, layers=27, heads=16, intermediate=4304, patch_px=14, image_px=896),
        mm_tokens_per_image=256, sliding_window=1024, local_per_global=5, head_dim=256,
    ),
    # llava-hf/llava-onevision-qwen2-0.5b-ov-hf: SigLIP-so400m at 384 px (729 tokens a view), Qwen2-0.5B.
    "llava-onevision-0.5b": LlavaOnevisionPreset(
        **_DUMMY,
        text=TextSizes(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=152000,
                       rope_theta=1e6, max_positions=32768, tie_embeddings=True),
        vision=VisionSizes(hidden=1152, layers=26, heads=16, intermediate=4304, patch_px=14, image_px=384),
    ),
}
