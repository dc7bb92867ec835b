"""Images from clients, checked before they reach the engine: size in bytes, size in pixels read from the
header before any pixel is decoded (no decompression bombs), a short list of formats, and complete data
(a truncated file is refused, not padded). Remote URLs are fetched only when enabled, only from
allowlisted hosts, never from private or loopback addresses unless allowed (checked once, then downloaded
from the checked address), with size and time limits."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from api.errors import APIError
from api.pools import work_pools
from api.settings import Limits
from engine.media_box import ImageTooLarge, MediaBusy, MediaLimitError, UnreadableImage, decodes_inline, default_box

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Media:
    """What a URL is fetched or decoded as: its name in answers and error codes, and its byte limit."""

    name: str
    max_bytes: int

    @property
    def article(self) -> str:
        return f"{'an' if self.name[0] in 'aeiou' else 'a'} {self.name}"

    @property
    def url_code(self) -> str:
        return f"invalid_{self.name}_url"

    @property
    def too_large_code(self) -> str:
        return f"{self.name}_too_large"


def image_media(limits: Limits) -> Media:
    return Media("image", limits.max_image_bytes)


def _pil_open() -> Callable[..., Image.Image]:
    """PIL's own `Image.open`. Importing ultralytics replaces it with a wrapper that, for a file PIL cannot
    identify, pip-installs a HEIF plugin: a server must never do that because of a client's bytes."""
    patches = sys.modules.get("ultralytics.utils.patches")
    return getattr(patches, "_image_open", Image.open) if patches is not None else Image.open


@contextmanager
def image_errors(param: str, what: str) -> Iterator[None]:
    """The one place that turns Pillow's errors into answers: an image over Pillow's own decompression-bomb
    limit is 413 (it can raise before our pixel check, in `Image.open`), anything else Pillow raises on a
    client's bytes is 400 naming `what` failed."""
    try:
        yield
    except APIError:
        raise
    except Image.DecompressionBombError as exc:
        raise APIError(413, f"{param}: the image is too large to decode: {exc}", param, "image_too_large") from None
    except UnidentifiedImageError as exc:
        raise APIError(400, f"{param}: not a readable image (accepted formats: {', '.join(FORMATS)}): {exc}",
                       param, "invalid_image") from None
    except Exception as exc:  # Pillow's plugins raise many kinds (OSError, SyntaxError, struct.error, ...)
        raise APIError(400, f"{param}: {what} ({type(exc).__name__}: {exc})", param, "invalid_image") from None


def decode_image(data: bytes, limits: Limits, param: str) -> Image.Image:
    """An RGB image from encoded bytes, or an APIError (413 too large or past the media box's deadline or memory
    limit, 400 unreadable). Blocks: call it off the event loop. A small PNG or sequential JPEG is decoded here, any
    other image in the media box (engine/media_box.py `decodes_inline` says why)."""
    if len(data) > limits.max_image_bytes:
        raise APIError(413, f"{param}: the image has {len(data)} bytes, over the limit of {limits.max_image_bytes}",
                       param, "image_too_large")
    with image_errors(param, f"not a readable image (accepted formats: {', '.join(FORMATS)})"):
        # Image.open reads only the header: the size is known before any pixel is decoded.
        image = _pil_open()(io.BytesIO(data), formats=FORMATS)
    with image:
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise APIError(413, f"{param}: the image is {width}x{height} = {width * height} pixels, over the limit "
                                f"of {limits.max_image_pixels}", param, "image_too_large")
        if width < 1 or height < 1:
            raise APIError(400, f"{param}: the image has no pixels ({width}x{height})", param, "invalid_image")
        if not decodes_inline(image, data):
            return _decode_in_box(data, limits, param)
        with image_errors(param, "the image could not be decoded (truncated or corrupt?)"):
            image.load()
            return image.convert("RGB")


def _decode_in_box(data: bytes, limits: Limits, param: str) -> Image.Image:
    try:
        return default_box().decode_image(data, FORMATS, limits.max_image_pixels, param)
    except MediaBusy as exc:
        raise APIError(503, f"{exc}; retry later", param, "busy", exc.retry_after_s) from None
    except ImageTooLarge as exc:
        raise APIError(413, f"{param}: the image is too large to decode: {exc}", param, "image_too_large") from None
    except MediaLimitError as exc:  # the box's deadline or memory limit; its message names `param`
        raise APIError(413, str(exc) if f"({exc.limit})" in str(exc) else f"{exc} ({exc.limit})", param,
                       "image_too_large") from None
    except UnreadableImage as exc:
        what = (f"not a readable image (accepted formats: {', '.join(FORMATS)})" if exc.stage == "open"
                else "the image could not be decoded (truncated or corrupt?)")
        raise APIError(400, f"{param}: {what} ({exc})", param, "invalid_image") from None
    except ValueError as exc:  # the decoding process failed on these bytes
        raise APIError(400, f"{param}: the image could not be decoded ({exc})", param, "invalid_image") from None


def decode_base64(text: str, limits: Limits, param: str, media: Media | None = None) -> bytes:
    media = media or image_media(limits)
    # base64 is 4 characters for 3 bytes: refuse an oversized payload before decoding it.
    if len(text) * 3 // 4 > media.max_bytes + 3:
        raise APIError(413, f"{param}: the {media.name} is over the limit of {media.max_bytes} bytes",
                       param, media.too_large_code)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"{param}: invalid base64 data: {exc}", param, f"invalid_{media.name}") from None


def data_url_bytes(url: str, limits: Limits, param: str, media: Media | None = None) -> bytes:
    """The payload of a `data:<media>/<type>;base64,<data>` URL, under the media's byte limit."""
    media = media or image_media(limits)
    header, sep, payload = url.partition(",")
    declared = header.removeprefix("data:")
    if not sep or not declared.endswith(";base64"):
        raise APIError(400, f"{param}: a data URL must look like data:{media.name}/<type>;base64,<data>", param,
                       media.url_code)
    media_type = declared.removesuffix(";base64").split(";")[0].strip().lower()
    if media_type and not media_type.startswith(f"{media.name}/"):
        raise APIError(400, f"{param}: the data URL has media type {media_type!r}, not {media.article}", param,
                       media.url_code)
    return decode_base64(payload, limits, param, media)


def decode_data_url(url: str, limits: Limits, param: str) -> Image.Image:
    return decode_image(data_url_bytes(url, limits, param), limits, param)


def _host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowlist:
        entry = entry.lower().rstrip(".")
        if host == entry or (entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False


async def _resolve(host: str, port: int, check_public: bool, param: str, code: str = "invalid_image_url") -> str:
    """The address to download from: the host's first address, after checking every one it resolves to
    (when `check_public`). The download connects to this very address instead of resolving the name again,
    so that a DNS answer that changes between the check and the connection (DNS rebinding) cannot point
    the server at a private or loopback address."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise APIError(400, f"{param}: cannot resolve {host!r}: {exc}", param, code) from None
    if check_public:
        for info in infos:
            address = embedded_ipv4(ipaddress.ip_address(info[4][0].split("%")[0]))
            if not address.is_global:
                raise APIError(400, f"{param}: {host!r} resolves to the non-public address {address}, which is "
                                    "not allowed", param, code)
    return infos[0][4][0]


def embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address carries (IPv4-mapped ::ffff:a.b.c.d, IPv4-compatible ::a.b.c.d,
    NAT64 64:ff9b::a.b.c.d, 6to4, Teredo), which is where it leads; else the address itself."""
    if not isinstance(address, ipaddress.IPv6Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    value = int(address)
    if value >> 32 == 0 and value > 1:  # ::a.b.c.d (:: and ::1 are themselves)
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    if value >> 32 == 0x64FF9B << 64:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return address


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def fetch_remote(url: str, limits: Limits, param: str, media: Media | None = None) -> bytes:
    """The bytes at an http(s) URL under the remote-image policy of `limits` (videos follow it too)."""
    media = media or image_media(limits)
    code = media.url_code
    if not limits.allow_remote_images:
        raise APIError(400, f"{param}: remote {media.name} URLs are disabled on this server; send a data URL "
                            f"(data:{media.name}/...;base64,...)", param, code)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise APIError(400, f"{param}: unsupported {media.name} URL {url[:100]!r}", param, code)
    if not _host_allowed(parts.hostname, limits.remote_image_hosts):
        raise APIError(400, f"{param}: host {parts.hostname!r} is not on this server's image host allowlist",
                       param, code)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = await _resolve(parts.hostname, port, not limits.allow_private_remote_images, param, code)
    # The request goes to the checked address; the Host header and TLS (SNI and the certificate's name)
    # still use the URL's host name.
    userinfo = parts.netloc.rpartition("@")[0]
    pinned = parts._replace(netloc=f"{userinfo}{'@' if userinfo else ''}{_bracketed(address)}:{port}").geturl()
    host_header = _bracketed(parts.hostname) + (f":{parts.port}" if parts.port else "")
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}

    async def download() -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, timeout=limits.remote_image_timeout_s) as client:
            async with client.stream("GET", pinned, headers={"Host": host_header}, extensions=extensions) as response:
                if response.status_code != 200:
                    raise APIError(400, f"{param}: fetching the {media.name} gave HTTP {response.status_code}",
                                   param, code)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > media.max_bytes:
                        raise APIError(413, f"{param}: the remote {media.name} is over the limit of "
                                            f"{media.max_bytes} bytes", param, media.too_large_code)
                return bytes(body)

    try:
        return await asyncio.wait_for(download(), limits.remote_image_timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise APIError(400, f"{param}: fetching the {media.name} failed: {type(exc).__name__} {exc}", param,
                       code) from None


async def load_image_url(url: str, limits: Limits, param: str) -> Image.Image:
    """An `image_url` from a chat message: a data URL, or an http(s) URL when the policy allows it."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{param}: the image URL must be a non-empty string", param, "invalid_image_url")
    if url.startswith("data:"):
        return await work_pools(limits).run("decode", decode_data_url, url, limits, param)
    data = await fetch_remote(url, limits, param)
    return await work_pools(limits).run("decode", decode_image, data, limits, param)
