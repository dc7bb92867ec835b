"""Tool calling (function tools) for chat completions and the Responses API.

- `tool_plan`: a request's `tools`, `tool_choice` and `parallel_tool_calls` as the grammar that holds the output
  (engine/grammar.py `tool_calls_tag`): `required` and a named function force calls, `auto` lets the model write
  text or calls, each call held to its function's parameter schema; `none` (and no tools) adds no grammar.
- `render_tools`: the history and the tools for the chat template: the checkpoint's own template where it takes
  `tools` (Qwen2-VL/2.5-VL's), else one generic rendering (a system turn listing the functions and the call
  format, assistant calls as their `<tool_call>` text, tool results as user turns in `<tool_response>`).
- `ToolCallParser`: the calls of an output, read incrementally by the markers the grammar put there (never
  guessed from free text): text, call starts and argument chunks, for streamed deltas and whole answers alike.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from api.errors import APIError
from engine.grammar import (
    TOOL_CALL_BEGIN,
    GrammarSpec,
    choice_grammar,
    tool_call_begin,
    tool_call_end,
    tool_calls_tag,
)

TOOL_RESPONSE_BEGIN = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def openai(self) -> dict[str, Any]:
        """As transformers' chat templates take a tool: `{"type": "function", "function": {...}}`."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: the functions (for the template), the mode ("none", "auto", "required";
    a named function is "required" of that one), the grammar of the calls (None for "none")."""

    functions: tuple[Function, ...]
    mode: str
    grammar: GrammarSpec | None
    param: str  # the field the grammar's errors name
    parallel: bool = True  # more than one call allowed

    @property
    def calls(self) -> bool:
        return self.grammar is not None


def tool_plan(functions: list[Function], tool_choice: Any, named: str | None, parallel: bool | None,
              param: str = "tools") -> ToolPlan | None:
    """The plan of a request's tools; `tool_choice` "none" / "auto" / "required" / None (auto with tools), `named`
    the function a named choice asks for. APIError 400 naming the field for a choice without tools, an unknown
    name, or two functions of one name. None when there are neither tools nor a choice that needs them."""
    choice_param = "tool_choice.function.name" if param == "tools" else "tool_choice.name"
    if not functions:
        if named is not None or tool_choice == "required":
            raise APIError(400, f"tool_choice {named or tool_choice!r} needs tools, and the request has none",
                           "tool_choice", "invalid_value")
        return None
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"two tools are named {name!r}", f"{param}[{i}]", "invalid_value")
    if named is not None:
        if named not in names:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                                f"({', '.join(names)})", choice_param, "invalid_value")
        chosen = [f for f in functions if f.name == named]
        spec = tool_calls_tag([(f.name, f.parameters) for f in chosen], "required", parallel=False)
        return ToolPlan(tuple(functions), "required", spec, param)
    mode = tool_choice or "auto"
    if mode == "none":
        return ToolPlan(tuple(functions), "none", None, param)
    spec = tool_calls_tag([(f.name, f.parameters) for f in functions], mode, parallel=parallel is not False)
    return ToolPlan(tuple(functions), mode, spec, param, parallel is not False)


def calls_or_answer(plan: ToolPlan, answer: GrammarSpec) -> GrammarSpec:
    """The grammar of `auto` tools beside a structured output, as OpenAI answers it: either tool calls (at least
    one, each held to its function's schema, the plan's parallel rule) or an answer held to the structured output's
    grammar (`answer`), one structural tag whose text branch is that grammar."""
    functions = [(f.name, f.parameters) for f in plan.functions]
    calls = json.loads(tool_calls_tag(functions, "required", parallel=plan.parallel).structural_tag)["format"]
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [calls, answer_format(answer)]}}
    return GrammarSpec(structural_tag=json.dumps(tag, separators=(",", ":")))


def tools_and_answer(plan: ToolPlan | None, answer: GrammarSpec | None,
                     answer_param: str) -> tuple[GrammarSpec | None, str]:
    """A request's grammar and the field its errors name, from its tools' plan and its structured output (`answer`,
    sent at `answer_param`: OpenAI's `response_format`, vLLM's fields, Ollama's `format`): the structured output's
    alone without calls; the calls' for `required` and a named function (calls only, so no answer text); under
    `auto` with a structured output, both (`calls_or_answer`)."""
    if plan is None or not plan.calls:
        return answer, answer_param
    if answer is not None and plan.mode == "auto":
        return calls_or_answer(plan, answer), plan.param
    return plan.grammar, plan.param


def answer_format(spec: GrammarSpec) -> dict[str, Any]:
    """A structured output's grammar as a structural tag's element."""
    if spec.json_schema is not None:
        return {"type": "json_schema", "json_schema": json.loads(spec.json_schema)}
    if spec.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "grammar", "grammar": choice_grammar(spec.choice)}
    if spec.grammar is not None:
        return {"type": "grammar", "grammar": spec.grammar}
    return json.loads(spec.structural_tag)["format"]


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template (`Engine.chat_template`) renders `tools` itself (its source uses the variable)."""
    return isinstance(template, str) and "tools" in template


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (the grammar's form), for a history rendered without the template's tools."""
    return f"{tool_call_begin(name)}{arguments}{tool_call_end()}"


def generic_tools_turn(functions: tuple[Function, ...]) -> str:
    lines = ["You can call these functions. To call one, write only", f"{TOOL_CALL_BEGIN}",
             '{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}',
             "</tool_call>", "Functions:"]
    lines += [json.dumps(f.openai()["function"], ensure_ascii=False) for f in functions]
    return "\n".join(lines)


def _arguments(arguments: str, param: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{param} is not JSON: {exc}", param, "invalid_value") from None


def render_tools(messages: list[dict[str, Any]], functions: tuple[Function, ...], native: bool) -> list[dict[str, Any]]:
    """`messages` in the engine's form, whose assistant turns may carry `tool_calls` ([(id, name, arguments text,
    param)]) and whose `tool` turns carry `tool_call_id`, made ready for the chat template. `native`: the
    template takes `tools` and `tool_calls` (transformers' form: arguments as objects); else the generic rendering
    in text (see the module's doc)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls") or []
        role = message["role"]
        if native:
            turn = {key: value for key, value in message.items() if key != "tool_calls"}
            if calls:
                turn["tool_calls"] = [
                    {"id": call_id, "type": "function", "function": {"name": name,
                                                                     "arguments": _arguments(arguments, param)}}
                    for call_id, name, arguments, param in calls]
            rendered.append(turn)
            continue
        content = list(message["content"])
        for _, _, arguments, param in calls:
            _arguments(arguments, param)  # JSON, as the template's own rendering needs it
        if calls:
            content.append({"type": "text", "text": "\n".join(call_text(name, arguments)
                                                              for _, name, arguments, _ in calls)})
        if role == "tool":
            texts = "".join(part.get("text", "") for part in content)
            content = [{"type": "text", "text": f"{TOOL_RESPONSE_BEGIN}\n{texts}\n{TOOL_RESPONSE_END}"}]
            role = "user"
        rendered.append({"role": role, "content": content})
    if functions and not native:
        turn = {"type": "text", "text": generic_tools_turn(functions)}
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": [*rendered[0]["content"], {"type": "text", "text": "\n\n"},
                                                         turn]}
        else:
            rendered.insert(0, {"role": "system", "content": [turn]})
    return rendered


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallParser:
    """Reads an output held by a `ToolPlan`'s grammar as it grows: `feed(delta)` returns events in order,
    ("text", text), ("call", ParsedCall) when a call's name is known, ("arguments", ParsedCall, chunk); text that
    may still become a marker is held back until it is known. Whitespace between and after calls (the
    separator) is not text."""

    names: tuple[str, ...]
    calls: list[ParsedCall] = field(default_factory=list)
    text: str = ""
    _buffer: str = ""
    _current: ParsedCall | None = None
    _pending_space: str = ""

    def __post_init__(self) -> None:
        self._begins = {tool_call_begin(name): name for name in self.names}
        self._end = tool_call_end()

    @staticmethod
    def _held(text: str, marker: str) -> int:
        """Length of the longest end of `text` that begins `marker`."""
        for size in range(min(len(text), len(marker) - 1), 0, -1):
            if marker.startswith(text[-size:]):
                return size
        return 0

    def _emit_text(self, text: str, events: list[tuple]) -> None:
        if not text:
            return
        if self.calls:  # after a call: whitespace waits until text follows it
            if not (self._pending_space + text).strip():
                self._pending_space += text
                return
            text, self._pending_space = self._pending_space + text, ""
        self.text += text
        events.append(("text", text))

    def feed(self, delta: str, final: bool = False) -> list[tuple]:
        self._buffer += delta
        events: list[tuple] = []
        while self._buffer:
            if self._current is None:
                at = self._buffer.find(TOOL_CALL_BEGIN)
                if at < 0:
                    keep = 0 if final else self._held(self._buffer, TOOL_CALL_BEGIN)
                    self._emit_text(self._buffer[:len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._emit_text(self._buffer[:at], events)
                self._buffer = self._buffer[at:]
                begin = next((b for b in self._begins if self._buffer.startswith(b)), None)
                if begin is None:
                    if not final and any(b.startswith(self._buffer) for b in self._begins):
                        break  # the call's start is still arriving
                    self._emit_text(TOOL_CALL_BEGIN, events)  # not a call the grammar allows: text
                    self._buffer = self._buffer[len(TOOL_CALL_BEGIN):]
                    continue
                self._current = ParsedCall(len(self.calls), new_call_id(), self._begins[begin])
                self.calls.append(self._current)
                self._buffer = self._buffer[len(begin):]
                events.append(("call", self._current))
                continue
            at = self._buffer.find(self._end)
            if at < 0:
                # A tail that may be the end marker waits; at the end of a cut output it is the marker's start.
                keep = self._held(self._buffer, self._end)
                chunk, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if final:
                    self._buffer = ""
                if chunk:
                    self._current.arguments += chunk
                    events.append(("arguments", self._current, chunk))
                break
            chunk = self._buffer[:at]
            if chunk:
                self._current.arguments += chunk
                events.append(("arguments", self._current, chunk))
            self._current.complete = True
            self._current = None
            self._buffer = self._buffer[at + len(self._end):]
        return events
