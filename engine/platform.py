"""How the model runs on this device, decided once at start-up (`Platform`): on the CPU, the host allocator kept
from returning freed memory and the C kernels' build chosen (before the model loads); then the attention backend
(engine/attention_backends.py), whether Linear layers go through the CPU's kernel, the lean decoder and vision
layers (engine/lean_layers.py, engine/lean_vision.py) with the kernel row ranges measured for them, and whether
decode steps are replayed from CUDA graphs. The platform owns the lean layers and installs them in place of the
stock modules they replace (engine/lean_paths.py); the adapters describe the model family only."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from engine import lean_paths
from engine.config import EngineConfig
from engine.models.base import VLMAdapter

log = logging.getLogger(__name__)


class Platform:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """What must be set before the model loads."""
        self.config = config
        self.device = device
        if device.type == "cpu":
            from engine.cpu import build
            from engine.host_memory import keep_freed_memory

            keep_freed_memory()
            build.choose_variant(config.cpu_kernels)
        elif config.cpu_kernels is not None:
            raise ValueError(f"cpu_kernels chooses the CPU's kernels; the device is {config.device!r}")
        self.attention_backend = ""  # "kernel", "cpu" or "reference", set by `prepare`
        self.cpu_linear = False
        self.cpu_kernels: str | None = None  # the C kernels' build, where the model was routed through them
        self.cpu_bf16_products: str | None = None
        self.linear_rows: dict[str, tuple[int, int]] = {}  # the kernel's row ranges by weight shape
        self.lean: Any = None  # engine/lean_layers.LeanTextModel, where the text model runs lean
        self.lean_vision: list[Any] | None = None  # engine/lean_vision.py's layers (None where one runs stock)

    def prepare(self, adapter: VLMAdapter) -> None:
        """The loaded model made ready for this device: the attention backend chosen, and on the CPU the lean
        layers built and every other layer routed through the kernels."""
        from engine.attention_backends import choose_backend

        config = self.config
        self.attention_backend = choose_backend(config.attention_backend, self.device, config.torch_dtype,
                                                config.block_size).name
        self.cpu_linear = self._use_cpu_linear()
        if self.cpu_linear:
            self._route_cpu_kernels(adapter)

    def started(self) -> None:
        """Start-up done (the model prepared, the steps calibrated): on the CPU, the kernels' scratch buffers that
        start-up's timings grew (engine/cpu/ops.py) and the copies made on the way given back to the system
        (engine/host_memory.py)."""
        if self.device.type == "cpu":
            from engine.host_memory import release_freed_memory

            if self.cpu_linear:
                from engine.cpu import ops

                ops.release_scratch()
            release_freed_memory()

    @property
    def lean_layers(self) -> int:
        """Decoder layers run lean."""
        return self.lean.count if self.lean is not None else 0

    @property
    def lean_vision_layers(self) -> int:
        """Vision encoder layers run lean."""
        return sum(layer is not None for layer in self.lean_vision or ())

    def _use_cpu_linear(self) -> bool:
        from engine.cpu import build

        wanted = self.config.cpu_linear
        possible = self.device.type == "cpu" and build.available(self.device)
        if wanted and not possible:
            raise ValueError(f"cpu_linear needs the CPU and a C compiler to build its kernel (device "
                             f"{self.config.device!r}, CC={os.environ.get('CC', 'cc')!r})")
        return possible if wanted is None else wanted

    def _route_cpu_kernels(self, adapter: VLMAdapter) -> None:
        """The text model's fitting layers lean (engine/lean_layers.py, before routing: it fuses their weights),
        and a sliced vision tower's (engine/lean_vision.py), every other Linear and Llama-style norm through the
        CPU kernels, and each weight shape's row limit measured (`EngineConfig.cpu_linear_rows` fixes it
        instead)."""
        from engine.cpu import build, routing, tuning
        from engine.lean_layers import LeanTextModel
        from engine.lean_vision import lean_vision_layers
        from engine.lean_vision import measure as measure_vision

        config, rows = self.config, self.config.cpu_linear_rows
        lean_possible = self.attention_backend != "kernel" and LeanTextModel.applies(adapter.text_model)
        if config.lean_layers is not False and lean_possible:
            self.lean = LeanTextModel(adapter.text_model, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim)
        elif config.lean_layers:
            raise ValueError(f"lean_layers: no decoder layer of {type(adapter.text_model).__name__} is Llama-style or "
                             f"Gemma 3's (engine/lean_layers.py `fits`), or the attention backend is "
                             f"{self.attention_backend!r} (lean layers run the CPU's attention)")
        if config.lean_layers is not False and adapter.vision_layers is not None:
            layers = lean_vision_layers(adapter.vision_layers)
            self.lean_vision = layers if any(layer is not None for layer in layers) else None
        lean_paths.set_text(adapter.text_model, self.lean)
        lean_paths.set_vision(adapter.vision_layers, self.lean_vision)
        routing.route_linears(adapter.model)
        routing.route_norms(adapter.model)
        self.cpu_kernels = build.variant()
        if self.cpu_kernels is not None:  # measured before the row ranges, whose timings use it
            self.cpu_bf16_products = tuning.bf16_products(build.load_variant(self.cpu_kernels))
        if rows is None:
            self.linear_rows = tuning.measure_row_ranges(adapter.model)
            if self.lean is not None:
                self.linear_rows.update(self.lean.measure())
            if self.lean_vision is not None:
                self.linear_rows.update(measure_vision(self.lean_vision))
        else:
            tuning.set_row_ranges(adapter.model, rows)
            lean_vision = [layer for layer in self.lean_vision or () if layer is not None]
            projections = [p for layer in lean_vision for p in layer.projections()]
            for projection in (self.lean.projections() if self.lean is not None else []) + projections:
                if not projection.int8:  # an int8 weight takes the kernel at every row count
                    projection.rows = (1, rows) if rows else (0, 0)
        log.info("CPU kernels: %s build (bfloat16 products: %s), %d lean decoder layers, %d lean vision layers, "
                 "kernel rows by weight shape %s", self.cpu_kernels, self.cpu_bf16_products, self.lean_layers,
                 self.lean_vision_layers, self.linear_rows or rows)

    def use_cuda_graphs(self) -> bool:
        """Whether decode steps are replayed from CUDA graphs (`EngineConfig.cuda_graphs`; None: where they can)."""
        wanted = self.config.cuda_graphs
        possible = self.device.type == "cuda" and self.attention_backend == "kernel"
        if wanted and not possible:
            raise ValueError(
                f"cuda_graphs needs the kernel attention backend on CUDA (device {self.config.device!r}, "
                f"backend {self.attention_backend!r})"
            )
        return possible if wanted is None else wanted
