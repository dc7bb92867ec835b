"""What a grammar may ask of the compiler, checked before anything is compiled.

xgrammar compiles recursively and expands bounded repetitions: a regex nested thousands deep overflows the C
stack, `a{1,8000}` takes seconds, thousands of optional properties or enum values take tens of seconds and
hundreds of MB. `check_schema` and `check_regex` walk a spec (iteratively: a deep schema cannot overflow Python's
stack either) and raise `GrammarLimitError` naming the limit and the value. `check_schema` also refuses every
`$ref` that points outside the schema: nothing is ever fetched for a grammar, and a reference the compiler cannot
follow is an error, not a silent "any value" (what xgrammar makes of one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar, and how compiling is run (engine/grammar_pool.py). Each entry's first sentence is
    its `vlmcap serve` option's help.

    max_schema_bytes: the largest JSON schema, in bytes of its text (UTF-8).
    max_schema_depth: the deepest nesting of a schema's JSON objects and arrays.
    max_regex_chars: the longest regex (the grammar's own or a schema's `pattern`).
    max_regex_depth: the deepest nesting of a regex's groups and classes.
    max_repetition: the largest bounded repetition of a regex. `{m,n}`, nested ones multiplied (xgrammar expands
        them, about quadratically); a schema's `minLength`/`maxLength`/`minItems`/`maxItems` compile in constant
        size and are not limited.
    max_total_repetition: the sum of all repetition bounds of a grammar (every `{m,n}` of its regex, or of all its
        schema's patterns): each within max_repetition, their sum bounds the compile's cost.
    max_enum_values: the most `enum` values plus `const`s in a whole schema.
    max_properties: the most `properties` entries in a whole schema.
    compile_timeout_s: seconds one grammar may take to compile (its child process is killed past it).
    workers: child processes that compile grammars (each one compile at a time).
    max_cache_bytes: compiled grammars kept for reuse, by their size in memory.
    """

    max_schema_bytes: int = 64 * 1024
    max_schema_depth: int = 64
    max_regex_chars: int = 2048
    max_regex_depth: int = 32
    max_repetition: int = 1024
    max_total_repetition: int = 8192
    max_enum_values: int = 256
    max_properties: int = 64
    compile_timeout_s: float = 10.0
    workers: int = 2
    max_cache_bytes: int = 128 * 1024 * 1024

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GrammarLimits.{name} must be a positive number, got {value!r}")


class GrammarLimitError(ValueError):
    """A grammar over one of `GrammarLimits`; `limit` names the field (HTTP: 413 for max_schema_bytes, else 400)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def _over(limit: str, what: str, value: int, bound: int) -> GrammarLimitError:
    return GrammarLimitError(limit, f"{what} is {value}, over the limit of {bound} ({limit})")


_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
_QUANTIFIER = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_regex(pattern: str, limits: GrammarLimits, where: str = "regex", spent: int = 0) -> int:
    """Length, group nesting and repetition bounds of a regex (a repetition inside a repeated group counts
    as their product); `spent`: the repetition already counted in the same grammar. Returns the grammar's
    repetition with this regex's (at most max_total_repetition)."""
    if len(pattern) > limits.max_regex_chars:
        raise _over("max_regex_chars", f"the {where}'s length", len(pattern), limits.max_regex_chars)
    depth = 0
    products = [1]  # per open group: the largest repetition product inside it
    last_group = 1  # the product of the group that just closed (a quantifier after it multiplies it)
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            last_group = 1
            continue
        if in_class:
            in_class = char != "]"
            depth -= not in_class
        elif char == "[":
            in_class, depth = True, depth + 1
        elif char == "(":
            depth += 1
            products.append(1)
        elif char == ")" and len(products) > 1:
            depth -= 1
            last_group = products.pop()
            products[-1] = max(products[-1], last_group)
            i += 1
            continue
        elif char == "{" and (match := _QUANTIFIER.match(pattern, i)):
            bound = max(int(n) for n in match.groups() if n) if any(match.groups()) else 0
            product = bound * last_group
            if product > limits.max_repetition:
                raise _over("max_repetition", f"a repetition bound in the {where}", product, limits.max_repetition)
            spent += product
            if spent > limits.max_total_repetition:
                raise _over("max_total_repetition", f"the grammar's repetition bounds together (at the {where})",
                            spent, limits.max_total_repetition)
            products[-1] = max(products[-1], product)
            i = match.end()
            last_group = 1
            continue
        if depth > limits.max_regex_depth:
            raise _over("max_regex_depth", f"the nesting of the {where}'s groups", depth, limits.max_regex_depth)
        last_group = 1
        i += 1
    return spent


def check_schema(schema_text: str, limits: GrammarLimits) -> None:
    """Size, depth, counts, repetition bounds, patterns and references of a JSON schema given as text."""
    size = len(schema_text.encode())
    if size > limits.max_schema_bytes:
        raise _over("max_schema_bytes", "the schema's size in bytes", size, limits.max_schema_bytes)
    schema = json.loads(schema_text)
    enums = properties = repetition = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_schema_depth:
            raise _over("max_schema_depth", "the schema's nesting depth", depth, limits.max_schema_depth)
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _REFS and isinstance(value, str) and not value.startswith("#"):
                raise ValueError(f"{key} {value[:200]!r} points outside the schema: only references within it "
                                 "(#/...) are followed, nothing is fetched")
            if key == "pattern" and isinstance(value, str):
                repetition = check_regex(value, limits, "schema's pattern", repetition)
            elif key == "patternProperties" and isinstance(value, dict):
                for pattern in value:
                    repetition = check_regex(pattern, limits, "schema's patternProperties", repetition)
            elif key == "enum" and isinstance(value, list):
                enums += len(value)
            elif key == "const":
                enums += 1
            elif key == "properties" and isinstance(value, dict):
                properties += len(value)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
        if enums > limits.max_enum_values:
            raise _over("max_enum_values", "the schema's enum and const values", enums, limits.max_enum_values)
        if properties > limits.max_properties:
            raise _over("max_properties", "the schema's properties", properties, limits.max_properties)
