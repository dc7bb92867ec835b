"""Grammar-constrained decoding: a request may carry a JSON schema, "any JSON object" or a regex, and each
step its allowed next tokens are masked before sampling.

Built on xgrammar (the library vLLM and SGLang use), imported lazily: the engine imports and serves
requests without a grammar when xgrammar is not installed, and only a request that asks for one needs it.

- `GrammarSpec` says what the output must match; it is hashable, so compiled grammars are cached by it.
- `GrammarCompiler` is built once per engine from the tokenizer, over the model's logits width (which may be
  wider than the tokenizer), and compiles a spec into a `Matcher` per request: its limits checked first
  (engine/grammar_limits.py), compiled in a supervised child process (engine/grammar_pool.py).
- `apply_token_masks` masks a batch of logits rows in place: one bitmask for the whole batch, filled by each
  row's matcher on the host, copied to the logits' device once and applied there by xgrammar's kernel.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.grammar_limits import GrammarLimits, check_regex, check_schema
from engine.grammar_pool import GrammarCancelled, GrammarPool, GrammarTimeout


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
    """One request's position in its grammar: which tokens may come next, and whether it has ended.
    `filler` is its compiler's batch mask filler (see `apply_token_masks`)."""

    def __init__(self, matcher: Any, vocab_size: int, filler: BatchFiller) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.filler = filler

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: a stop token was accepted after a complete match."""
        return bool(self._matcher.is_terminated())


class BatchFiller:
    """xgrammar's batch mask filler, with as many threads as torch uses (one per thread count, built once)."""

    def __init__(self) -> None:
        self._fillers: dict[int, Any] = {}

    def fill(self, xgr: Any, matchers: list[Any], bitmask: torch.Tensor, indices: list[int]) -> None:
        threads = torch.get_num_threads()
        if threads not in self._fillers:
            self._fillers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        self._fillers[threads].batch_fill_next_token_bitmask(matchers, bitmask, indices)


def _compile_in_child(xgr: Any, compiler: Any, kind: str, text: str) -> Any:
    """What a compiler child runs (engine/grammar_pool.py): one spec's grammar."""
    if kind == "regex":
        return compiler.compile_regex(text)
    return _compile_json_schema(xgr, compiler, text)


class CompiledCache:
    """Compiled grammars by spec, least recently used dropped first, bounded by their size in memory (a grammar
    larger than the whole bound is used, not kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: GrammarSpec) -> Any | None:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return None
            self._entries.move_to_end(spec)
            return entry[0]

    def put(self, spec: GrammarSpec, compiled: Any, size: int) -> None:
        if size > self.max_bytes:
            return
        with self._lock:
            if spec in self._entries:
                return
            while self.bytes + size > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
            self._entries[spec] = (compiled, size)
            self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer and logits width: limits checked first (engine/grammar_limits.py),
    then compiled in a supervised child process (engine/grammar_pool.py) under a deadline, kept in a cache
    bounded in bytes. Owned by one engine (`Engine.grammars`); `close` ends its children."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 limits: GrammarLimits | None = None) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits or GrammarLimits()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self.pool = GrammarPool(info, self.limits, _compile_in_child)
        self.cache = CompiledCache(self.limits.max_cache_bytes)
        self.filler = BatchFiller()

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Threads of this compiler's own, for callers that must not block theirs while a grammar compiles."""
        return self.pool.executor

    def compile(self, spec: GrammarSpec, cancelled: threading.Event | None = None) -> Any:
        """The compiled grammar of `spec` (cached). ValueError naming the problem if it cannot compile:
        `GrammarLimitError` over a limit, `GrammarTimeout` past the deadline, `GrammarCancelled` once `cancelled`
        is set."""
        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(spec).__name__}")
        compiled = self.cache.get(spec)
        if compiled is not None:
            return compiled
        if spec.regex is not None:
            check_regex(spec.regex, self.limits)
            kind, text = "regex", spec.regex
        else:
            text = '{"type": "object"}' if spec.json_object else spec.json_schema
            check_schema(text, self.limits)
            kind = "json_schema"
        try:
            compiled = self.pool.compile(kind, text, cancelled)
        except (GrammarTimeout, GrammarCancelled):
            raise
        except ValueError as exc:
            raise ValueError(f"the {spec.describe()} grammar could not be compiled: {_clean_error(exc)}") from None
        self.cache.put(spec, compiled, int(compiled.memory_size_bytes))
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request under `spec`."""
        xgr = _xgrammar()
        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self.filler)

    def close(self) -> None:
        self.pool.close()


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
    first = matchers[indices[0]]
    vocab_size = first.vocab_size
    # All bits set: every token allowed, so rows without a matcher could be masked too and stay untouched.
    on_cuda = logits.device.type == "cuda"
    bitmask = torch.full(xgr.get_bitmask_shape(len(matchers), vocab_size), -1, dtype=torch.int32, pin_memory=on_cuda)
    first.filler.fill(xgr, [matchers[i]._matcher for i in indices], bitmask, indices)
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=min(vocab_size, logits.shape[-1]),
        indices=None if len(indices) == len(matchers) else indices,
    )
