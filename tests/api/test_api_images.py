"""Remote image URLs: off by default, only allowlisted hosts, never loopback or private addresses unless
allowed, with a size limit; fetched from a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ultralytics.utils import ASSETS

from api.errors import APIError
from api.images import load_image_url
from api.settings import Limits

BUS = (ASSETS / "bus.jpg").read_bytes()


class Photos(BaseHTTPRequestHandler):
    hosts: list[str] = []  # the Host header of every request served

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        Photos.hosts.append(self.headers["Host"])
        found = self.path == "/bus.jpg"
        self.send_response(200 if found else 404)
        self.end_headers()
        if found:
            self.wfile.write(BUS)

    def log_message(self, *_) -> None:
        pass


@pytest.fixture(scope="module")
def photo_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Photos)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


ALLOWED = Limits(allow_remote_images=True, remote_image_hosts=("127.0.0.1",), allow_private_remote_images=True)


def load(url: str, limits: Limits):
    return asyncio.run(load_image_url(url, limits, "image_url"))


def test_allowed_remote_image_is_fetched(photo_url):
    assert load(f"{photo_url}/bus.jpg", ALLOWED).size == (810, 1080)


@pytest.mark.parametrize(("limits", "path", "status", "message"), [
    (Limits(), "/bus.jpg", 400, "remote image URLs are disabled"),
    (replace(ALLOWED, remote_image_hosts=("*.example.com",)), "/bus.jpg", 400, "not on this server's image host"),
    (replace(ALLOWED, allow_private_remote_images=False), "/bus.jpg", 400, "non-public address 127.0.0.1"),
    (replace(ALLOWED, max_image_bytes=1000), "/bus.jpg", 413, "over the limit of 1000 bytes"),
    (ALLOWED, "/missing.jpg", 400, "HTTP 404"),
])
def test_refused_remote_images(photo_url, limits, path, status, message):
    with pytest.raises(APIError) as refused:
        load(photo_url + path, limits)
    assert refused.value.status == status and message in refused.value.message


def answers(monkeypatch, *addresses: str) -> list[str]:
    """Name resolution that answers `addresses` in turn (the last one from then on), as a DNS server whose
    answer changes between two lookups would; returns the list of names looked up."""
    looked_up, real = [], socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in ("photos.test", b"photos.test"):  # some clients pass the name IDNA-encoded
            return real(host, port, *args, **kwargs)
        address = addresses[min(len(looked_up), len(addresses) - 1)]
        looked_up.append("photos.test")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked_up


def test_the_download_goes_to_the_address_that_was_checked_under_the_host_name(photo_url, monkeypatch):
    looked_up = answers(monkeypatch, "127.0.0.1")
    port = photo_url.rsplit(":", 1)[1]
    Photos.hosts.clear()
    limits = replace(ALLOWED, remote_image_hosts=("photos.test",))
    assert load(f"http://photos.test:{port}/bus.jpg", limits).size == (810, 1080)
    assert looked_up == ["photos.test"] and Photos.hosts == [f"photos.test:{port}"]


def test_a_name_that_rebinds_to_loopback_after_the_check_does_not_reach_it(photo_url, monkeypatch):
    """The check sees a public address; a second lookup would answer loopback, where the photo server
    listens. The download connects to the checked address only, so loopback never sees a request."""
    looked_up = answers(monkeypatch, "8.8.8.8", "127.0.0.1")
    port = photo_url.rsplit(":", 1)[1]
    Photos.hosts.clear()
    limits = replace(ALLOWED, remote_image_hosts=("photos.test",), allow_private_remote_images=False,
                     remote_image_timeout_s=2.0)
    with pytest.raises(APIError) as refused:
        load(f"http://photos.test:{port}/bus.jpg", limits)
    assert refused.value.status == 400 and "fetching the image failed" in refused.value.message
    assert looked_up == ["photos.test"] and Photos.hosts == []


@pytest.mark.parametrize("address", ["::127.0.0.1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1"])
def test_ipv6_addresses_that_embed_a_private_ipv4_are_refused(photo_url, monkeypatch, address):
    answers(monkeypatch, address)
    with pytest.raises(APIError) as refused:
        load("http://photos.test/bus.jpg", replace(ALLOWED, allow_private_remote_images=False,
                                                   remote_image_hosts=("photos.test",)))
    assert refused.value.status == 400 and "non-public address" in refused.value.message
