"""Which of a model's modules run lean, as the platform decided at start-up (engine/platform.py owns the lean
layers): the lean text model (engine/lean_layers.py) by the stock text model it replaces, each lean vision layer
(engine/lean_vision.py) by the stock encoder layer it replaces. The model families' code (engine/models/) asks
here, so the adapters keep no lean state of their own.

Keyed weakly by the stock module objects, so a module the platform did not prepare (a copy of the model, another
engine's) runs stock; the lean layers are held weakly too (the platform holds them; a lean text model holds the
stock one), so an engine's model is freed with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary, ref

import torch

if TYPE_CHECKING:
    from engine.lean_layers import LeanTextModel
    from engine.lean_vision import LeanVisionLayer

_text: WeakKeyDictionary[torch.nn.Module, ref[LeanTextModel]] = WeakKeyDictionary()
_vision: WeakKeyDictionary[torch.nn.Module, ref[LeanVisionLayer]] = WeakKeyDictionary()


def set_text(text_model: torch.nn.Module, lean: LeanTextModel | None) -> None:
    """Run `text_model` through `lean` (None: stock)."""
    _install(_text, text_model, lean)


def text(text_model: torch.nn.Module) -> LeanTextModel | None:
    """The lean text model that runs in place of `text_model`, if any."""
    return _found(_text, text_model)


def set_vision(layers: Iterable[torch.nn.Module] | None, lean: list[LeanVisionLayer | None] | None) -> None:
    """Run each of the tower's encoder `layers` through its entry of `lean` (None there, or `lean` None: stock)."""
    for index, layer in enumerate(layers or ()):
        _install(_vision, layer, lean[index] if lean is not None else None)


def vision(layer: torch.nn.Module) -> LeanVisionLayer | None:
    """The lean layer that runs in place of the tower's encoder `layer`, if any."""
    return _found(_vision, layer)


def vision_layers(layers: Iterable[torch.nn.Module] | None) -> list[LeanVisionLayer | None] | None:
    """Each of `layers`' lean layer (None where it runs stock); None where none of them runs lean."""
    found = [vision(layer) for layer in layers or ()]
    return found if any(layer is not None for layer in found) else None


def _install(table: WeakKeyDictionary, module: torch.nn.Module, lean: object | None) -> None:
    if lean is None:
        table.pop(module, None)
    else:
        table[module] = ref(lean)


def _found(table: WeakKeyDictionary, module: torch.nn.Module) -> Any:
    found = table.get(module)
    return found() if found is not None else None
