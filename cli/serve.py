"""`vlmcap serve`: the API server on one engine. Its options are the fields of `EngineConfig`, `ServerSettings` and
`Limits` (cli/declared.py builds them, each with its environment variable), plus the few that set no field
(`--host`, `--port`, `--api-keys`, `--log-level`). The command line starts without loading torch."""

from __future__ import annotations

from typing import Any

from api.settings import Limits, ServerSettings
from cli.declared import Rename, command, engine_fields, from_dataclass, grammar_limit_fields, hand_option, values_for
from cli.options import LOG_FORMAT, PORT, STARTUP_FAILURE

# Options whose public name or environment variable is not the field's own.
RENAMES = {
    "enable_chunked_prefill": Rename("--chunked-prefill/--no-chunked-prefill", "VLMCAP_CHUNKED_PREFILL"),
    "enable_prefix_caching": Rename("--prefix-caching/--no-prefix-caching", "VLMCAP_PREFIX_CACHING"),
    "allowed_hosts": Rename("--allowed-host"),
    "remote_image_hosts": Rename("--remote-image-host"),
    "redis_url": Rename(envvar="REDIS_URL"),
    "run_queue_worker": Rename("--queue/--no-queue", "VLMCAP_QUEUE"),
    "shutdown_grace_s": Rename("--shutdown-grace", "VLMCAP_SHUTDOWN_GRACE"),
    "compile_timeout_s": Rename("--grammar-compile-timeout", "VLMCAP_GRAMMAR_COMPILE_TIMEOUT"),
    "workers": Rename("--grammar-workers", "VLMCAP_GRAMMAR_WORKERS"),
    "max_cache_bytes": Rename("--grammar-cache-bytes", "VLMCAP_GRAMMAR_CACHE_BYTES"),
}
ENGINE = engine_fields()
GRAMMAR = grammar_limit_fields()
SERVER = from_dataclass(ServerSettings)
LIMITS = from_dataclass(Limits)
DECLARED = ENGINE + GRAMMAR + SERVER + LIMITS  # the options built from settings fields
HAND = [
    hand_option("host", str, "127.0.0.1", "--host", envvar="VLMCAP_HOST", help="Address to listen on (0.0.0.0: all)."),
    hand_option("port", int, PORT, "--port", envvar="VLMCAP_PORT", help="TCP port."),
    hand_option("api_keys_text", str | None, None, "--api-keys", envvar="VLMCAP_API_KEYS",
                help="Named keys, one 'name:key' a line, or a file of such lines: each key's requests share no "
                     "cached prefix with another's (see --share-prefix-cache)."),
    hand_option("log_level", str, "info", "--log-level", envvar="VLMCAP_LOG_LEVEL",
                help="debug, info, warning, error."),
]


def settings_from(options: dict[str, Any]) -> ServerSettings:
    """The settings the options describe (ValueError naming a bad value)."""
    from api.guard import parse_api_keys
    from engine import EngineConfig
    from engine.grammar_limits import GrammarLimits

    server = values_for(SERVER, options)
    host = options["host"]
    server["allowed_hosts"] = (*server["allowed_hosts"], *([] if host in ("0.0.0.0", "::", "") else [host]))
    for name in ("api_key", "redis_url", "alert_webhook"):
        server[name] = server[name] or None
    keys = options["api_keys_text"]
    grammar_limits = GrammarLimits(**values_for(GRAMMAR, options))
    engine = EngineConfig(**values_for(ENGINE, options), grammar_limits=grammar_limits)
    limits = Limits(**values_for(LIMITS, options))
    return ServerSettings(engine=engine, limits=limits, api_keys=parse_api_keys(keys) if keys else {}, **server)


def run_server(**options: Any) -> None:
    """Serve OpenAI-compatible chat and REST captioning on one shared engine (and its camera queue)."""
    import logging

    import typer

    from api.connections import ListeningServer, bind_listeners, uvicorn_config
    from api.guard import check_exposure
    from jobqueue.alerts import validate_webhook_url

    logging.basicConfig(level=options["log_level"].upper(), format=LOG_FORMAT)
    log = logging.getLogger(__name__)
    try:
        if options["alert_webhook"]:
            validate_webhook_url(options["alert_webhook"])
        settings = settings_from(options)
        check_exposure(options["host"], settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    # The port first, before seconds of imports (torch, transformers) and the engine's load: one in use ends the
    # command at once, with uvicorn's exit status for a server that could not start.
    try:
        sockets = bind_listeners(options["host"], options["port"])
    except OSError as exc:
        log.error("%s", exc.strerror or exc)
        raise typer.Exit(STARTUP_FAILURE) from None
    from api.server import create_app

    try:
        app = create_app(settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    # The connections' timeouts, limit and log rate are the settings' (api/connections.py).
    server = ListeningServer(uvicorn_config(app, settings, host=options["host"], port=options["port"],
                                            log_level=options["log_level"].lower(),
                                            timeout_graceful_shutdown=settings.shutdown_grace_s))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # Ctrl-C, which uvicorn raises again after its graceful shutdown (as `uvicorn.run`)
        pass
    if not server.started:
        raise typer.Exit(STARTUP_FAILURE)


serve = command(run_server, HAND, DECLARED, RENAMES)
serve.__name__ = "serve"
