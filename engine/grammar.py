"""Grammar-constrained decoding: a request may carry a JSON schema, "any JSON object" or a regex, and each
step its allowed next tokens are masked before sampling.

Built on xgrammar (the library vLLM and SGLang use), imported lazily: the engine imports and serves
requests without a grammar when xgrammar is not installed, and only a request that asks for one needs it.

- `GrammarSpec` says what the output must match; it is hashable, so compiled grammars are cached by it.
- `GrammarCompiler` is built once per engine from the tokenizer, over the model's logits width (which may be
  wider than the tokenizer), and compiles a spec into a `Matcher` per request.
- `apply_token_masks` masks a batch of logits rows in place: one bitmask for the whole batch, filled by each
  row's matcher on the host, copied to the logits' device once and applied there by xgrammar's kernel.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

# Compiled grammars kept per compiler (a schema compiles in milliseconds, but a server sees the same few).
COMPILED_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: exactly one of a JSON schema (as JSON text), any JSON object,
    or a regular expression. Build one from a parsed schema with `GrammarSpec.from_schema`."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None

    def __post_init__(self) -> None:
        given = [self.json_schema is not None, self.json_object is True, self.regex is not None]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if sum(given) != 1:
            raise ValueError("a grammar needs exactly one of json_schema, json_object=True or regex")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise ValueError(f"json_schema must be JSON text, got {type(self.json_schema).__name__}")
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object or a boolean, got {self.json_schema[:80]!r}")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        """A spec for a JSON schema given parsed (a dict) or as JSON text."""
        if isinstance(schema, str):
            return cls(json_schema=schema)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(json_schema=json.dumps(schema, sort_keys=True, separators=(",", ":")))

    def describe(self) -> str:
        if self.json_schema is not None:
            return "json_schema"
        return "json_object" if self.json_object else "regex"


# xgrammar 0.2.8 writes the characters of a string with minLength or maxLength as this class, which lets
# control characters through (JSON forbids them unescaped: strict parsers such as Python's json and pydantic
# refuse them); its unbounded strings use the right class. The grammar is fixed in its EBNF text, which keeps
# xgrammar's own cheap repetition (a pattern with the same bounds costs a hundred times more per mask).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _compile_json_schema(xgr: Any, compiler: Any, schema: str) -> Any:
    """Compact JSON (no whitespace between tokens: a model may not spend its tokens on unbounded
    whitespace) under `schema`, with strings of bounded length held to JSON's characters."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    fixed = ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    if fixed == ebnf:
        return compiler.compile_json_schema(schema, any_whitespace=False)
    return compiler.compile_grammar(fixed)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # the engine runs without it; only constrained requests need it
        raise ValueError(
            "structured output needs the xgrammar package, which is not installed (pip install xgrammar)"
        ) from exc
    return xgrammar


# xgrammar's messages start with a timestamp and the C++ source line: "[11:09:39] /project/cpp/x.cc:83: "
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean_error(exc: Exception) -> str:
    text = _NATIVE_PREFIX.sub("", str(exc).strip())
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text.splitlines()[0] if text else type(exc).__name__


class Matcher:
    """One request's position in its grammar: which tokens may come next, and whether it has ended."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: a stop token was accepted after a complete match."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer and logits width, caching compiled grammars by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=False)
        self._compiled: dict[GrammarSpec, Any] = {}
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached); ValueError naming the problem if it cannot compile."""
        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(spec).__name__}")
        with self._lock:
            compiled = self._compiled.get(spec)
        if compiled is not None:
            return compiled
        xgr = _xgrammar()
        try:
            if spec.json_schema is not None:
                compiled = _compile_json_schema(xgr, self._compiler, spec.json_schema)
            elif spec.json_object:
                compiled = _compile_json_schema(xgr, self._compiler, '{"type": "object"}')
            else:
                compiled = self._compiler.compile_regex(spec.regex)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) from its C++ core
            raise ValueError(f"the {spec.describe()} grammar could not be compiled: {_clean_error(exc)}") from exc
        with self._lock:
            if len(self._compiled) >= COMPILED_CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = compiled
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request under `spec`."""
        xgr = _xgrammar()
        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


def apply_token_masks(logits: torch.Tensor, matchers: list[Matcher | None]) -> None:
    """Mask, in place, row i of `logits` ([rows, vocab], float32) to the tokens `matchers[i]` allows; rows whose
    matcher is None are untouched. One bitmask for the batch: its rows filled on the host by xgrammar's threads
    (as many as torch's), one copy to the logits' device, applied there by xgrammar's kernel."""
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} rows of logits")
    indices = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not indices:
        return
    xgr = _xgrammar()
    vocab_size = matchers[indices[0]].vocab_size
    # All bits set: every token allowed, so rows without a matcher could be masked too and stay untouched.
    on_cuda = logits.device.type == "cuda"
    bitmask = torch.full(xgr.get_bitmask_shape(len(matchers), vocab_size), -1, dtype=torch.int32, pin_memory=on_cuda)
    _batch_matcher(xgr).batch_fill_next_token_bitmask([matchers[i]._matcher for i in indices], bitmask, indices)
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=min(vocab_size, logits.shape[-1]),
        indices=None if len(indices) == len(matchers) else indices,
    )


_batch_matchers: dict[int, Any] = {}


def _batch_matcher(xgr: Any) -> Any:
    """xgrammar's batch filler with as many threads as torch uses (one per thread count, built once)."""
    threads = torch.get_num_threads()
    if threads not in _batch_matchers:
        _batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    return _batch_matchers[threads]
