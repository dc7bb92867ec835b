"""Request bodies of the OpenAI-compatible routes (the subset this server serves). Types and value
ranges live here, so FastAPI answers 422 for a body that does not fit and the OpenAPI schema documents
them; the handlers check what depends on the server (model name, caps, `n`) and answer 400 or 404."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

MAX_SEED = 2**63 - 1
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, description="vlmcap extension: lower runs first")]
Stop = str | Annotated[list[str], Field(max_length=16)] | None
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=256, description=(
    "vLLM's extension: requests share cached prefixes and image features only with requests of the same salt "
    "(and, on a server with several API keys, of the same key)"))]


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ChatTextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL | str


class VideoURL(BaseModel):
    url: str


class ChatVideoPart(BaseModel):
    """vLLM's extension: a video by URL (`data:video/mp4;base64,...`, or http(s) where remote media are allowed)."""

    type: Literal["video_url"]
    video_url: VideoURL | str


class VideoOptions(BaseModel):
    """vlmcap extension: how frames are taken from the request's videos (within the server's limits)."""

    num_frames: int | None = Field(None, ge=1, description="frames spread evenly over each video")
    fps: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False,
                              description="frames a second instead (up to the server's max_video_frames)")


ChatPart = Annotated[ChatTextPart | ChatImagePart | ChatVideoPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaSpec(BaseModel):
    """`response_format.json_schema` of chat completions. The output is always held to the schema
    (`strict` is accepted and needs no switch)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ResponsesJSONSchemaFormat(JSONSchemaSpec):
    """`text.format` of the Responses API: the schema's fields sit beside `type`."""

    type: Literal["json_schema"]


ResponsesTextFormat = Annotated[TextFormat | JSONObjectFormat | ResponsesJSONSchemaFormat, Field(discriminator="type")]


class ResponsesText(BaseModel):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class SamplingFields(BaseModel):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="vlmcap extension: 0 disables it")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    ignore_eos: bool = Field(False, description="vlmcap extension: generate max_tokens tokens, past EOS")
    priority: Priority = 0
    cache_salt: CacheSalt = None
    video_options: VideoOptions | None = None


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Stop = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description="vlmcap extension: add the generated token ids to choices")
    response_format: ResponseFormat | None = None


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(BaseModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputVideo(BaseModel):
    """A video in a Responses input (no such part in OpenAI's API yet; as vLLM's `video_url` is in chat)."""

    type: Literal["input_video"]
    video_url: str


InputPart = Annotated[InputText | InputImage | InputVideo | ChatVideoPart, Field(discriminator="type")]


class InputMessage(BaseModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]


class ResponsesRequest(SamplingFields):
    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    stop: Stop = None
    text: ResponsesText | None = None
