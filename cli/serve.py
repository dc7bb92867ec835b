"""`vlmcap serve`: the API server on one engine. Every flag also reads an environment variable. The defaults
are those of the settings each option sets: `ServerSettings` and `Limits` (read here), the engine's
`EngineConfig` (an engine option not given is not passed: the command line starts without loading torch)."""

from __future__ import annotations

import typer

from api.settings import Limits, ServerSettings
from cli.options import LOG_FORMAT, PORT, default


def serve(
    model: str = typer.Option(None, envvar="VLMCAP_MODEL", show_default=False,
                              help="Checkpoint directory, hub id, 'tiny' or 'dummy:<preset>' (default: "
                                   "the engine's)."),
    served_model_name: str = typer.Option(None, envvar="VLMCAP_SERVED_MODEL_NAME",
                                          help="Model id clients send and /v1/models lists (default: --model)."),
    host: str = typer.Option("127.0.0.1", envvar="VLMCAP_HOST", help="Address to listen on (0.0.0.0: all)."),
    port: int = typer.Option(PORT, envvar="VLMCAP_PORT", help="TCP port."),
    api_key: str = typer.Option(None, envvar="VLMCAP_API_KEY",
                                help="When set, every /v1 route and the API docs need 'Authorization: Bearer "
                                     "<key>'."),
    api_keys: str = typer.Option(None, envvar="VLMCAP_API_KEYS",
                                 help="Named keys, one 'name:key' a line, or a file of such lines: each key's "
                                      "requests share no cached prefix with another's (see --share-prefix-cache)."),
    allow_unauthenticated: bool = typer.Option(default(ServerSettings, "allow_unauthenticated"),
                                               "--allow-unauthenticated", envvar="VLMCAP_ALLOW_UNAUTHENTICATED",
                                               help="Listen on a non-loopback --host without an API key (an open "
                                                    "server; refused otherwise)."),
    public_metrics: bool = typer.Option(default(ServerSettings, "public_metrics"), "--public-metrics",
                                        envvar="VLMCAP_PUBLIC_METRICS",
                                        help="Serve /metrics without the API key (it needs one when keys are set)."),
    share_prefix_cache: bool = typer.Option(default(ServerSettings, "share_prefix_cache"), "--share-prefix-cache",
                                            envvar="VLMCAP_SHARE_PREFIX_CACHE",
                                            help="Let requests of different API keys share cached prefixes and "
                                                 "image features."),
    max_sse_subscribers: int = typer.Option(default(ServerSettings, "max_sse_subscribers"),
                                            envvar="VLMCAP_MAX_SSE_SUBSCRIBERS",
                                            help="Server-sent event streams open at once; beyond, 503."),
    allowed_host: list[str] = typer.Option([], envvar="VLMCAP_ALLOWED_HOSTS",
                                           help="Without --api-key: a Host name clients may use besides loopback "
                                                "ones and --host (repeat; '*': any)."),
    device: str = typer.Option(None, envvar="VLMCAP_DEVICE",
                               help="torch device: cpu, cuda, cuda:1, ... (default: the engine's)."),
    dtype: str = typer.Option(None, envvar="VLMCAP_DTYPE",
                              help="float32, bfloat16 or float16 (default: the engine's)."),
    max_num_batched_tokens: int = typer.Option(None, envvar="VLMCAP_MAX_NUM_BATCHED_TOKENS",
                                               help="Token budget of one engine step (default: the engine's)."),
    max_num_seqs: int = typer.Option(None, envvar="VLMCAP_MAX_NUM_SEQS",
                                     help="Most requests running at once (default: the engine's)."),
    num_kv_blocks: int = typer.Option(None, envvar="VLMCAP_NUM_KV_BLOCKS",
                                      help="KV cache size in blocks (default: from free memory)."),
    block_size: int = typer.Option(None, envvar="VLMCAP_BLOCK_SIZE",
                                   help="Tokens per KV cache block (default: the engine's)."),
    max_model_len: int = typer.Option(None, envvar="VLMCAP_MAX_MODEL_LEN",
                                      help="Most prompt plus output tokens of one request (default: the model's)."),
    chunked_prefill: bool = typer.Option(None, "--chunked-prefill/--no-chunked-prefill",
                                         envvar="VLMCAP_CHUNKED_PREFILL", show_default=False,
                                         help="Split long prompts over steps (default: the engine's)."),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching", envvar="VLMCAP_PREFIX_CACHING",
                                        show_default=False,
                                        help="Reuse the KV blocks of a prompt's prefix computed for an earlier "
                                             "request, images included (default: the engine's, on)."),
    encoder_cache_tokens: int = typer.Option(None, envvar="VLMCAP_ENCODER_CACHE_TOKENS", show_default=False,
                                             help="Vision features kept for images sent again, in the encoder's "
                                                  "output tokens (0: none; default: the engine's)."),
    num_threads: int = typer.Option(None, envvar="VLMCAP_NUM_THREADS", help="torch CPU threads."),
    compile_model: bool = typer.Option(None, "--compile-model/--no-compile-model", envvar="VLMCAP_COMPILE_MODEL",
                                       show_default=False,
                                       help="Compile the text model's decoder layers with torch.compile at "
                                            "start-up (CPU; default: the engine's, off)."),
    max_encoder_tokens_per_step: int = typer.Option(None, envvar="VLMCAP_MAX_ENCODER_TOKENS_PER_STEP",
                                                    help="Vision encoder work per step, in its output tokens; at "
                                                         "least one tile or image runs a step (0: no limit; "
                                                         "default: the engine's)."),
    encoder_slices_per_step: int = typer.Option(None, envvar="VLMCAP_ENCODER_SLICES_PER_STEP",
                                                help="Run a tile's vision tower this many slices (five a layer) "
                                                     "a step (SmolVLM; 0: whole; default: the engine's)."),
    redis_url: str = typer.Option(None, envvar="REDIS_URL",
                                  help="Redis for caption results shared with camera queue workers "
                                       "(default: results in memory, no queue)."),
    queue: bool = typer.Option(default(ServerSettings, "run_queue_worker"), "--queue/--no-queue", envvar="VLMCAP_QUEUE",
                               help="With --redis-url, caption camera jobs from the Redis queue in-process."),
    consumer_name: str = typer.Option(None, envvar="VLMCAP_CONSUMER_NAME",
                                      help="Queue worker's name in the consumer group (default: host-pid)."),
    claim_idle_seconds: float = typer.Option(default(ServerSettings, "claim_idle_s"),
                                             envvar="VLMCAP_CLAIM_IDLE_SECONDS",
                                             help="Take over jobs pending this long at another consumer."),
    max_deliveries: int = typer.Option(default(ServerSettings, "max_deliveries"), envvar="VLMCAP_MAX_DELIVERIES",
                                       help="Attempts before a camera job goes to the dead-letter stream."),
    batch_size: int = typer.Option(default(ServerSettings, "queue_batch_size"), envvar="VLMCAP_BATCH_SIZE",
                                   help="Camera jobs read at once and captioned concurrently."),
    caption_priority: int = typer.Option(default(ServerSettings, "caption_priority"), envvar="VLMCAP_CAPTION_PRIORITY",
                                         help="Engine priority of captions (lower first; chat is 0)."),
    fall_priority: int = typer.Option(default(ServerSettings, "fall_priority"), envvar="VLMCAP_FALL_PRIORITY",
                                      help="Engine priority of fall alerts' captions (lower first; chat is 0)."),
    alert_webhook: str = typer.Option(None, envvar="VLMCAP_ALERT_WEBHOOK",
                                      help="POST each fall alert's result as JSON to this URL (retried with "
                                           "backoff, never delaying captions)."),
    caption_prompt: str = typer.Option(default(ServerSettings, "caption_prompt"),
                                       envvar="VLMCAP_CAPTION_PROMPT", help="Prompt of captions that give none."),
    caption_max_tokens: int = typer.Option(default(ServerSettings, "caption_max_tokens"),
                                           envvar="VLMCAP_CAPTION_MAX_TOKENS", help="New tokens of a caption."),
    max_body_bytes: int = typer.Option(default(Limits, "max_body_bytes"), envvar="VLMCAP_MAX_BODY_BYTES",
                                       help="Largest request body."),
    max_image_bytes: int = typer.Option(default(Limits, "max_image_bytes"), envvar="VLMCAP_MAX_IMAGE_BYTES",
                                        help="Largest encoded image."),
    max_image_pixels: int = typer.Option(default(Limits, "max_image_pixels"), envvar="VLMCAP_MAX_IMAGE_PIXELS",
                                         help="Largest image in pixels, checked before decoding."),
    max_images_per_request: int = typer.Option(default(Limits, "max_images_per_request"),
                                               envvar="VLMCAP_MAX_IMAGES_PER_REQUEST",
                                               help="Most images in one request."),
    max_tokens_cap: int = typer.Option(default(Limits, "max_tokens_cap"), envvar="VLMCAP_MAX_TOKENS_CAP",
                                       help="Most new tokens one request may ask for."),
    default_max_tokens: int = typer.Option(default(Limits, "default_max_tokens"), envvar="VLMCAP_DEFAULT_MAX_TOKENS",
                                           help="New tokens of a request that sets no max_tokens."),
    max_waiting_requests: int = typer.Option(default(Limits, "max_waiting_requests"),
                                             envvar="VLMCAP_MAX_WAITING_REQUESTS",
                                             help="Requests waiting in the engine beyond which new ones get 429."),
    allow_remote_images: bool = typer.Option(default(Limits, "allow_remote_images"), "--allow-remote-images",
                                             envvar="VLMCAP_ALLOW_REMOTE_IMAGES",
                                             help="Fetch http(s) image URLs (only from --remote-image-host hosts)."),
    remote_image_host: list[str] = typer.Option([], envvar="VLMCAP_REMOTE_IMAGE_HOSTS",
                                                help="Host allowed for remote images (repeat; '*.example.com')."),
    allow_private_remote_images: bool = typer.Option(default(Limits, "allow_private_remote_images"),
                                                     "--allow-private-remote-images",
                                                     envvar="VLMCAP_ALLOW_PRIVATE_REMOTE_IMAGES",
                                                     help="Allow remote image hosts that resolve to private or "
                                                          "loopback addresses."),
    shutdown_grace: float = typer.Option(default(ServerSettings, "shutdown_grace_s"), envvar="VLMCAP_SHUTDOWN_GRACE",
                                         help="Seconds in-flight requests get to finish at shutdown."),
    log_level: str = typer.Option("info", envvar="VLMCAP_LOG_LEVEL", help="debug, info, warning, error."),
) -> None:
    """Serve OpenAI-compatible chat and REST captioning on one shared engine (and its camera queue)."""
    import logging

    import uvicorn

    from api.guard import check_exposure, parse_api_keys
    from api.server import create_app
    from engine import EngineConfig
    from jobqueue.alerts import validate_webhook_url

    # Set only when given, so that their defaults are EngineConfig's; 0 turns the two encoder limits off.
    given = {
        "model": model, "device": device, "dtype": dtype, "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs, "enable_chunked_prefill": chunked_prefill, "block_size": block_size,
        "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len, "num_threads": num_threads,
        "max_encoder_tokens_per_step": max_encoder_tokens_per_step, "encoder_slices_per_step": encoder_slices_per_step,
        "enable_prefix_caching": prefix_caching, "encoder_cache_tokens": encoder_cache_tokens,
        "compile_model": compile_model,
    }
    engine_options = {name: value for name, value in given.items() if value is not None}
    for name in ("max_encoder_tokens_per_step", "encoder_slices_per_step"):
        if engine_options.get(name) == 0:
            engine_options[name] = None
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)

    try:
        if alert_webhook:
            validate_webhook_url(alert_webhook)
        settings = ServerSettings(
            engine=EngineConfig(**engine_options),
            served_model_name=served_model_name, api_key=api_key or None, redis_url=redis_url or None,
            api_keys=parse_api_keys(api_keys) if api_keys else {}, allow_unauthenticated=allow_unauthenticated,
            public_metrics=public_metrics, share_prefix_cache=share_prefix_cache,
            max_sse_subscribers=max_sse_subscribers,
            allowed_hosts=(*allowed_host, *([] if host in ("0.0.0.0", "::", "") else [host])),
            run_queue_worker=queue, consumer_name=consumer_name, claim_idle_s=claim_idle_seconds,
            max_deliveries=max_deliveries, queue_batch_size=batch_size, caption_priority=caption_priority,
            fall_priority=fall_priority, alert_webhook=alert_webhook or None,
            caption_prompt=caption_prompt, caption_max_tokens=caption_max_tokens,
            shutdown_grace_s=shutdown_grace,
            limits=Limits(
                max_body_bytes=max_body_bytes, max_image_bytes=max_image_bytes, max_image_pixels=max_image_pixels,
                max_images_per_request=max_images_per_request, max_tokens_cap=max_tokens_cap,
                default_max_tokens=default_max_tokens, max_waiting_requests=max_waiting_requests,
                allow_remote_images=allow_remote_images, remote_image_hosts=tuple(remote_image_host),
                allow_private_remote_images=allow_private_remote_images,
            ),
        )
        check_exposure(host, settings)
        app = create_app(settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(),
                timeout_graceful_shutdown=shutdown_grace)
