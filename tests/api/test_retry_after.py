"""Every busy 503 says when to retry (`Retry-After`, whole seconds): a work pool's from its deadline, in OpenAI's
error body and in Ollama's; the media box's limits are server options (`--decode-timeout-s`, `--decode-memory-bytes`,
`--decode-workers`) that the server's app gives its media box."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.errors import install_error_handlers
from api.pools import WorkPool
from api.routes_ollama import answered
from api.server import create_app
from api.settings import ServerSettings
from engine.media_box import BoxLimits, configure_default_box, default_box


def busy_app() -> FastAPI:
    """A route whose pool's one thread is held while it asks for another."""
    app = FastAPI()
    install_error_handlers(app)
    pool = WorkPool("render", threads=1, deadline_s=1.5)

    async def crowded() -> str:
        release = threading.Event()
        held = asyncio.ensure_future(pool.run(release.wait, 30))
        await asyncio.sleep(0.05)
        try:
            return await pool.run(lambda: "done")
        finally:
            release.set()
            await held

    async def ollama_style() -> object:
        return await answered(crowded())

    app.get("/v1/work")(crowded)
    app.get("/api/work", response_model=None)(ollama_style)
    return app


@pytest.mark.timeout(60)
def test_a_busy_pool_answers_503_with_retry_after_its_deadline():
    with TestClient(busy_app()) as client:
        openai_style = client.get("/v1/work")
        ollama_style = client.get("/api/work")
    assert openai_style.status_code == 503 and openai_style.json()["error"]["code"] == "busy"
    assert openai_style.headers["Retry-After"] == "2"  # 1.5 s, in whole seconds
    assert ollama_style.status_code == 503 and "busy" in ollama_style.json()["error"]
    assert ollama_style.headers["Retry-After"] == "2"


def test_the_media_box_limits_are_server_options_given_to_the_box():
    settings = ServerSettings(decode_timeout_s=4.5, decode_memory_bytes=3 * 1024**3, decode_workers=1)
    assert settings.media_box_limits == BoxLimits(4.5, 3 * 1024**3, 1)
    assert ServerSettings().media_box_limits == BoxLimits()  # the defaults are the box's own
    try:
        create_app(settings)
        assert default_box().limits == BoxLimits(4.5, 3 * 1024**3, 1)
    finally:
        configure_default_box(BoxLimits())
    for name, value in (("decode_timeout_s", 0.0), ("decode_workers", 0), ("decode_memory_bytes", -1)):
        with pytest.raises(ValueError, match=name):
            ServerSettings(**{name: value})


def test_the_media_box_options_are_command_line_flags_and_variables(monkeypatch, served_settings):
    from typer.testing import CliRunner

    from cli.main import app

    built = served_settings
    monkeypatch.setenv("VLMCAP_DECODE_WORKERS", "2")
    result = CliRunner().invoke(app, ["serve", "--decode-timeout-s", "12", "--decode-memory-bytes", "1073741824"])
    assert result.exit_code == 0, result.output
    assert built[0].media_box_limits == BoxLimits(12.0, 1024**3, 2)
    refused = CliRunner().invoke(app, ["serve", "--decode-timeout-s", "0"])
    assert refused.exit_code != 0 and "decode_timeout_s" in refused.output
