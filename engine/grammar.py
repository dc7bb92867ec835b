"""Grammar-constrained decoding: a request may carry a JSON schema, "any JSON object", a regex, a choice of
strings, an EBNF grammar or a structural tag (free text with tagged, schema-held parts: tool calls), and each step
its allowed next tokens are masked before sampling.

Built on xgrammar (the library vLLM and SGLang use), imported lazily: the engine imports and serves
requests without a grammar when xgrammar is not installed, and only a request that asks for one needs it.

- `GrammarSpec` says what the output must match; it is hashable, so compiled grammars are cached by it.
- `GrammarCompiler` is built once per engine from the tokenizer, over the model's logits width (which may be
  wider than the tokenizer), and compiles a spec into a `Matcher` per request: its limits checked first
  (engine/grammar_limits.py), compiled in a supervised child process (engine/grammar_pool.py).
- `apply_token_masks` masks a batch of logits rows in place: one bitmask for the whole batch, filled by each
  row's matcher on the host, copied to the logits' device once and applied there by xgrammar's kernel.
- `forced_tokens` finds the requests whose grammar allows exactly one next token (jump-forward, in
  engine/engine.py), from the same bitmask rows, which the next `apply_token_masks` then reuses.
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

from engine.grammar_limits import GrammarLimitError, GrammarLimits, check_regex, check_schema
from engine.grammar_pool import GrammarCancelled, GrammarPool, GrammarTimeout
from engine.grammar_utf8 import Utf8Guard


def _parse_json_text(text: object, field: str) -> Any:
    """A spec field given as JSON text, parsed; a ValueError naming `field` if it is not a string or not JSON."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: exactly one of a JSON schema (as JSON text), any JSON object, a regular
    expression, a choice of strings (`choice`, a tuple), an EBNF grammar (xgrammar's dialect, whose `root` rule is the
    output) or a structural tag (xgrammar's, as JSON text: see `tool_calls_tag`). Build one from a parsed schema with
    `GrammarSpec.from_schema`."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = [self.json_schema is not None, self.json_object is True, self.regex is not None,
                 self.choice is not None, self.grammar is not None, self.structural_tag is not None]
        if sum(given) != 1:
            raise ValueError("a grammar needs exactly one of json_schema, json_object=True, regex, choice, grammar or "
                             "structural_tag")
        if self.json_schema is not None:
            schema = _parse_json_text(self.json_schema, "json_schema")
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object or a boolean, got {self.json_schema[:80]!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {str(value)[:80]!r}")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty tuple of non-empty strings, got {str(self.choice)[:80]}")
        if self.structural_tag is not None:
            tag = _parse_json_text(self.structural_tag, "structural_tag")
            if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or "format" not in tag:
                raise ValueError('a structural tag is an object {"type": "structural_tag", "format": ...}, got '
                                 f"{self.structural_tag[:80]!r}")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        """A spec for a JSON schema given parsed (a dict) or as JSON text. Its properties keep their order: the
        output's keys come in the schema's order."""
        if isinstance(schema, str):
            return cls(json_schema=schema)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(json_schema=json.dumps(schema, separators=(",", ":")))

    def describe(self) -> str:
        for name in ("json_schema", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


TOOL_CALL_BEGIN = "<tool_call>"  # the Qwen / Hermes markers of a tool call, around its JSON
TOOL_CALL_END = "</tool_call>"


def tool_call_begin(name: str) -> str:
    """What a call of the function `name` starts with, up to its arguments' JSON."""
    return f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '


def tool_call_end() -> str:
    return f"}}\n{TOOL_CALL_END}"


def tool_calls_tag(functions: list[tuple[str, dict[str, Any] | None]], mode: str, parallel: bool = True) -> GrammarSpec:
    """A structural tag for tool calls, each `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` with
    ARGS held to that function's parameter schema (None: any JSON object). `functions`: (name, schema) in order.
    `mode` "auto": free text, in which each call (its start is the trigger) is held to its function; "required":
    calls only, at least one. `parallel` False: at most one call."""
    if mode not in ("auto", "required"):
        raise ValueError(f"mode must be 'auto' or 'required', got {mode!r}")
    if not functions:
        raise ValueError("tool calls need at least one function")
    tags = [{"type": "tag", "begin": tool_call_begin(name),
             "content": {"type": "json_schema", "json_schema": schema if schema is not None else {"type": "object"}},
             "end": tool_call_end()} for name, schema in functions]
    if mode == "auto":
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN], "tags": tags,
                               "at_least_one": False, "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    return GrammarSpec(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}, separators=(",", ":")))


def _ebnf_literal(text: str) -> str:
    """`text` as a string literal of xgrammar's EBNF."""
    return '"' + "".join(ch if ch.isprintable() and ch not in '"\\' else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
                         else f"\\U{ord(ch):08x}" for ch in text) + '"'


def choice_grammar(choice: tuple[str, ...]) -> str:
    """The EBNF of exactly one of `choice`."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choice)


def _tag_parts(node: Any, schemas: list[Any], regexes: list[str]) -> None:
    """Every JSON schema and regex a structural tag holds its parts to."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            schemas.append(node["json_schema"])
            return
        if node.get("type") == "regex" and isinstance(node.get("pattern"), str):
            regexes.append(node["pattern"])
        for value in node.values():
            _tag_parts(value, schemas, regexes)
    elif isinstance(node, list):
        for value in node:
            _tag_parts(value, schemas, regexes)


def _check_text(text: str, what: str, limits: GrammarLimits) -> None:
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise GrammarLimitError("max_schema_bytes", f"the {what}'s size is {size} bytes, over the limit of "
                                                    f"{limits.max_schema_bytes} (max_schema_bytes)")


# xgrammar 0.2.8 writes the characters of a string with minLength or maxLength as this class, which lets
# control characters through (JSON forbids them unescaped: strict parsers such as Python's json and pydantic
# refuse them); its unbounded strings use the right class. The grammar is fixed in its EBNF text, which keeps
# xgrammar's own cheap repetition (a pattern with the same bounds costs a hundred times more per mask).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_ebnf(xgr: Any, schema: str) -> str:
    """Compact JSON (no whitespace between tokens: a model may not spend its tokens on unbounded
    whitespace) under `schema`, with strings of bounded length held to JSON's characters, as EBNF."""
    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)).replace(_BOUNDED_STRING_CHAR,
                                                                                    _JSON_STRING_CHAR)


def _compile_json_schema(xgr: Any, compiler: Any, schema: str) -> Any:
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    if _BOUNDED_STRING_CHAR not in ebnf:
        return compiler.compile_json_schema(schema, any_whitespace=False)
    return compiler.compile_grammar(_json_schema_ebnf(xgr, schema))


def _compact_tag(xgr: Any, node: Any) -> Any:
    """A structural tag whose JSON schema parts are their compact EBNF (as `_compile_json_schema` compiles a
    schema): xgrammar's own JSON in a tag allows any whitespace."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            return {"type": "grammar", "grammar": _json_schema_ebnf(xgr, json.dumps(node["json_schema"]))}
        return {key: _compact_tag(xgr, value) for key, value in node.items()}
    if isinstance(node, list):
        return [_compact_tag(xgr, value) for value in node]
    return node


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
    `filler` is its compiler's batch mask filler (see `apply_token_masks`); `utf8` its compiler's UTF-8 rule, which
    every mask is held to (engine/grammar_utf8.py), with `utf8_state` where the output stands in it."""

    def __init__(self, matcher: Any, vocab_size: int, filler: BatchFiller, utf8: Utf8Guard) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.filler = filler
        self.utf8 = utf8
        self.utf8_state = 0
        # The allowed next tokens' bitmask row ([1, words], int32, on the host) where `forced_tokens` filled it
        # for the current state; `apply_token_masks` uses it instead of filling it again. Dropped at `accept`.
        self.mask: torch.Tensor | None = None

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the state is unchanged)."""
        accepted = bool(self._matcher.accept_token(int(token_id)))
        if accepted:
            self.mask = None
            self.utf8_state = self.utf8.after(self.utf8_state, int(token_id))
        return accepted

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
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(json.dumps(_compact_tag(xgr, json.loads(text))))
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
        self.utf8 = Utf8Guard(info.decoded_vocab, vocab_size, [*info.special_token_ids, *info.stop_token_ids])

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
        elif spec.choice is not None:
            if len(spec.choice) > self.limits.max_enum_values:
                raise GrammarLimitError("max_enum_values", f"the choice's strings are {len(spec.choice)}, over the "
                                                           f"limit of {self.limits.max_enum_values} (max_enum_values)")
            kind, text = "grammar", choice_grammar(spec.choice)
            _check_text(text, "choice", self.limits)
        elif spec.grammar is not None:
            _check_text(spec.grammar, "grammar", self.limits)
            kind, text = "grammar", spec.grammar
        elif spec.structural_tag is not None:
            # The tag's schemas and regexes count together, as one schema: many tools or huge ones are refused
            # by the same limits as one large response_format.
            _check_text(spec.structural_tag, "structural tag", self.limits)
            schemas: list[Any] = []
            regexes: list[str] = []
            _tag_parts(json.loads(spec.structural_tag), schemas, regexes)
            check_schema(json.dumps({"anyOf": schemas}), self.limits)
            for pattern in regexes:
                check_regex(pattern, self.limits)
            kind, text = "structural_tag", spec.structural_tag
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
        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self.filler, self.utf8)

    def close(self) -> None:
        self.pool.close()


def _fill(xgr: Any, bitmask: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
    """Row `rows[j]` of `bitmask` (on the host) to the tokens `matchers[j]` allows next: the row its last
    `forced_tokens` kept, else filled, all those in one batch by xgrammar's threads; then each held to the UTF-8
    rule from where its output stands."""
    todo = []
    for matcher, row in zip(matchers, rows):
        if matcher.mask is not None:
            bitmask[row] = matcher.mask[0]
        else:
            todo.append((matcher, row))
    if todo:
        todo[0][0].filler.fill(xgr, [matcher._matcher for matcher, _ in todo], bitmask, [row for _, row in todo])
        todo[0][0].utf8.restrict(bitmask, [row for _, row in todo], [matcher.utf8_state for matcher, _ in todo])


def forced_tokens(matchers: list[Matcher]) -> list[int | None]:
    """For each matcher, the one token its grammar allows next, or None where it allows more than one (or none):
    the bitmask rows filled in one batch, counted in tensor ops (words that are not zero, and the bit of the one
    that is), never a loop over the vocabulary. Each row is kept in its matcher for the next `apply_token_masks`."""
    if not matchers:
        return []
    xgr = _xgrammar()
    bitmask = torch.full(xgr.get_bitmask_shape(len(matchers), matchers[0].vocab_size), -1, dtype=torch.int32)
    _fill(xgr, bitmask, matchers, list(range(len(matchers))))
    for i, matcher in enumerate(matchers):
        matcher.mask = bitmask[i : i + 1].clone()
    words = bitmask.to(torch.int64) & 0xFFFFFFFF  # each word's 32 bits, unsigned
    vocab_size = matchers[0].vocab_size
    if vocab_size % 32:  # bits past the vocabulary in the last word do not count
        words[:, -1] &= (1 << (vocab_size % 32)) - 1
    nonzero = words != 0
    word_index = nonzero.to(torch.int8).argmax(dim=-1)
    word = words.gather(-1, word_index[:, None]).squeeze(-1)
    single = (nonzero.sum(dim=-1) == 1) & ((word & (word - 1)) == 0)
    bit = torch.log2(word.clamp(min=1).to(torch.float64)).round().to(torch.int64)
    token = (word_index.to(torch.int64) * 32 + bit).tolist()
    return [t if s else None for t, s in zip(token, single.tolist())]


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
    _fill(xgr, bitmask, [matchers[i] for i in indices], indices)
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=min(vocab_size, logits.shape[-1]),
        indices=None if len(indices) == len(matchers) else indices,
    )
