"""`vlmcap bench soak`: a bounded soak of a real server, on loopback only.

The soak starts its own embedded Redis and its own `vlmcap serve` (a subprocess listening on 127.0.0.1),
then for `duration` seconds keeps `chats` streaming chats going, sends REST captions and camera jobs at
steady rates, and replaces a share `hostile_fraction` of each with a hostile one (the cases of issue 13 and
more: extreme sampling values, deep or NaN JSON, decompression bombs, truncated images, oversized chunked
bodies, unknown methods, foreign Host headers, cross-site posts, bad `cache_salt`s, one event stream more than
the server's cap, grammars past their limits, schema `$ref`s outside the schema, unsupported parameters,
priorities below the floor, tools with too many or too large schemas; camera jobs with malformed fields,
unusable schemas or frames past their limits; media: concat scripts naming a server file, SDP descriptions,
progressive JPEGs of a thousand scans).
Every third good job is an event of several frames (captioned as one prompt), every fifth a
fall, whose alert goes to a webhook receiver that answers with an SSH banner: the webhook must stay alive,
counting failures. Then it
waits for every camera job to end and reports: requests by kind and status, jobs done, dead and lost,
jobs captioned twice, the server's resident memory over time (start = after `warmup`), and the inter-token
latency of the good chats. What must hold: no 5xx (but the 503 with Retry-After that refuses a stream past
the cap), good requests 2xx, hostile ones 4xx (or served
normally where the input is merely odd), good jobs done, bad jobs dead once, none lost or captioned twice,
memory flat after warm-up.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import httpx

from api.percentiles import percentiles_ms
from bench.configs import SoakConfig
from bench.report import listens, machine, photo_paths, pyplot, save_figure


@dataclass
class Outcome:
    kind: str  # "chat", "caption", "events", "ask", "mcp", "tools" (chats with function tools), "completions",
    # "ollama" (the drop-in routes), "summary", or "hostile:<name>"
    status: int | None  # None: no answer (connection error), with `error`
    error: str | None = None


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # gaps between streamed tokens of good chats
    ttft: list[float] = field(default_factory=list)
    good_jobs: list[str] = field(default_factory=list)
    bad_jobs: list[str] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds since load began, RSS MiB)
    heavy_jobs: list[str] = field(default_factory=list)  # valid jobs of hostile media (the latency rounds' burst)
    latency: dict[str, Any] = field(default_factory=dict)  # a plain chat and a fall alert, alone vs hostile load


# -- hostile inputs -----------------------------------------------------------------------------------

def _png(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(out, format="PNG")
    return out.getvalue()


def bomb_png() -> bytes:
    """A real 4x4 PNG whose header claims 20000x20000 pixels (past Pillow's own bomb limit)."""
    data = bytearray(_png(4, 4))
    ihdr = data[12:29]
    ihdr[4:12] = struct.pack(">II", 20000, 20000)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def data_url(data: bytes, media: str = "image/jpeg") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of a JPEG's segments; a scan's segment runs on over its entropy-coded data."""
    pos, found = 2, []
    while pos < len(data):
        marker = data[pos + 1]
        if marker == 0xD9:
            found.append((marker, pos, pos + 2))
            break
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:
            while not (data[end] == 0xFF and data[end + 1] != 0 and not 0xD0 <= data[end + 1] <= 0xD7):
                end += 1
        found.append((marker, pos, end))
        pos = end
    return found


def many_scans_jpeg(side: int, copies: int) -> bytes:
    """A progressive JPEG of `side` x `side` with one of its luma AC scans repeated `copies` times: a few bytes
    each (a flat image's coefficients are end-of-band runs), a pass over every block each when decoded (libjpeg
    warns of the bogus progression and decodes it): small and within the pixel limit, seconds to decode."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 130, 140)).save(out, "JPEG", progressive=True, quality=90)
    data = out.getvalue()
    segments = jpeg_segments(data)
    luma = [(start, end) for marker, start, end in segments
            if marker == 0xDA and data[start + 4] == 1 and data[start + 5] == 1]
    start, end = min(luma, key=lambda span: span[1] - span[0])
    last = segments[-1][1]
    return data[:last] + data[start:end] * copies + data[last:]


class Client:
    """The soak's requests to one server."""

    def __init__(self, http: httpx.AsyncClient, cfg: SoakConfig, photos: list[bytes], model: str) -> None:
        self.http = http
        self.cfg = cfg
        self.photos = photos
        self.model = model
        self.bomb = bomb_png()
        self.many_scans = many_scans_jpeg(3000, 1000)  # about a second of decoding, in the media box
        self.flooding = asyncio.Lock()  # one stream flood at a time, so that each one alone meets the cap

    def chat_body(self, content: Any, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.cfg.max_tokens, **extra}

    async def good_chat(self, tally: Tally, rng: random.Random) -> None:
        body = self.chat_body(f"Tell me about the bus stop, number {rng.randrange(1000)}.", stream=True,
                              temperature=0, ignore_eos=True)
        sent = time.perf_counter()
        last = None
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.outcomes.append(Outcome("chat", 500, chunk["error"]["message"]))
                        return
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        now = time.perf_counter()
                        if last is None:
                            tally.ttft.append(now - sent)
                        else:
                            tally.itl.append(now - last)
                        last = now
                tally.outcomes.append(Outcome("chat", response.status_code))
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("chat", None, f"{type(exc).__name__}: {exc}"))

    async def good_caption(self, tally: Tally, rng: random.Random) -> None:
        photo = rng.choice(self.photos)
        await self._record(tally, "caption", self.http.post(
            "/v1/captions?wait=true", files={"image": ("photo.jpg", photo, "image/jpeg")},
            data={"camera_id": "soak-rest", "max_tokens": str(self.cfg.max_tokens)}))

    async def good_event_search(self, tally: Tally, rng: random.Random) -> None:
        """The camera memory: a word of the captions, the falls, an event's similar ones, or an embedding."""
        choice = rng.randrange(4)
        if choice == 0:
            request = self.http.get("/v1/events", params={"q": rng.choice(("person", "the", "a", "bus")),
                                                          "camera": "soak-cam"})
        elif choice == 1:
            request = self.http.get("/v1/events", params={"fall": "true", "limit": 20})
        elif choice == 2:
            newest = (await self.http.get("/v1/events", params={"limit": 1})).json().get("data") or []
            request = (self.http.get(f"/v1/events/{newest[0]['id']}/similar") if newest
                       else self.http.get("/v1/events"))
        else:
            request = self.http.post("/v1/embeddings", json={"input": [data_url(rng.choice(self.photos)), "a coat"]})
        await self._record(tally, "events", request)

    async def good_summary(self, tally: Tally, rng: random.Random) -> None:
        """The soak camera's summary over a window of a minute to a week (its captions condensed to the context)."""
        window = rng.choice((60, 3600, 7 * 24 * 3600))
        await self._record(tally, "summary", self.http.post("/v1/cameras/soak-cam/summary",
                                                            json={"window_s": window}))

    async def good_ask(self, tally: Tally, rng: random.Random) -> None:
        """The camera memory asked: a question over POST /v1/cameras/ask (now and then streamed), or an MCP tool
        call (search_events, get_event of the newest event) as raw JSON-RPC on /v1/mcp."""
        choice = rng.randrange(3)
        if choice == 0:
            body = {"question": rng.choice(("Who waited at the bus?", "Did anyone fall?", "What happened?")),
                    "max_tokens": self.cfg.max_tokens, "max_frames": 2, "stream": rng.random() < 0.5}
            await self._record(tally, "ask", self.http.post("/v1/cameras/ask", json=body))
            return
        if choice == 1:
            call = {"name": "search_events", "arguments": {"query": rng.choice(("person", "bus")), "limit": 5}}
        else:
            newest = (await self.http.get("/v1/events", params={"limit": 1})).json().get("data") or []
            call = {"name": "get_event", "arguments": {"event_id": newest[0]["id"] if newest else "none", "frames": 1}}
        await self._record(tally, "mcp", self.http.post("/v1/mcp", headers=MCP_HEADERS, json={
            "jsonrpc": "2.0", "id": rng.randrange(10**6), "method": "tools/call", "params": call}))

    async def good_tools(self, tally: Tally, rng: random.Random) -> None:
        """A chat with tools (a named function, `required` or `auto`): 2xx, and every finished call's arguments
        valid under its function's schema (a call that is not counts as a 500)."""
        choice = rng.choice([{"type": "function", "function": {"name": "weather"}}, "required", "auto"])
        body = self.chat_body(f"Weather at stop {rng.randrange(1000)}?", tools=SOAK_TOOLS, tool_choice=choice,
                              parallel_tool_calls=False, temperature=1.0, seed=rng.randrange(2**31),
                              max_tokens=TOOL_MAX_TOKENS)
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("tools", None, f"{type(exc).__name__}: {exc}"))
            return
        status, error = response.status_code, None
        if status == 200:
            choice_out = response.json()["choices"][0]
            if choice_out["finish_reason"] == "tool_calls":
                for call in choice_out["message"]["tool_calls"]:
                    if not _valid_call(call["function"]["name"], call["function"]["arguments"]):
                        status, error = 500, f"invalid tool call {call['function']}"
        tally.outcomes.append(Outcome("tools", status, error))

    async def good_clients(self, tally: Tally, rng: random.Random) -> None:
        """The drop-in routes (issue 36): /v1/completions with n=2 (now and then streamed) or Ollama's /api/generate
        with an image, /api/chat streamed as NDJSON, or /api/chat with tools beside a format (`ollama_tools`); a
        stream whose lines carry an error counts as a 500. Also lm-eval's loglikelihood call (echo, logprobs: the
        prompt's tokens scored) and a stored chat completion read back and deleted."""
        choice = rng.randrange(6)
        if choice == 3:
            await self.scored_prompt(tally, rng)
            return
        if choice == 5:
            await self.ollama_tools(tally, rng)
            return
        if choice == 4:
            await self.stored_chat(tally, rng)
            return
        if choice == 0:
            body = {"model": self.model, "prompt": f"Bus stop {rng.randrange(1000)}:", "n": 2,
                    "seed": rng.randrange(2**31), "max_tokens": self.cfg.max_tokens, "stream": rng.random() < 0.5}
            await self._record(tally, "completions", self.http.post("/v1/completions", json=body))
            return
        if choice == 1:
            body = {"model": self.model, "prompt": "Who is there?", "stream": False,
                    "images": [base64.b64encode(rng.choice(self.photos)).decode()],
                    "options": {"num_predict": self.cfg.max_tokens, "seed": rng.randrange(2**31)}}
            await self._record(tally, "ollama", self.http.post("/api/generate", json=body))
            return
        body = {"model": self.model, "messages": [{"role": "user", "content": "Hello"}],
                "options": {"num_predict": self.cfg.max_tokens}, "keep_alive": "5m"}
        try:
            async with self.http.stream("POST", "/api/chat", json=body) as response:
                status, error = response.status_code, None
                async for line in response.aiter_lines():
                    if status == 200 and line and "error" in json.loads(line):
                        status, error = 500, json.loads(line)["error"]
            tally.outcomes.append(Outcome("ollama", status, error))
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("ollama", None, f"{type(exc).__name__}: {exc}"))

    async def ollama_tools(self, tally: Tally, rng: random.Random) -> None:
        """Ollama's /api/chat with tools beside a format (now and then streamed): each call's arguments valid under
        its function's schema, else a finished answer that parses under the format; one that does not, or a line
        that carries an error, counts as a 500."""
        ask = f"Weather at stop {rng.randrange(1000)}?"
        body = {"model": self.model, "messages": [{"role": "user", "content": ask}],
                "tools": SOAK_TOOLS, "format": SOAK_FORMAT, "stream": rng.random() < 0.5,
                "options": {"num_predict": TOOL_MAX_TOKENS, "seed": rng.randrange(2**31), "temperature": 1.0}}
        try:
            async with self.http.stream("POST", "/api/chat", json=body) as response:
                status, error = response.status_code, None
                lines = [json.loads(line) async for line in response.aiter_lines() if line] if status == 200 else []
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("ollama", None, f"{type(exc).__name__}: {exc}"))
            return
        if any("error" in line for line in lines):
            status, error = 500, next(line["error"] for line in lines if "error" in line)
        elif lines:
            calls = [c["function"] for line in lines for c in line["message"].get("tool_calls") or []]
            content = "".join(line["message"]["content"] for line in lines)
            bad = [c for c in calls if not _valid_call(c["name"], json.dumps(c["arguments"]))]
            if bad:
                status, error = 500, f"invalid tool call {bad[0]}"
            elif not calls and lines[-1].get("done_reason") == "stop" and not _valid_format(content):
                status, error = 500, f"an answer outside the format: {content[:200]!r}"
        tally.outcomes.append(Outcome("ollama", status, error))

    async def scored_prompt(self, tally: Tally, rng: random.Random) -> None:
        """/v1/completions with echo and logprobs (and now and then vLLM's prompt_logprobs): every prompt token but
        the first scored, or the answer counts as a 500."""
        body = {"model": self.model, "prompt": f"Bus stop {rng.randrange(1000)} at night:", "echo": True,
                "logprobs": 1, "max_tokens": 1, "temperature": 0, **({"prompt_logprobs": 2} if rng.random() < 0.5
                                                                     else {})}
        try:
            response = await self.http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("prompt_logprobs", None, f"{type(exc).__name__}: {exc}"))
            return
        status, error = response.status_code, None
        if status == 200:
            scores = response.json()["choices"][0]["logprobs"]["token_logprobs"]
            if len(scores) < 3 or scores[0] is not None or any(s is None for s in scores[1:]):
                status, error = 500, f"prompt tokens not scored: {scores[:4]}"
        tally.outcomes.append(Outcome("prompt_logprobs", status, error))

    async def stored_chat(self, tally: Tally, rng: random.Random) -> None:
        """A chat completion sent with `store: true` (now and then streamed), read back by id and deleted; one that
        is not found after a 200 counts as a 500. Half the streamed ones are two choices forced to text holding the
        characters str.splitlines takes for line ends (as a model may write them): read here by splitlines, every
        event must parse and the stored answer hold that text."""
        body = self.chat_body(f"Who waits at stop {rng.randrange(1000)}?", store=True, stream=rng.random() < 0.5,
                              metadata={"soak": "yes"})
        forced = body["stream"] and rng.random() < 0.5
        if forced:
            body.update(n=2, max_tokens=64, guided_choice=[SEPARATED])
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
            status, error = response.status_code, None
            if status == 200:
                lines = [line for line in response.text.splitlines() if line.startswith("data: {")]
                events = [json.loads(line[6:]) for line in lines]
                completion_id = events[0]["id"] if body["stream"] else response.json()["id"]
                got = await self.http.get(f"/v1/chat/completions/{completion_id}")
                deleted = await self.http.delete(f"/v1/chat/completions/{completion_id}")
                if got.status_code != 200 or deleted.status_code != 200:
                    status, error = 500, f"stored {completion_id}: get {got.status_code}, delete {deleted.status_code}"
                elif forced and [c["message"]["content"] for c in got.json()["choices"]] != [SEPARATED] * 2:
                    status, error = 500, f"stored {completion_id}: {got.json()['choices']!r}"[:300]
            tally.outcomes.append(Outcome("store", status, error))
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome("store", None, f"{type(exc).__name__}: {exc}"))
        except ValueError as exc:  # an event cut where a reader splits lines
            tally.outcomes.append(Outcome("store", 500, f"{type(exc).__name__}: {exc}"[:300]))

    async def hostile(self, tally: Tally, rng: random.Random) -> None:
        name = rng.choice(sorted(HOSTILE_REQUESTS))
        await self._record(tally, f"hostile:{name}", HOSTILE_REQUESTS[name](self))

    async def _record(self, tally: Tally, kind: str, request: Any) -> None:
        try:
            response = await request
            tally.outcomes.append(Outcome(kind, response.status_code))
        except httpx.HTTPError as exc:
            tally.outcomes.append(Outcome(kind, None, f"{type(exc).__name__}: {exc}"))


SOAK_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SOAK_FORMAT = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["people"], "additionalProperties": False}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}
SEPARATED = "stop\u2028two\x85three\u2029"  # LINE SEPARATOR, NEL, PARAGRAPH SEPARATOR: str.splitlines' line ends
TOOL_MAX_TOKENS = 160  # a whole call of the tools above, written out by the tiny model's byte-level tokens


def _valid_call(name: str, arguments: str) -> bool:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    if name == "weather":
        return set(value) == {"city", "days"} and isinstance(value["city"], str) and len(value["city"]) <= 8 \
            and isinstance(value["days"], int) and 1 <= value["days"] <= 7
    return name == "clock" and value == {"zone": value.get("zone")} and value["zone"] in ("UTC", "CET")


def _valid_format(text: str) -> bool:
    """Whether `text` is an answer under SOAK_FORMAT."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"people"} and isinstance(value["people"], int) \
        and 0 <= value["people"] <= 9


def _many_tools(count: int, properties: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "integer"} for j in range(properties)}}}} for i in range(count)]


def _json_post(client: Client, path: str, raw: bytes) -> Any:
    return client.http.post(path, content=raw, headers={"Content-Type": "application/json"})


async def _chunked(total: int) -> AsyncIterator[bytes]:
    yield b'{"model": "x", "messages": [{"role": "user", "content": "'
    sent = 0
    while sent < total:
        yield b"x" * 65536
        sent += 65536
    yield b'"}]}'


HOSTILE_REQUESTS: dict[str, Any] = {
    "temperature_1e-300": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", temperature=1e-300)),
    "top_p_1e-320": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", top_p=1e-320)),
    "tiny_temperature_top_k": lambda c: c.http.post("/v1/chat/completions",
                                                    json=c.chat_body("Hi", temperature=1e-40, top_k=5)),
    "deep_json": lambda c: _json_post(c, "/v1/captions", b'{"image": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "deep_json_chat": lambda c: _json_post(c, "/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000),
    "nan_json": lambda c: _json_post(c, "/v1/captions", b'{"image": "aGk=", "max_tokens": NaN}'),
    "bomb_image": lambda c: c.http.post("/v1/captions", files={"image": ("bomb.png", c.bomb, "image/png")}),
    "bomb_image_chat": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "image_url", "image_url": {"url": data_url(c.bomb, "image/png")}}, {"type": "text", "text": "?"}])),
    "truncated_jpeg": lambda c: c.http.post("/v1/captions", files={"image": ("t.jpg", c.photos[0][:3000])}),
    "oversized_chunked_body": lambda c: c.http.post("/v1/chat/completions", content=_chunked(c.cfg.max_body_bytes),
                                                    headers={"Content-Type": "application/json"}),
    "unknown_method": lambda c: c.http.request("RANDOM123", "/v1/models"),
    "foreign_host": lambda c: c.http.get("/v1/models", headers={"Host": "attacker.example"}),
    "cross_site_post": lambda c: c.http.post("/v1/captions", headers={"Origin": "http://attacker.example"},
                                             files={"image": ("p.jpg", c.photos[0])}),
    "negative_max_tokens": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", max_tokens=-1)),
    "unknown_model": lambda c: c.http.post("/v1/chat/completions", json={**c.chat_body("Hi"), "model": "gpt-9"}),
    "remote_image_url": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "image_url", "image_url": {"url": "http://[::127.0.0.1]/x.jpg"}}])),
    # Videos (issue 24): refused from their bytes or header, or by the limit on frames, before any frame is kept.
    "corrupt_video": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00\x18ftypmp42" * 64, "video/mp4")}}])),
    "remote_video_url": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "video_url", "video_url": {"url": "http://[::127.0.0.1]/x.mp4"}}])),
    "video_frames_over_cap": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "video_url", "video_url": {"url": data_url(b"\x00", "video/mp4")}}],
        video_options={"num_frames": 100_000})),
    "reversed_box_frame": lambda c: c.http.get("/v1/captions/no-such-id/image"),
    "cache_salt_empty": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", cache_salt="")),
    "cache_salt_huge": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", cache_salt="s" * 10_000)),
    "sse_flood": lambda c: _sse_flood(c),
    # Grammars and schemas (issue 22): refused by their limits before any compile, or by name; nothing fetched.
    "deep_regex_schema": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "JSON", response_format=_schema_format({"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}))),
    "quadratic_repetition": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "JSON", response_format=_schema_format({"type": "string", "pattern": "a{1,8000}"}))),
    "huge_enum": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "JSON", response_format=_schema_format({"enum": [f"value {i}" for i in range(100_000)]}))),
    "ref_file": lambda c: c.http.post("/v1/captions?wait=true", json={
        "image": data_url(c.photos[0]), "schema": {"not": {"$ref": "file:///etc/passwd"}}}),
    "ref_http": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("JSON", response_format=_schema_format(
        {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/schema.json"}}}))),
    "top_k_1e400": lambda c: _json_post(c, "/v1/chat/completions", json.dumps(c.chat_body("Hi", top_k="@")).replace(
        '"@"', "1" + "0" * 400).encode()),
    "priority_below_floor": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", priority=-2**31)),
    # Tools (issue 36): their schemas count together against the grammar limits; bad choices and history arguments
    # that are not JSON are refused by name.
    "tools_many": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", tools=_many_tools(200, 10), tool_choice="required")),
    "tools_huge_schema": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "description": "x" * 200_000}}}])),
    "tools_deep_regex": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}}}}}], tool_choice="auto")),
    "tool_choice_unknown": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", tools=SOAK_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
    "tool_history_bad_arguments": lambda c: c.http.post("/v1/chat/completions", json={**c.chat_body("Hi"),
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "tools": SOAK_TOOLS}),
    "too_many_n": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body("Hi", n=10**6)),
    # The drop-in routes (issue 36): refused insertion, token ids past the vocabulary, too many choices, Ollama's
    # unknown options, models and undecodable images, many or huge tools beside a format.
    "completions_suffix": lambda c: c.http.post("/v1/completions", json={"model": c.model, "prompt": "a",
                                                                          "suffix": "b"}),
    "completions_bad_token_ids": lambda c: c.http.post("/v1/completions", json={"model": c.model,
                                                                                 "prompt": [[2**62, -1]]}),
    "completions_too_many_choices": lambda c: c.http.post("/v1/completions", json={
        "model": c.model, "prompt": ["a"] * 100, "n": 100}),
    "completions_min_over_max": lambda c: c.http.post("/v1/completions", json={
        "model": c.model, "prompt": "a", "min_tokens": 10**6, "max_tokens": 2}),
    "ollama_bad_options": lambda c: _json_post(c, "/api/generate", json.dumps({
        "model": c.model, "prompt": "a", "stream": False, "options": {"temperature": 0.5}}).replace(
        "0.5", "1e400").encode()),
    "ollama_unknown_model": lambda c: c.http.post("/api/chat", json={"model": "llama3:70b", "messages": [
        {"role": "user", "content": "hi"}]}),
    "ollama_tools_many_with_format": lambda c: c.http.post("/api/chat", json={
        "model": c.model, "messages": [{"role": "user", "content": "hi"}], "tools": _many_tools(80, 2),
        "format": SOAK_FORMAT, "stream": False}),
    "ollama_tools_huge_with_format": lambda c: c.http.post("/api/chat", json={
        "model": c.model, "messages": [{"role": "user", "content": "hi"}], "tools": SOAK_TOOLS, "stream": False,
        "format": {"type": "object", "description": "x" * 200_000}}),
    "ollama_bomb_image": lambda c: c.http.post("/api/generate", json={
        "model": c.model, "prompt": "a", "stream": False, "images": [base64.b64encode(c.bomb).decode(), "@@@"]}),
    # The camera memory (issue 37): user words are never full-text syntax; times, cursors and uploads have limits.
    "events_fts_syntax": lambda c: c.http.get("/v1/events", params={"q": '"NEAR(a b) OR caption:* ^x \'; --'}),
    "events_bad_cursor": lambda c: c.http.get("/v1/events", params={"cursor": "eyJ4IjogMX0" * 10}),
    "events_time_overflow": lambda c: c.http.get("/v1/events", params={"since": "1e400", "until": "-5"}),
    "events_bomb_upload": lambda c: c.http.post("/v1/events/similar", files={"image": ("b.png", c.bomb, "image/png")}),
    "embeddings_bomb": lambda c: c.http.post("/v1/embeddings", json={"input": [data_url(c.bomb, "image/png")]}),
    "embeddings_too_many": lambda c: c.http.post("/v1/embeddings", json={"input": ["x"] * 10_000}),
    # Asking the memory (issue 37): a question of query syntax, out-of-range bounds, broken or unknown MCP calls.
    "ask_fts_syntax": lambda c: c.http.post("/v1/cameras/ask", json={
        "question": '"NEAR(a b) OR caption:* ^x \'; -- ' * 40, "max_tokens": 2}),
    "ask_over_bounds": lambda c: c.http.post("/v1/cameras/ask", json={
        "question": "who?", "max_events": 10**6, "max_frames": 10**6, "max_tokens": 10**9}),
    "ask_bad_time": lambda c: c.http.post("/v1/cameras/ask", json={"question": "who?", "since": "1e400"}),
    "mcp_bad_json": lambda c: c.http.post("/v1/mcp", headers={**MCP_HEADERS, "Content-Type": "application/json"},
                                          content=b"{" * 10_000),
    "mcp_unknown_tool": lambda c: c.http.post("/v1/mcp", headers=MCP_HEADERS, json={
        "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "rm_rf", "arguments": {}}}),
    "mcp_huge_limit": lambda c: c.http.post("/v1/mcp", headers=MCP_HEADERS, json={
        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "search_events", "arguments": {"limit": 10**9, "since": "-1"}}}),
    # Media (issue 38): a concat script naming a server file (as a chat's video, behind a forged mp4 header, as a
    # Responses input_video), an SDP description, a JPEG of a thousand scans; a reply with the file counts as 500.
    "ffconcat_video": lambda c: _media_case(c, "chat", _concat_script()),
    "ffconcat_forged_magic": lambda c: _media_case(c, "chat", b"\x00\x00\x00\x18ftypmp42\n" + _concat_script()),
    "ffconcat_responses": lambda c: _media_case(c, "responses", _concat_script()),
    "sdp_video": lambda c: _media_case(c, "chat", SDP_BODY),
    "many_scans_jpeg": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        [{"type": "image_url", "image_url": {"url": data_url(c.many_scans)}}, {"type": "text", "text": "?"}])),
    # Fairness and bounds (issue 38): clients that send their headers or body a byte a second are cut (408 here
    # when the server closes them in time); summaries of the longest window, and of one past the limit.
    "slow_client_headers": lambda c: _slow_client(c, body=False),
    "slow_client_body": lambda c: _slow_client(c, body=True),
    "summary_window_over_limit": lambda c: c.http.post("/v1/cameras/soak-cam/summary", json={"window_s": 10**9}),
    "summary_window_not_finite": lambda c: _json_post(c, "/v1/cameras/soak-cam/summary", b'{"end": -Infinity}'),
    # Prompt log-probabilities and stored completions (issue 36): out-of-range and streamed scores, metadata past
    # OpenAI's bounds, pages past their limit or after an unknown id, another key's or an unknown completion.
    "prompt_logprobs_over_cap": lambda c: c.http.post("/v1/completions", json={
        "model": c.model, "prompt": "a", "prompt_logprobs": 10**6}),
    "prompt_logprobs_streamed": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", prompt_logprobs=1, stream=True)),
    "store_metadata_huge": lambda c: c.http.post("/v1/chat/completions", json=c.chat_body(
        "Hi", store=True, metadata={f"k{i}": "v" * 10_000 for i in range(1000)})),
    "stored_list_over_limit": lambda c: c.http.get("/v1/chat/completions", params={"limit": 10**9, "order": "up"}),
    "stored_list_after_unknown": lambda c: c.http.get("/v1/chat/completions", params={"after": "x" * 10_000}),
    "stored_unknown_id": lambda c: c.http.get("/v1/chat/completions/" + "chatcmpl-" + "9" * 500),
    "stored_update_bad_body": lambda c: _json_post(c, "/v1/chat/completions/chatcmpl-none", b'{"metadata": [1]}'),
}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "soak", "schema": schema}}
# Hostile cases whose right answer is a 5xx: one event stream past the cap is refused with 503 and Retry-After; a
# slow image is refused 503 busy while every media-box child stays busy past its deadline.
EXPECTED_5XX = {"hostile:sse_flood": 503, "hostile:many_scans_jpeg": 503, "hostile:burst_many_scans_jpeg": 503,
                "hostile:burst_costly_schema": 503}
SSE_CAP = 8  # the soak server's --max-sse-subscribers
FALL_EVERY = 5  # every fifth good camera job is a fall: its alert goes to the soak's misbehaving webhook


class _Answer:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


SLOW_CLIENT_TIMEOUT_S = 3.0  # the soak server's --header-timeout-s and --body-timeout-s (a slow client's life)


async def _slow_client(client: Client, body: bool) -> _Answer:
    """A client that sends the second half of its headers (or, with `body`, its body) a byte a second: the
    server closing the connection within three times its timeout is right (counted 408); a connection still
    open then, or an answer other than a 408, counts as 500."""
    url = client.http.base_url
    reader, writer = await asyncio.open_connection(url.host, url.port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    sent, drip = (head, b"{" * 100_000) if body else (head[:len(head) // 2], head[len(head) // 2:])
    ends = time.monotonic() + 3 * SLOW_CLIENT_TIMEOUT_S
    try:
        writer.write(sent)
        for byte in drip:
            if time.monotonic() > ends:
                return _Answer(500)
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                got = await asyncio.wait_for(reader.read(4096), 1.0)
            except TimeoutError:
                continue
            return _Answer(408 if not got or got.startswith(b"HTTP/1.1 408") else 500)
        return _Answer(500)
    except OSError:  # reset by the server
        return _Answer(408)
    finally:
        writer.close()


async def _sse_flood(client: Client) -> _Answer:
    """Open one event stream more than the server's cap (one flood at a time); the answer of the last one (503
    with Retry-After is right; a 503 without it counts as 500). The others are closed again."""
    async with client.flooding:
        streams = []
        try:
            for _ in range(SSE_CAP + 1):
                streams.append(await client.http.send(client.http.build_request("GET", "/v1/alerts/stream"),
                                                      stream=True))
            last = streams[-1]
            return _Answer(500 if last.status_code == 503 and not last.headers.get("retry-after")
                           else last.status_code)
        finally:
            for stream in streams:
                await stream.aclose()


SDP_BODY = (b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=cam\r\nc=IN IP4 0.0.0.0\r\nt=0 0\r\n"
            b"m=video 5004 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n")
# A server file the concat scripts name (the server runs on this machine) and a line of it no reply may carry.
LEAK_FILE = __file__
LEAK_MARK = b"a bounded soak of a real server"


def _concat_script() -> bytes:
    return f"ffconcat version 1.0\nfile {LEAK_FILE}\n".encode()


async def _media_case(client: Client, route: str, media: bytes) -> Any:
    """A hostile video sent as a chat `video_url` or a Responses `input_video`: its answer, or a 500 where the
    server answered it (2xx) or a reply carries a line of the file it names."""
    url = data_url(media, "video/mp4")
    if route == "responses":
        response = await client.http.post("/v1/responses", json={"model": client.model, "max_output_tokens": 4,
            "input": [{"role": "user", "content": [{"type": "input_video", "video_url": url},
                                                   {"type": "input_text", "text": "?"}]}]})
    else:
        response = await client.http.post("/v1/chat/completions", json=client.chat_body(
            [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]))
    if 200 <= response.status_code < 300 or LEAK_MARK in response.content:
        return _Answer(500)
    return response


class SSHReceiver:
    """A webhook receiver that is not HTTP: it answers every connection with an SSH banner."""

    def __init__(self) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/alerts"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()

# Camera job fields that make a job malformed; each such job must be dead-lettered once.
HOSTILE_JOB_FIELDS: list[dict[str, str]] = [
    {"image_origin": "[1, 2, 3]"}, {"image_origin": "[]"},
    {"detections": '[{"x1": "a", "y1": 2, "x2": 30, "y2": 40, "confidence": 0.9}]'},
    {"detections": '[{"x1": 30, "y1": 2, "x2": 1, "y2": 40, "confidence": 0.9}]'},
    {"detections": '[{"x1": 1, "y1": 2, "x2": 30, "y2": 40, "confidence": NaN}]'},
    {"frame_ts": "nan"}, {"created_at": "inf"}, {"prompt": ""}, {"detections": "[" * 20_000 + "]" * 20_000},
    {"video": ""},
    # Schemas no caption can meet (issue 22): dead-lettered at their first delivery, nothing fetched or compiled.
    {"schema": json.dumps({"not": {"$ref": "file:///etc/passwd"}})},
    {"schema": json.dumps({"type": "string", "pattern": "a{1,8000}"})},
    {"schema": json.dumps({"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000})},
    # Jobs of several frames (issue 23): over the frame limit, a frame missing, notes that are no strings.
    {"frame_count": "17"}, {"frame_count": "2", "frame_times": "[1, 2]", "notes": '["", ""]'},
    {"frame_count": "1", "frame_times": "[1]", "notes": "[1]"},
    # Camera ids that would leave their MQTT topic prefix (issue 37): refused by the job's contract.
    {"camera_id": "cam/#"}, {"camera_id": "+/homeassistant/sensor/x"}, {"camera_id": "cam\x00"},
]
EVENT_EVERY = 3  # every third good camera job (that is no fall) is an event of EVENT_FRAMES photos
EVENT_FRAMES = 3


# -- a plain chat and a fall alert alone, then with hostile work in flight (issue 38's "within 2x") ---------

PROBE_WITHIN = 2.0  # what must hold: each probe's median under hostile load within this factor of its median alone
# One round's burst of hostile work, the issue's kinds, each sent at once and left in flight while the probes run.
BURST = {"sdp_video": 4, "many_scans_jpeg": 4, "costly_schema": 4, "heavy_job": 8, "slow_client_headers": 12,
         "slow_client_body": 6, "week_summary": 2}
PROBE_TIMEOUT_S = 300.0  # a probe that takes longer counts as failed (its latency is not taken)
PROBE_CHATS = 3  # plain chats per phase of a round, one after the other (a chat alone takes tens of ms: noisy)


async def _probe_chat(client: Client, tally: Tally) -> float | None:
    """A plain chat (greedy, `max_tokens` tokens, not streamed): seconds from sending it to its whole answer, or
    None when it was not answered 200 (counted among the good requests, so the soak reports it)."""
    body = client.chat_body("Who is waiting at the bus stop?", temperature=0, ignore_eos=True)
    sent = time.perf_counter()
    try:
        response = await client.http.post("/v1/chat/completions", json=body, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        tally.outcomes.append(Outcome("probe_chat", None, f"{type(exc).__name__}: {exc}"))
        return None
    tally.outcomes.append(Outcome("probe_chat", response.status_code))
    return time.perf_counter() - sent if response.status_code == 200 else None


async def _probe_fall(client: Client, producer: Any, store: Any, tally: Tally) -> float | None:
    """A fall alert (one photo, `fall: true`) through the producer: seconds from its creation to its result's
    `finished_at` (Redis's clock, on this machine), or None when it did not end done in time. It is one of the
    soak's good jobs (it must end done, once)."""
    from jobqueue.contract import FINAL_STATUSES, Detection, Job, result_key

    job = Job(camera_id="soak-probe", frame_ts=time.time(), prompt="Is someone on the ground?",
              image=client.photos[0], detections=[Detection(10.0, 20.0, 110.0, 220.0, 0.9, 1)], fall=True)
    tally.good_jobs.append(job.job_id)
    producer.submit(job)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        status, finished_at = await store.hmget(result_key(job.job_id), ["status", "finished_at"])
        if status is not None and status.decode() in FINAL_STATUSES:
            return float(finished_at) - job.created_at if status == b"done" else None
        await asyncio.sleep(0.02)
    return None


def _costly_schema(tag: str) -> dict[str, Any]:
    """A schema within the grammar limits that takes the compiler a while: seven repetitions of 1,024 (7,168 of the
    8,192 a grammar may spend), made distinct by `tag` so that no compile is cached."""
    return _schema_format({"type": "object", "properties": {"a": {"type": "string",
                                                                  "pattern": "a{0,1024}" * 7 + tag}},
                           "required": ["a"]})


def _burst(client: Client, producer: Any, tally: Tally, tag: str) -> list[asyncio.Task]:
    """One round's hostile work (`BURST`), all sent at once: SDP videos and JPEGs of a thousand scans as chats,
    distinct costly schemas, valid camera jobs of hostile media (the many-scan JPEG as the frame, an SDP
    description as the clip), clients that send their headers or body a byte a second, summaries of the soak
    camera's week. Each request's answer is counted as a hostile kind (`burst_<name>`); the jobs must end."""
    from jobqueue.contract import Detection, Job

    requests: list[tuple[str, Any]] = []
    requests += [("sdp_video", lambda: _media_case(client, "chat", SDP_BODY))] * BURST["sdp_video"]
    requests += [("many_scans_jpeg", lambda: client.http.post("/v1/chat/completions", json=client.chat_body(
        [{"type": "image_url", "image_url": {"url": data_url(client.many_scans)}}, {"type": "text", "text": "?"}])))
                 ] * BURST["many_scans_jpeg"]
    requests += [("costly_schema", lambda i=i: client.http.post("/v1/chat/completions", json=client.chat_body(
        "JSON", response_format=_costly_schema(f"{tag}x{i}")))) for i in range(BURST["costly_schema"])]
    requests += [("slow_client_headers", lambda: _slow_client(client, body=False))] * BURST["slow_client_headers"]
    requests += [("slow_client_body", lambda: _slow_client(client, body=True))] * BURST["slow_client_body"]
    requests += [("week_summary", lambda: client.http.post("/v1/cameras/soak-cam/summary",
                                                            json={"window_s": 7 * 24 * 3600}))] * BURST["week_summary"]
    tasks = [asyncio.create_task(client._record(tally, f"hostile:burst_{name}", make())) for name, make in requests]
    box = [Detection(10.0, 20.0, 110.0, 220.0, 0.9, 1)]
    for i in range(BURST["heavy_job"]):
        job = Job(camera_id="soak-hostile", frame_ts=time.time(), prompt="Who is there?", detections=box,
                  image=client.many_scans, video=SDP_BODY if i % 4 == 3 else None)
        tally.heavy_jobs.append(job.job_id)
        producer.submit(job)
    return tasks


async def _quiet(client: Client, store: Any, timeout: float) -> bool:
    """Wait until no job is outstanding and the engine runs nothing (the burst's work ended), then a second more;
    False if that did not happen within `timeout`."""
    from jobqueue.contract import JOBS_STREAM

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = (await client.http.get("/v1/engine/stats")).json()
        if await store.xlen(JOBS_STREAM) == 0 and stats["running"] == stats["waiting"] == 0:
            await asyncio.sleep(1.0)
            return True
        await asyncio.sleep(0.5)
    return False


def _probe_figures(alone: list[float | None], loaded: list[float | None]) -> dict[str, Any]:
    import statistics

    took_alone, took_loaded = [t for t in alone if t is not None], [t for t in loaded if t is not None]
    median_alone = statistics.median(took_alone) if took_alone else None
    median_loaded = statistics.median(took_loaded) if took_loaded else None
    return {"alone_s": alone, "hostile_s": loaded, "alone_median_s": median_alone, "hostile_median_s": median_loaded,
            "ratio": median_loaded / median_alone if median_alone and median_loaded is not None else None,
            "unanswered": len(alone) - len(took_alone) + len(loaded) - len(took_loaded)}


async def _latency_rounds(cfg: SoakConfig, client: Client, producer: Any, store: Any, tally: Tally) -> dict[str, Any]:
    """`probe_rounds` rounds, before the soak's load: `PROBE_CHATS` plain chats one after the other and, beside them,
    a fall alert, with nothing else in flight ("alone"); then a burst of hostile work (`BURST`), and a second later
    the same probes while it is in flight ("hostile"); then the burst's requests end (cut after
    `PROBE_TIMEOUT_S`) and its jobs drain before the next round. Alone and hostile alternate, so that other load
    on the machine weighs on both alike.
    Reported: each probe's seconds per round, their medians and the ratio hostile / alone (what must hold: at
    most PROBE_WITHIN), and the machine's load average before and after."""
    import os

    load_before = os.getloadavg()
    await _probe_chat(client, tally)  # warm: the first chat and caption of a server pay for compiles and caches
    await _probe_fall(client, producer, store, tally)
    chats: dict[str, list[float | None]] = {"alone": [], "hostile": []}
    falls: dict[str, list[float | None]] = {"alone": [], "hostile": []}
    unquiet = 0

    async def probes(phase: str) -> None:
        async def plain_chats() -> None:
            for _ in range(PROBE_CHATS):
                chats[phase].append(await _probe_chat(client, tally))

        _, fall = await asyncio.gather(plain_chats(), _probe_fall(client, producer, store, tally))
        falls[phase].append(fall)

    for round_index in range(cfg.probe_rounds):
        await probes("alone")
        burst = _burst(client, producer, tally, f"r{cfg.seed}n{round_index}")
        await asyncio.sleep(1.0)
        await probes("hostile")
        _, late = await asyncio.wait(burst, timeout=PROBE_TIMEOUT_S)
        for task in late:
            task.cancel()
        unquiet += not await _quiet(client, store, PROBE_TIMEOUT_S)
    chat_figures, fall_figures = (_probe_figures(chats["alone"], chats["hostile"]),
                                  _probe_figures(falls["alone"], falls["hostile"]))
    ratios = [chat_figures["ratio"], fall_figures["ratio"]]
    return {"rounds": cfg.probe_rounds, "burst": BURST, "chat": chat_figures, "fall_alert": fall_figures,
            "within": PROBE_WITHIN,
            "holds": all(r is not None and r <= PROBE_WITHIN for r in ratios) and
            chat_figures["unanswered"] == fall_figures["unanswered"] == 0,
            "rounds_not_drained": unquiet, "load_average_before": load_before, "load_average_after": os.getloadavg()}


# -- the run ----------------------------------------------------------------------------------------

async def _ticker(rate: float, until: float, action: Any, rng: random.Random, tasks: set[asyncio.Task]) -> None:
    """`action()` at a steady `rate` per second (with a random phase), each as its own task."""
    if rate <= 0:
        return
    gap = 1.0 / rate
    await asyncio.sleep(rng.random() * gap)
    next_at = time.monotonic()
    while time.monotonic() < until:
        task = asyncio.create_task(action())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += gap
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def _load(cfg: SoakConfig, url: str, redis_url: str, server_pid: int, tally: Tally) -> float:
    import psutil
    import redis.asyncio as aioredis

    from jobqueue.contract import Detection, Job, JobImage, result_key
    from jobqueue.producer import JobProducer

    rng = random.Random(cfg.seed)
    photos = [path.read_bytes() for path in photo_paths()]
    process = psutil.Process(server_pid)
    producer = JobProducer(redis_url)
    store = aioredis.Redis.from_url(redis_url)
    limits = httpx.Limits(max_connections=cfg.chats + 64, max_keepalive_connections=cfg.chats + 16)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        client = Client(http, cfg, photos, model)
        if cfg.probe_rounds:
            tally.latency = await _latency_rounds(cfg, client, producer, store, tally)
        began = time.monotonic()
        until = began + cfg.duration
        tasks: set[asyncio.Task] = set()

        async def chat_loop(seed: int) -> None:
            own = random.Random(seed)
            while time.monotonic() < until:
                if own.random() < cfg.hostile_fraction:
                    await client.hostile(tally, own)
                else:
                    await client.good_chat(tally, own)

        async def caption() -> None:
            if rng.random() < cfg.hostile_fraction:
                await client.hostile(tally, rng)
            else:
                await client.good_caption(tally, rng)

        async def job() -> None:
            box = [Detection(10.0, 20.0, 110.0, 220.0, 0.9, 1)]
            fall = len(tally.good_jobs) % FALL_EVERY == FALL_EVERY - 1
            if not fall and len(tally.good_jobs) % EVENT_EVERY == EVENT_EVERY - 1:
                now = time.time()
                good = Job.of_frames("soak-cam", "What did person 1 do?", [
                    JobImage(rng.choice(photos), now + i, f"t=+{i}.0 s: person 1 is in the middle", box)
                    for i in range(EVENT_FRAMES)], kind="event", track_id=1)
            else:
                good = Job(camera_id="soak-cam", frame_ts=time.time(), prompt="Who is there?",
                           image=rng.choice(photos), detections=box, fall=fall)
            if rng.random() >= cfg.hostile_fraction:
                tally.good_jobs.append(good.job_id)
                producer.submit(good)
                return
            tally.bad_jobs.append(good.job_id)  # written as a foreign producer would, with a malformed field
            await store.hset(result_key(good.job_id), mapping=good.queued_result().to_fields())
            await store.xadd("vlmcap:jobs", {**good.to_fields(), **rng.choice(HOSTILE_JOB_FIELDS)})

        async def tools() -> None:
            if rng.random() < cfg.hostile_fraction:
                await client.hostile(tally, rng)
            elif rng.random() < 0.5:
                await client.good_clients(tally, rng)
            else:
                await client.good_tools(tally, rng)

        async def event_search() -> None:
            if rng.random() < cfg.hostile_fraction:
                await client.hostile(tally, rng)
            elif rng.random() < 0.25:
                await client.good_ask(tally, rng)
            elif rng.random() < 0.2:
                await client.good_summary(tally, rng)
            else:
                await client.good_event_search(tally, rng)

        async def sample_memory() -> None:
            while time.monotonic() < until:
                tally.memory.append((time.monotonic() - began, process.memory_info().rss / 2**20))
                await asyncio.sleep(cfg.memory_interval)
            tally.memory.append((time.monotonic() - began, process.memory_info().rss / 2**20))

        loops = [asyncio.create_task(chat_loop(cfg.seed * 1000 + i)) for i in range(cfg.chats)]
        await asyncio.gather(
            *loops, sample_memory(),
            _ticker(cfg.caption_rate, until, caption, random.Random(cfg.seed + 1), tasks),
            _ticker(cfg.job_rate, until, job, random.Random(cfg.seed + 2), tasks),
            _ticker(cfg.caption_rate, until, event_search, random.Random(cfg.seed + 3), tasks),
            _ticker(cfg.caption_rate, until, tools, random.Random(cfg.seed + 4), tasks),
        )
        while tasks:
            await asyncio.gather(*list(tasks))
        load_s = time.monotonic() - began
    producer.close()
    await store.aclose()
    return load_s


async def _job_outcomes(cfg: SoakConfig, redis_url: str, tally: Tally) -> dict[str, Any]:
    """Wait (up to `drain_timeout`) for every job to end, then count how each ended."""
    import redis.asyncio as aioredis

    from jobqueue.contract import CAPTIONS_STREAM, DEAD_STREAM, FINAL_STATUSES, result_key

    store = aioredis.Redis.from_url(redis_url)
    ids = tally.good_jobs + tally.bad_jobs + tally.heavy_jobs
    deadline = time.monotonic() + cfg.drain_timeout
    drained_s = 0.0
    started = time.monotonic()
    while True:
        statuses = [await store.hget(result_key(job_id), "status") for job_id in ids]
        statuses = [s.decode() if s else None for s in statuses]
        if all(s in FINAL_STATUSES for s in statuses) or time.monotonic() > deadline:
            drained_s = time.monotonic() - started
            break
        await asyncio.sleep(0.5)
    by_id = dict(zip(ids, statuses, strict=True))
    feed = Counter()
    for _, fields in await store.xrange(CAPTIONS_STREAM):
        feed[fields[b"id"].decode()] += 1
    dead = Counter()
    for _, fields in await store.xrange(DEAD_STREAM):
        job_id = fields.get(b"job_id")
        dead[job_id.decode() if job_id else "?"] += 1
    await store.aclose()
    good = [by_id[j] for j in tally.good_jobs]
    bad = [by_id[j] for j in tally.bad_jobs]
    return {
        "good_jobs": len(good), "good_done": good.count("done"), "good_failed": good.count("failed"),
        "bad_jobs": len(bad), "bad_dead": sum(dead[j] == 1 for j in tally.bad_jobs),
        "bad_failed": bad.count("failed"),
        "heavy_jobs": len(tally.heavy_jobs),  # valid jobs of hostile media: done or failed, each ends once
        "heavy_ended": sum(by_id[j] in FINAL_STATUSES for j in tally.heavy_jobs),
        "lost": sum(s not in FINAL_STATUSES for s in statuses),
        "captioned_twice": sum(feed[j] > 1 for j in tally.good_jobs),
        "dead_lettered_twice": sum(n > 1 for n in dead.values()),
        "drain_s": drained_s,
    }


async def _events_kept(url: str, tally: Tally) -> int:
    """The good jobs the server's event store holds (each by its job id, so at most once)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        answers = [await http.get(f"/v1/events/{job_id}") for job_id in tally.good_jobs]
    return sum(answer.status_code == 200 for answer in answers)


def _start_server(cfg: SoakConfig, redis_url: str, webhook_url: str, log: IO[str],
                  data_dir: str) -> tuple[subprocess.Popen, str]:
    """The soak's server, ready; its log goes to `log` (a file: a pipe read only at the end would fill and
    block the server). Ready means /ready answers 200 on a port the server itself listens on (`listens`): the port
    picked for it may be taken by another process before it binds, which answering /ready would pass for it; the
    server then exits, and a new port is tried (three in all). Killed again if it does not become ready, or if the
    soak is interrupted meanwhile."""
    from jobqueue.connection import free_tcp_port

    for attempt in range(3):
        port = free_tcp_port()
        server = subprocess.Popen(
            [sys.executable, "-c", "from cli.main import app; app()", "serve", "--model", cfg.model,
             "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url,
             "--caption-max-tokens", str(cfg.max_tokens), "--max-body-bytes", str(cfg.max_body_bytes),
             "--max-deliveries", "2", "--claim-idle-seconds", "10", "--max-sse-subscribers", str(SSE_CAP),
             "--alert-webhook", webhook_url, "--data-dir", data_dir, "--log-level", "warning",
             "--header-timeout-s", str(SLOW_CLIENT_TIMEOUT_S), "--body-timeout-s", str(SLOW_CLIENT_TIMEOUT_S)],
            stdout=subprocess.DEVNULL, stderr=log, text=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + cfg.startup_timeout
        try:
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    if httpx.get(f"{url}/ready", timeout=5).status_code == 200 and listens(server.pid, port):
                        return server, url
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the server goes with the soak
            _stop(server)
            raise
        _stop(server)
        if "address already in use" not in _tail(log, 2000).lower() or attempt == 2:
            break
    raise RuntimeError(f"the server did not become ready: {_tail(log, 2000)}")


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _tail(log: IO[str], chars: int) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def _requests_by_kind(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = defaultdict(Counter)
    for outcome in outcomes:
        table[outcome.kind][str(outcome.status) if outcome.status is not None else "no answer"] += 1
    return {kind: dict(sorted(counts.items())) for kind, counts in sorted(table.items())}


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    from jobqueue.connection import EmbeddedRedis

    redis_server = EmbeddedRedis()
    receiver = SSHReceiver()
    log = tempfile.TemporaryFile("w+")
    data_dir = tempfile.TemporaryDirectory(prefix="vlmcap-soak-")  # the server's event store
    server = None
    tally = Tally()
    try:
        server, url = _start_server(cfg, redis_server.url, receiver.url, log, data_dir.name)
        load_s = asyncio.run(_load(cfg, url, redis_server.url, server.pid, tally))
        jobs = asyncio.run(_job_outcomes(cfg, redis_server.url, tally))
        jobs["kept_as_events"] = asyncio.run(_events_kept(url, tally))
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        ready_reply = httpx.get(f"{url}/ready", timeout=30)
        ready, webhook = ready_reply.status_code, ready_reply.json().get("alert_webhook")
    finally:
        if server is not None:
            _stop(server)
        server_log = _tail(log, 4000)
        log.close()
        redis_server.close()
        receiver.close()
        data_dir.cleanup()
    good = [o for o in tally.outcomes if not o.kind.startswith("hostile:")]
    hostile = [o for o in tally.outcomes if o.kind.startswith("hostile:")]
    after_warmup = [rss for t, rss in tally.memory if t >= cfg.warmup]
    rss_start = after_warmup[0] if after_warmup else None
    rss_end = tally.memory[-1][1] if tally.memory else None
    step_failures = [line for line in metrics.splitlines() if line.startswith("vlmcap_engine_step_failures_total")]
    return {
        "benchmark": "soak",
        "config": asdict(cfg),
        "machine": machine(),
        "load_s": load_s,
        "requests": _requests_by_kind(tally.outcomes),
        "good_requests": len(good),
        "good_not_2xx": sum(o.status is None or not 200 <= o.status < 300 for o in good),
        "hostile_requests": len(hostile),
        "hostile_5xx": sum(o.status is not None and o.status >= 500 and o.status != EXPECTED_5XX.get(o.kind)
                           for o in hostile),
        "no_answer": sum(o.status is None for o in tally.outcomes),
        "errors": sorted({o.error for o in tally.outcomes if o.error})[:20],
        "jobs": jobs,
        "memory_mib": {"start": rss_start, "end": rss_end, "max": max((m for _, m in tally.memory), default=None),
                       "growth": (rss_end / rss_start - 1.0) if rss_start and rss_end else None,
                       "samples": tally.memory},
        "latency": tally.latency,
        "chat_itl_ms": percentiles_ms(tally.itl),
        "chat_ttft_ms": percentiles_ms(tally.ttft),
        "chat_tokens": len(tally.itl) + len(tally.ttft),
        "engine_step_failures": float(step_failures[0].split()[-1]) if step_failures else None,
        "ready_after": ready,
        "alert_webhook": webhook,  # /ready's view of the webhook whose receiver is not HTTP: alive, failures counted
        "server_log_tail": server_log,
    }


def summary(result: dict[str, Any]) -> str:
    jobs, memory, itl = result["jobs"], result["memory_mib"], result["chat_itl_ms"]
    lines = [f"soak: {result['load_s']:.0f} s of load, {result['good_requests']} good and "
             f"{result['hostile_requests']} hostile requests"]
    for kind, counts in result["requests"].items():
        lines.append(f"  {kind:34s} " + ", ".join(f"{status}: {n}" for status, n in counts.items()))
    lines += [
        f"good requests not 2xx: {result['good_not_2xx']}; hostile answered 5xx: {result['hostile_5xx']}; "
        f"no answer: {result['no_answer']}",
        f"jobs: good {jobs['good_done']}/{jobs['good_jobs']} done ({jobs['good_failed']} failed), bad "
        f"{jobs['bad_dead']}/{jobs['bad_jobs']} dead-lettered once, lost {jobs['lost']}, captioned twice "
        f"{jobs['captioned_twice']}, dead-lettered twice {jobs['dead_lettered_twice']}, kept as events "
        f"{jobs.get('kept_as_events', '-')}",
        f"server RSS: {memory['start']:.0f} MiB after warm-up, {memory['end']:.0f} MiB at the end "
        f"({memory['growth'] * 100:+.1f}%), max {memory['max']:.0f} MiB" if memory["start"] else "server RSS: -",
        f"good chats: {result['chat_tokens']} tokens, ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms, "
        f"max {itl['max']:.1f} ms; engine step failures {result['engine_step_failures']}; /ready "
        f"{result['ready_after']} after",
        f"alert webhook (a receiver that is not HTTP): {result['alert_webhook']}",
    ]
    latency = result.get("latency")
    if latency:
        for name in ("chat", "fall_alert"):
            figures = latency[name]
            lines.append(f"{name.replace('_', ' ')}: median {_seconds(figures['alone_median_s'])} alone, "
                         f"{_seconds(figures['hostile_median_s'])} under hostile load, ratio "
                         f"{_ratio(figures['ratio'])} ({latency['rounds']} rounds, {figures['unanswered']} unanswered)")
        lines.append(f"within {latency['within']:.0f}x of alone: {'yes' if latency['holds'] else 'NO'}")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot(result: dict[str, Any], png_path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    samples = result["memory_mib"]["samples"]
    left.plot([t for t, _ in samples], [m for _, m in samples], marker=".")
    left.axvline(result["config"]["warmup"], color="grey", linestyle="--", label="end of warm-up")
    left.set_xlabel("seconds of load")
    left.set_ylabel("server RSS (MiB)")
    left.set_title("server memory")
    left.legend()
    kinds = list(result["requests"])
    totals = [sum(result["requests"][k].values()) for k in kinds]
    bad = [sum(n for s, n in result["requests"][k].items() if not s.isdigit() or int(s) >= 500) for k in kinds]
    right.barh(kinds, totals, color="tab:green", label="answered")
    right.barh(kinds, bad, color="tab:red", label="5xx or no answer")
    right.set_xlabel("requests")
    right.set_title("requests by kind")
    right.tick_params(axis="y", labelsize=7)
    right.legend()
    save_figure(fig, png_path)
