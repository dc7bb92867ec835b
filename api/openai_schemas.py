"""Request bodies of the OpenAI-compatible routes (the subset this server serves). Types and value
ranges live here, so a body that does not fit answers 400 naming the field (api/errors.py) and the OpenAPI schema
documents them; the handlers check what depends on the server (model name, caps, priority floor, parameters this server
does not support) and answer 400 or 404.

Numeric sampling fields take their bounds from the engine's table (`engine.sampling.SAMPLING_RANGES`: what the
sampler can compute; floats finite), so a value the engine would refuse never passes the schema. A body's top-level
fields that this server does not know are kept (`extra="allow"`) so that the handler can refuse them by name
(`refuse_unsupported`): a parameter is honoured or refused, never ignored. Nested objects forbid unknown fields
(`Strict`); the fields OpenAI's own types have there and that need nothing of this server (a message's `name`,
an assistant turn's `refusal`) are declared and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from api.errors import APIError
from engine.block_hash import MAX_CACHE_SALT
from engine.sampling import INT64_MAX, MAX_LOGPROBS, SAMPLING_RANGES

Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, description="vlmcap extension: lower runs first")]
Stop = str | Annotated[list[str], Field(max_length=16)] | None
PromptLogprobs = Field(None, ge=0, le=MAX_LOGPROBS, description=(
    "vLLM's extension: each prompt token's log-probability and this many likeliest alternatives (not streamed)"))
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=MAX_CACHE_SALT, description=(
    "vLLM's extension: requests share cached prefixes and image features only with requests of the same salt "
    "(and, on a server with several API keys, of the same key)"))]


class Strict(BaseModel):
    """A nested object of a request: a field it does not declare answers 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ImageURL(Strict):
    url: str
    detail: str | None = None


class ChatTextPart(Strict):
    type: Literal["text"]
    text: str


class ChatImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


class VideoURL(Strict):
    url: str


class ChatVideoPart(Strict):
    """vLLM's extension: a video by URL (`data:video/mp4;base64,...`, or http(s) where remote media are allowed)."""

    type: Literal["video_url"]
    video_url: VideoURL | str


class VideoOptions(Strict):
    """vlmcap extension: how frames are taken from the request's videos (within the server's limits)."""

    num_frames: int | None = Field(None, ge=1, description="frames spread evenly over each video")
    fps: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False,
                              description="frames a second instead (up to the server's max_video_frames)")


class ChatRefusalPart(Strict):
    """An assistant turn's refusal, in its history: rendered as its text."""

    type: Literal["refusal"]
    refusal: str


ChatPart = Annotated[ChatTextPart | ChatImagePart | ChatVideoPart | ChatRefusalPart, Field(discriminator="type")]


class FunctionCall(Strict):
    """A call's function: its name and its arguments as JSON text (OpenAI's form)."""

    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """A turn of the history. `tool_calls` (assistant) and `tool_call_id` (tool) are rendered with the tools
    (api/tools.py); `name`, `refusal` and `audio` are OpenAI's and ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ChatPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None


class StreamOptions(Strict):
    """`include_usage`: a last chunk with the usage; `continuous_usage_stats` (vLLM's): the usage so far in every
    chunk; `include_obfuscation` (OpenAI's padding against length side channels) is accepted and ignored."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(Strict):
    """A function tool. Its calls' arguments are always held to `parameters` (a JSON schema; none: any JSON
    object), so `strict` needs no switch."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, any JSON object, a regex, a choice of strings or
    an EBNF grammar (xgrammar's dialect, GBNF-like) for the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None


class JSONSchemaSpec(Strict):
    """`response_format.json_schema` of chat completions. The output is always held to the schema
    (`strict` is accepted and needs no switch)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ResponsesJSONSchemaFormat(JSONSchemaSpec):
    """`text.format` of the Responses API: the schema's fields sit beside `type`."""

    type: Literal["json_schema"]


ResponsesTextFormat = Annotated[TextFormat | JSONObjectFormat | ResponsesJSONSchemaFormat, Field(discriminator="type")]


class ResponsesText(Strict):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


def ranged(name: str, **extra: Any) -> Any:
    """A field bounded as the engine's sampler bounds it (`SAMPLING_RANGES[name]`), None by default."""
    allowed = SAMPLING_RANGES[name]
    bounds: dict[str, Any] = {"gt" if allowed.low_open else "ge": allowed.low, "le": allowed.high}
    if not allowed.integer:
        bounds["allow_inf_nan"] = False
    return Field(None, **bounds, **extra)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: float | None = ranged("temperature")
    top_p: float | None = ranged("top_p")
    top_k: int | None = ranged("top_k", description="vlmcap extension: -1 or 0 disables it")
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX, description="an int64; negative too, as OpenAI takes")
    ignore_eos: bool = Field(False, description="vlmcap extension: generate max_tokens tokens, past EOS")
    priority: Priority = 0
    cache_salt: CacheSalt = None
    video_options: VideoOptions | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM's older structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older structured_outputs.grammar")


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = ranged("max_tokens")
    max_completion_tokens: int | None = ranged("max_tokens")
    stop: Stop = None
    n: int | None = Field(1, ge=1, le=INT64_MAX)
    presence_penalty: float | None = ranged("presence_penalty")
    frequency_penalty: float | None = ranged("frequency_penalty")
    repetition_penalty: float | None = ranged("repetition_penalty", description="vLLM's extension: 1 is off")
    min_tokens: int | None = ranged("min_tokens", description="vLLM's extension: EOS held back until then")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="vLLM's extension")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = PromptLogprobs
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description=(
        "vLLM's extension: the prompt's token ids (`prompt_token_ids`) and each choice's generated ones (`token_ids`)"))
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="keep the completion for GET /v1/chat/completions/{id}")
    metadata: dict[str, Any] | None = Field(None, description="up to 16 string pairs, kept with a stored completion")


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputVideo(Strict):
    """A video in a Responses input (no such part in OpenAI's API yet; as vLLM's `video_url` is in chat)."""

    type: Literal["input_video"]
    video_url: str


InputPart = Annotated[InputText | InputImage | InputVideo | ChatVideoPart, Field(discriminator="type")]


class InputMessage(Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class InputFunctionCall(Strict):
    """A function call the model made earlier (a `function_call` output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class InputFunctionCallOutput(Strict):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


def _input_item_type(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[InputFunctionCall, Tag("function_call")]
                      | Annotated[InputFunctionCallOutput, Tag("function_call_output")],
                      Discriminator(_input_item_type)]


class ResponsesTool(Strict):
    """A function tool of the Responses API: the definition's fields beside `type`."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(Strict):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["none", "auto", "required"] | ResponsesNamedToolChoice


class ResponsesRequest(SamplingFields):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = ranged("max_tokens")
    stream: bool | None = False
    stop: Stop = None
    text: ResponsesText | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None


# Parameters a client may send that need nothing of this server in the value given (None: any value). Any other
# field the body has, or one of these with another value, is refused with a 400 naming it.
NEUTRAL_VALUES: dict[str, tuple[Any, ...] | None] = {
    "user": None, "metadata": None, "store": (False, None), "service_tier": ("auto", "default", None),
    "prompt_cache_key": None, "safety_identifier": None, "functions": ([], None), "function_call": ("none", None),
    "logit_bias": ({}, None), "modalities": (["text"], None),
    "truncation": ("disabled", None), "reasoning": (None,), "include": ([], None),
}


def refuse_unsupported(body: BaseModel) -> None:
    """APIError 400 for the first field of `body` this server does not honour (see NEUTRAL_VALUES)."""
    for name, value in (body.model_extra or {}).items():
        neutral = NEUTRAL_VALUES.get(name, ())
        if neutral is None or any(value == allowed and type(value) is type(allowed) for allowed in neutral):
            continue
        raise APIError(400, f"{name} is not supported by this server (given {str(value)[:80]!r}); send it only "
                            "with its default, or not at all", name, "unsupported_parameter")


def client_priority(priority: int | None, default: int, min_client_priority: int) -> int:
    """A request's priority: `default` when it sets none; APIError 400 below the server's floor."""
    if priority is None:
        return default
    if priority < min_client_priority:
        raise APIError(400, f"priority {priority} is below this server's floor of {min_client_priority} (lower runs "
                            "first; min_client_priority)", "priority", "priority_too_low")
    return priority
