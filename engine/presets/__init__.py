"""Checkpoints that need no download: `tiny-<family>` (small random models for tests and CI; `tiny` is
`tiny-smolvlm`) and `dummy:<preset>` (a real architecture at real size with random weights, for benchmarks:
speed does not depend on weight values).

Each preset is written as an ordinary Hugging Face checkpoint directory (config, weights, tokenizer, processor
with its chat template), so the engine loads it through exactly the same code path as a downloaded model.
A preset is a dataclass of its family's sizes; one builder function per family turns it into the model
class, its config and its processor.

The package: `sizes` (each family's preset dataclass and the `PRESETS` table), `tokenizer` (the trained BPE and
chat templates), `checkpoints` (the builders and the cache of built checkpoints).
"""

from engine.presets.checkpoints import CHECKPOINT_SHAPES, build_checkpoint, preset_checkpoint, reshape_checkpoint
from engine.presets.sizes import PRESETS, Preset

__all__ = ["CHECKPOINT_SHAPES", "PRESETS", "Preset", "build_checkpoint", "preset_checkpoint", "reshape_checkpoint"]
