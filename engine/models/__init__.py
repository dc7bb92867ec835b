"""Model families the engine runs, and how a `--model` value becomes a loaded model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.models.base import VLMAdapter
from engine.models.gemma3 import Gemma3Adapter
from engine.models.llava import LlavaAdapter, LlavaOnevisionAdapter
from engine.models.qwen2_vl import Qwen2VLAdapter
from engine.models.smolvlm import SmolVLMAdapter
from engine.presets import PRESETS, preset_checkpoint

log = logging.getLogger(__name__)

ADAPTERS: dict[str, type[VLMAdapter]] = {
    arch: cls
    for cls in (SmolVLMAdapter, Qwen2VLAdapter, LlavaAdapter, LlavaOnevisionAdapter, Gemma3Adapter)
    for arch in cls.architectures
}


def _is_tiny(name: str) -> bool:
    return name == "tiny" or name.startswith("tiny-")


def resolve_checkpoint(model: str) -> str:
    """`tiny` / `tiny-<family>`, `dummy:<preset>`, a local directory, or a hub id (loaded only where the
    network allows)."""
    if _is_tiny(model) and model in PRESETS:
        return str(preset_checkpoint(model))
    if model.startswith("dummy:"):
        name = model.removeprefix("dummy:")
        if name not in PRESETS or _is_tiny(name):
            known = ", ".join(f"dummy:{p}" for p in PRESETS if not _is_tiny(p))
            raise ValueError(f"unknown dummy preset {model!r}; known: {known}")
        return str(preset_checkpoint(name))
    return model


def read_chat_template(source: str) -> str:
    """A chat template from `source`: a file's text, or the template itself where `source` is Jinja text (as
    vLLM's --chat-template takes either). ValueError for a file that cannot be read or a template that does not
    parse, naming it."""
    from jinja2 import Environment, TemplateSyntaxError

    is_text = "{{" in source or "{%" in source
    if is_text:
        text = source
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template {source!r} could not be read: {exc}") from exc
    try:
        Environment().parse(text)
    except TemplateSyntaxError as exc:
        where = "the chat template given" if is_text else f"chat_template {source!r}"
        raise ValueError(f"{where} is not a Jinja template: line {exc.lineno}: {exc.message}") from exc
    if not text.strip():
        raise ValueError(f"chat_template {source!r} is empty")
    return text


def load_adapter(model: str, device: torch.device, dtype: torch.dtype,
                 chat_template: str | None = None, quantization: str | None = None) -> VLMAdapter:
    """The model's adapter. `chat_template` (a file or Jinja text, `read_chat_template`) replaces the
    checkpoint's own template; `quantization` "int8" quantizes every Linear layer's weight as it is loaded
    (engine/quantization.py `quantize_linears`: the float weights dropped). A compressed-tensors W8A8 checkpoint
    (config.json's `quantization_config`) loads its int8 layers as saved, whatever `quantization` says, and one of
    a scheme the engine cannot run exactly is refused by name."""
    template = read_chat_template(chat_template) if chat_template is not None else None
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = resolve_checkpoint(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as exc:
        where = "local directory" if os.path.isdir(path) else "hub id (needs network access)"
        raise ValueError(f"cannot load model {model!r} as a {where}: {exc}") from exc
    architectures = list(getattr(config, "architectures", None) or [])
    adapter_cls = next((ADAPTERS[a] for a in architectures if a in ADAPTERS), None)
    if adapter_cls is None:
        raise ValueError(
            f"model {model!r} has architecture {architectures or 'unknown'}, which the engine does not support; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    processor = AutoProcessor.from_pretrained(path)
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization is 'int8' or None, got {quantization!r}")
    from engine.quantization import compressed_scheme, load_compressed_model, quantize_linears

    quantization_config = getattr(config, "quantization_config", None)
    if quantization_config is not None and not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    scheme = compressed_scheme(quantization_config)
    if scheme is not None:  # int8 weights as the checkpoint holds them
        hf_model = load_compressed_model(path, config, scheme, dtype, device)
        log.info("compressed-tensors checkpoint: %d Linear layers int8 as saved",
                 sum(type(m).__name__ == "Int8Linear" for m in hf_model.modules()))
    else:
        hf_model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    if quantization == "int8":
        log.info("int8 weights: %d Linear layers quantized at load", quantize_linears(hf_model))
    adapter = adapter_cls(hf_model, processor, device, dtype)
    if template is not None:
        adapter.chat_template = template
    elif adapter.chat_template is None:
        log.warning("model %r has no chat template: prompts are served, chat requests are refused "
                    "(give one with --chat-template FILE)", model)
    return adapter


__all__ = ["ADAPTERS", "VLMAdapter", "load_adapter", "read_chat_template", "resolve_checkpoint"]
