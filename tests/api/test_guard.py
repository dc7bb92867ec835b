"""Who may use the server (api/guard.py): protected mode refuses an open server on a non-loopback address,
named API keys come from lines or a file, `/metrics` is behind the key when one is set (unless opened), and a
forged Host header opens nothing on a keyed server. The app is the real one; its routes answer 503 before the
engine loads, which is enough to tell the guard let a request through."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.guard import DEFAULT_KEY_NAME, check_exposure, configured_keys, host_name, parse_api_keys
from api.server import create_app
from api.settings import ServerSettings
from cli.main import app as cli_app

OPEN_ADDRESSES = ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "myhost.example", "2001:db8::1"]


@pytest.mark.parametrize("host", OPEN_ADDRESSES)
def test_protected_mode_refuses_a_keyless_server_on_a_non_loopback_address(host):
    with pytest.raises(ValueError) as refused:
        check_exposure(host, ServerSettings())
    for advice in ("--api-key", "VLMCAP_API_KEY", "--allow-unauthenticated", "VLMCAP_ALLOW_UNAUTHENTICATED"):
        assert advice in str(refused.value)
    check_exposure(host, ServerSettings(api_key="k"))
    check_exposure(host, ServerSettings(api_keys={"cam": "k"}))
    check_exposure(host, ServerSettings(allow_unauthenticated=True))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2", "api.localhost"])
def test_protected_mode_lets_a_keyless_server_listen_on_loopback(host):
    check_exposure(host, ServerSettings())


def test_vlmcap_serve_on_all_addresses_without_a_key_refuses_to_start(monkeypatch):
    for name in ("VLMCAP_API_KEY", "VLMCAP_API_KEYS", "VLMCAP_ALLOW_UNAUTHENTICATED", "VLMCAP_HOST"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli_app, ["serve", "--model", "tiny", "--host", "0.0.0.0"])
    assert result.exit_code == 2, result.output
    assert "without an API key" in result.output and "VLMCAP_API_KEY" in result.output


def test_named_keys_come_from_lines_or_a_file(tmp_path):
    text = "# operators\nalice: key-a\n\nbob:key-b:with-colon\n"
    assert parse_api_keys(text) == {"alice": "key-a", "bob": "key-b:with-colon"}
    path = tmp_path / "keys"
    path.write_text(text)
    assert parse_api_keys(str(path)) == parse_api_keys(text)
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        parse_api_keys(str(tmp_path / "missing"))
    for bad, why in [("alice:", "empty"), ("a b:k", "name"), ("a:k\na:j", "twice"), ("a:k\nb:k", "another"),
                     ("a:k k", "whitespace")]:
        with pytest.raises(ValueError, match=why):
            parse_api_keys(bad)
    assert configured_keys(ServerSettings(api_key="k0", api_keys={"alice": "k1"})) == {
        "alice": "k1", DEFAULT_KEY_NAME: "k0"}
    with pytest.raises(ValueError):
        create_app(ServerSettings(api_key="k1", api_keys={"alice": "k1"}))


def keyed_client(**settings) -> TestClient:
    return TestClient(create_app(ServerSettings(api_keys={"alice": "key-a", "bob": "key-b"}, **settings)))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_named_key_opens_the_api_and_a_forged_host_opens_nothing():
    http = keyed_client()
    for headers in ({}, {"Host": "localhost"}, {"Host": "127.0.0.1"}, bearer("key-c"), bearer("key-a key-b")):
        reply = http.get("/v1/models", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", headers
    for key in ("key-a", "key-b"):
        assert http.get("/v1/models", headers=bearer(key)).status_code == 503  # past the guard: still loading


def test_metrics_need_the_key_when_one_is_set_unless_opened():
    keyed = keyed_client()
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers={"Host": "localhost"}).status_code == 401
    assert "vlmcap_http_requests_total" in keyed.get("/metrics", headers=bearer("key-b")).text
    opened = keyed_client(public_metrics=True)
    assert opened.get("/metrics").status_code == 200
    assert opened.get("/v1/models").status_code == 401
    keyless = TestClient(create_app(ServerSettings()))
    assert keyless.get("/metrics", headers={"Host": "10.0.0.7:8000"}).status_code == 200


FORGED_LOOPBACK_HOSTS = ["localhost:8000@evil.example", "127.0.0.1:80@evil.example", "localhost@evil.example",
                         "localhost:80:80", "[::1]@evil.example", "[::1]:80x", "localhost#.evil.example",
                         "evil.example/localhost", "localhost:8o", "localhost\\@evil.example"]


@pytest.mark.parametrize("host", FORGED_LOOPBACK_HOSTS)
def test_a_keyless_server_refuses_a_host_header_that_only_starts_with_a_loopback_name(host):
    keyless = TestClient(create_app(ServerSettings(allowed_hosts=("cams.example",))))
    reply = keyless.get("/v1/models", headers={"Host": host})
    assert reply.status_code == 403, host
    assert reply.json()["error"]["code"] == "host_not_allowed"
    for plain in ("localhost:8000", "127.0.0.1", "[::1]:8000", "api.localhost", "cams.example:443"):
        assert keyless.get("/v1/models", headers={"Host": plain}).status_code == 503, plain  # past the guard


def test_host_name_takes_a_name_and_a_port_only():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("2001:db8::1") == "2001:db8::1"
    for forged in FORGED_LOOPBACK_HOSTS + ["", ":80", "[]", "[localhost]"]:
        assert host_name(forged) == "", forged
    with pytest.raises(ValueError):
        check_exposure("localhost:1@0.0.0.0", ServerSettings())
