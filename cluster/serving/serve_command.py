"""``specserve serve``: deploy a Ray Serve config file and serve it until Ctrl-C.

It does what ``serve run deploy/default.yaml`` does (the same ``ServeDeploySchema`` validation
and controller ``apply_config``; deployments sections, replicas and autoscaling included), plus:

- every specserve application's ``args`` is validated first (:func:`cluster.config.parse_app_args`),
  so a bad key fails immediately with a message naming the key and the value;
- the HTTP and gRPC addresses come from, in order: the command-line flags, the YAML's top-level
  ``http_options`` / ``grpc_options``, the first specserve application's ``args.server``, and the
  defaults (127.0.0.1, 8000, 9000); the SpecServe gRPC servicer is always registered;
- Ray is started locally unless ``RAY_ADDRESS`` names a cluster (:func:`cluster.serving.bringup.init_ray`);
- before it starts Ray locally, it binds itself to the cores that ``resources.cpu_affinity`` leaves
  to the serving processes, which every process Ray starts inherits (:func:`bind_serving_processes`,
  :mod:`cluster.serving.cpu_affinity`);
- it waits until every application is RUNNING and every proxy HEALTHY (a proxy slow to start on
  a busy machine is waited for, not a failure), prints the addresses, blocks until Ctrl-C (or
  SIGTERM), then shuts Serve down (and Ray, when it started it).

- with ``--direct-http-port`` (or ``args.server.direct_http_port``) every replica also serves HTTP
  itself on a port of its own, from that port up, skipping Serve's proxy (Ray Serve's direct
  ingress, :func:`direct_http_environment`; the proxy stays on the HTTP port);
- it logs a warning for every specserve application served without an API key
  (``args.security.api_key`` or ``SPECSERVE_API_KEY``): Ray Serve's gRPC proxy has no host
  option and listens on every interface at the gRPC port (:func:`api_key_warnings`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.worker.cpu_binding import bind_process, current_cores
from cluster.config import API_KEY_ENV, ConfigError, parse_app_args, read_serve_config, resolve_api_key
from cluster.serving.cpu_affinity import CPU_CORES_ENV, SPARING, serving_cores
from cluster.serving.security import grpc_all_interfaces_warning

logger = logging.getLogger(__name__)

SPECSERVE_IMPORT_PATH = "cluster.app:build_app"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 9000
DEPLOY_TIMEOUT_S = 600.0
POLL_INTERVAL_S = 1.0


#: Ray Serve's direct ingress (experimental in Ray 2.60): read by Serve's controller and replicas
#: when they start, so set in this process's environment before it starts Ray.
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
DIRECT_HTTP_PORTS_ENV = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
#: Seconds a port a stopped replica released stays out of use (Serve's default, 150 s, lets a load
#: balancer drain it); 0 here: a restarted replica takes its port back at once.
PORT_QUARANTINE_ENV = "RAY_SERVE_PORT_QUARANTINE_S"


@dataclass(frozen=True)
class ServerAddresses:
    """Where the proxies listen, and the first port of the replicas' own HTTP servers (None: off)."""

    host: str
    http_port: int
    grpc_port: int
    direct_http_port: int | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def direct_http_url(self) -> str | None:
        return None if self.direct_http_port is None else f"http://{self.host}:{self.direct_http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def _specserve_apps(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        app
        for app in document["applications"]
        if isinstance(app, dict) and app.get("import_path") == SPECSERVE_IMPORT_PATH
    ]


def validate_document(document: dict[str, Any], where: str) -> None:
    """Validate the ``args`` of every specserve application; raises :class:`ConfigError`."""
    for app in _specserve_apps(document):
        parse_app_args(app.get("args") or {}, where=f"{where} application {app.get('name')!r} args")


def resolve_addresses(
    document: dict[str, Any], host: str | None = None, http_port: int | None = None, grpc_port: int | None = None,
    direct_http_port: int | None = None,
) -> ServerAddresses:
    """Flags, then the YAML's ``http_options``/``grpc_options``, then ``args.server``, then defaults
    (the direct HTTP port: the flag, then ``args.server.direct_http_port``)."""
    http_options = document.get("http_options") or {}
    grpc_options = document.get("grpc_options") or {}
    server: dict[str, Any] = {}
    apps = _specserve_apps(document)
    if apps:
        server = (apps[0].get("args") or {}).get("server") or {}

    def pick(*values: Any) -> Any:
        return next(value for value in values if value is not None)

    direct = direct_http_port if direct_http_port is not None else server.get("direct_http_port")
    return ServerAddresses(
        host=pick(host, http_options.get("host"), server.get("host"), DEFAULT_HOST),
        http_port=int(pick(http_port, http_options.get("port"), server.get("http_port"), DEFAULT_HTTP_PORT)),
        grpc_port=int(pick(grpc_port, grpc_options.get("port"), server.get("grpc_port"), DEFAULT_GRPC_PORT)),
        direct_http_port=None if direct is None else int(direct),
    )


def ingress_replicas(document: dict[str, Any]) -> int:
    """The most replicas the specserve applications' ingress deployments may run at once, summed
    over the applications (each replica takes a direct HTTP port of its own; :func:`_deployment_replicas`)."""
    from cluster.serving.ingress import DEPLOYMENT_NAME

    total = 0
    for app in _specserve_apps(document):
        deployment = next((d for d in app.get("deployments") or [] if d.get("name") == DEPLOYMENT_NAME), {})
        total += max(1, _deployment_replicas(deployment)[1])
    return max(1, total)


def _deployment_replicas(deployment: dict[str, Any]) -> tuple[int | None, int]:
    """A deployment's replicas: the count it runs (None where Serve scales it), and the most it may
    run: ``num_replicas`` (1 when unset), or ``autoscaling_config.max_replicas`` with Serve's
    defaults (100 with ``num_replicas: auto``, else 1)."""
    replicas, autoscaling = deployment.get("num_replicas", 1), deployment.get("autoscaling_config")
    if replicas == "auto":
        return None, int((autoscaling or {}).get("max_replicas", 100))
    if autoscaling is not None:
        return None, int(autoscaling.get("max_replicas", 1))
    if not isinstance(replicas, int):  # Serve's schema takes an int or "auto" only
        return None, 1
    return replicas, replicas


def direct_http_environment(addresses: ServerAddresses, replicas: int) -> dict[str, str]:
    """The environment that turns on Ray Serve's direct ingress for a Ray this process starts:
    each ingress replica serves HTTP itself on a port of ``[direct_http_port, direct_http_port +
    replicas)`` (lowest free first), next to Serve's proxy. Raises :class:`ConfigError` when that
    range would take the proxy's HTTP or gRPC port."""
    first = addresses.direct_http_port
    if first is None:
        return {}
    if not 1 <= first <= 65535:
        raise ConfigError(f"server.direct_http_port: must be a port in [1, 65535], got {first}")
    ports = range(first, first + replicas)
    if ports.stop - 1 > 65535:
        raise ConfigError(f"server.direct_http_port: {first} + {replicas} replicas runs past port 65535")
    for name, port in (("http_port", addresses.http_port), ("grpc_port", addresses.grpc_port)):
        if port in ports:
            raise ConfigError(f"server.direct_http_port: the replicas' ports {first}..{ports.stop - 1} include the "
                              f"{name} {port}")
    return {DIRECT_INGRESS_ENV: "1", DIRECT_HTTP_PORTS_ENV[0]: str(first), DIRECT_HTTP_PORTS_ENV[1]: str(ports.stop),
            PORT_QUARANTINE_ENV: "0"}


def with_addresses(document: dict[str, Any], addresses: ServerAddresses) -> dict[str, Any]:
    """A copy of the Serve config with the proxies' host/ports set and the gRPC servicer registered.

    The servicer is :data:`cluster.serving.ingress.GRPC_SERVICER_REGISTRATION`; a config that lists the
    stubs' own registration function (``GRPC_SERVICER_FUNCTION``) gets it replaced, so
    undecodable requests answer INVALID_ARGUMENT there too.
    """
    from cluster.serving.ingress import GRPC_SERVICER_FUNCTION, GRPC_SERVICER_REGISTRATION

    document = copy.deepcopy(document)
    http_options = dict(document.get("http_options") or {})
    http_options.update(host=addresses.host, port=addresses.http_port)
    grpc_options = dict(document.get("grpc_options") or {})
    servicers = [
        GRPC_SERVICER_REGISTRATION if servicer == GRPC_SERVICER_FUNCTION else servicer
        for servicer in grpc_options.get("grpc_servicer_functions") or []
    ]
    servicers = list(dict.fromkeys(servicers))
    if GRPC_SERVICER_REGISTRATION not in servicers:
        servicers.append(GRPC_SERVICER_REGISTRATION)
    grpc_options.update(port=addresses.grpc_port, grpc_servicer_functions=servicers)
    document["http_options"] = http_options
    document["grpc_options"] = grpc_options
    return document


def api_key_warnings(
    document: dict[str, Any], addresses: ServerAddresses, joining_cluster: bool, environ: Any = None
) -> list[str]:
    """Start-up warnings about authentication; raises :class:`ConfigError` for a malformed
    ``SPECSERVE_API_KEY``.

    - Every specserve application without a key (neither ``args.security.api_key`` nor
      ``SPECSERVE_API_KEY`` here) is reachable unauthenticated by gRPC on every interface.
    - When joining a running cluster, a key taken from this process's ``SPECSERVE_API_KEY``
      does not reach the replicas: the variable must be set where they run.
    """
    environ = os.environ if environ is None else environ
    unkeyed: list[str] = []
    from_environment: list[str] = []
    for app in _specserve_apps(document):
        args = parse_app_args(app.get("args") or {})
        name = str(app.get("name"))
        if resolve_api_key(args, environ) is None:
            unkeyed.append(name)
        elif args.security.api_key is None:
            from_environment.append(name)
    warnings = []
    if unkeyed:
        warnings.append(grpc_all_interfaces_warning(unkeyed, addresses.grpc_port))
    if joining_cluster and from_environment:
        names = ", ".join(repr(name) for name in from_environment)
        warnings.append(
            f"{API_KEY_ENV} is set in this process, but applications {names} run on a Ray cluster that "
            f"was already running: the key applies only where {API_KEY_ENV} is set in the replicas' "
            "environment (the nodes' environment, or the application's runtime_env.env_vars)"
        )
    return warnings


def parse_serve_config(document: dict[str, Any], where: str) -> Any:
    """Validate the whole document with Ray Serve's own schema (what ``serve run`` accepts)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        return ServeDeploySchema.model_validate(document)
    except ValidationError as error:
        raise ConfigError(f"{where}: not a valid Ray Serve config:\n{error}") from None


def wait_until_running(app_names: list[str], timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Block until every application is RUNNING and every proxy HEALTHY (the addresses printed
    after this answer); raise RuntimeError with Serve's message if an application fails."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus, ProxyStatus

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status()
        statuses = {name: status.applications.get(name) for name in app_names}
        failed = {
            name: _failure_message(app_status)
            for name, app_status in statuses.items()
            if app_status is not None
            and app_status.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)
        }
        if failed:
            raise RuntimeError("deployment failed:\n" + "\n".join(f"  {name}: {text}" for name, text in failed.items()))
        apps_running = all(
            app_status is not None and app_status.status == ApplicationStatus.RUNNING for app_status in statuses.values()
        )
        proxies_healthy = all(proxy == ProxyStatus.HEALTHY for proxy in status.proxies.values())
        if apps_running and proxies_healthy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"not serving after {timeout_s:.0f}s: applications {statuses}, proxies {dict(status.proxies)}"
                + ("" if proxies_healthy else f"; {_proxy_hint()}")
            )
        time.sleep(POLL_INTERVAL_S)


def _failure_message(application_status: Any) -> str:
    """The application's message plus the last line of each failed deployment's error."""
    parts = [application_status.message]
    for name, deployment in (application_status.deployments or {}).items():
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if lines:
            parts.append(f"{name}: {lines[-1]}")
    return " | ".join(part for part in parts if part)


def _proxy_hint() -> str:
    """Which setting gives a slow proxy longer to start, and its value now."""
    from cluster.serving.bringup import SERVE_PROXY_READY_TIMEOUT_ENV

    timeout = os.environ.get(SERVE_PROXY_READY_TIMEOUT_ENV)
    now = f"now {timeout} s" if timeout else "now Ray's default of 5 s"
    return f"on a busy machine raise {SERVE_PROXY_READY_TIMEOUT_ENV} ({now}) in the environment of the Ray cluster"


def _first_line(error: Exception) -> str:
    """The first non-blank line of ``error``'s message (Ray's run on for pages), else its type."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def proxy_start_failure(error: Exception) -> str:
    """The message for a Serve start whose controller is gone after its proxies failed."""
    return f"Ray Serve's HTTP/gRPC proxy did not start ({type(error).__name__}: {_first_line(error)}); {_proxy_hint()}"


def start_serve(schema: Any) -> None:
    """``serve.start`` with the config's proxy options, patient with slow proxies.

    ``serve.start`` gives up after 60 s waiting for its proxies, or when the controller kills a
    proxy that missed its readiness checks (it starts another). On a starved machine that is
    slowness, not failure: while the controller lives, the start goes on and
    :func:`wait_until_running` waits for the proxies to be HEALTHY. Raises RuntimeError when
    the controller itself is gone.
    """
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException

    try:
        serve.start(
            proxy_location=schema.proxy_location,
            http_options=schema.http_options.model_dump(),
            grpc_options=schema.grpc_options.model_dump(),
        )
    except (TimeoutError, RayError) as error:
        logger.warning("Ray Serve's proxies are not ready yet (%s: %s); still waiting for them",
                       type(error).__name__, _first_line(error))
        try:
            _get_global_client()
        except RayServeException:
            raise RuntimeError(proxy_start_failure(error)) from error


def deploy(config_path: str, addresses: ServerAddresses, document: dict[str, Any]) -> list[str]:
    """Start Serve with the given addresses and apply the config; returns the application names
    once every application runs and every proxy is healthy."""
    from ray.serve.context import _get_global_client

    schema = parse_serve_config(document, config_path)
    start_serve(schema)
    # The same controller call `serve run <config>` makes (it honours the deployments sections).
    _get_global_client().deploy_apps(schema)
    names = [app.name for app in schema.applications]
    wait_until_running(names)
    return names


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def placement_lines(document: dict[str, Any]) -> list[str]:
    """For each specserve application: which models share a worker and the rule that chose it, on
    the connected Ray cluster (:func:`cluster.config.placement.resolve_placement`); :class:`ConfigError` when
    one replica's workers ask for more GPUs than the cluster has (Serve would wait forever)."""
    from cluster.config.placement import check_cluster_gpus, describe_placement, resolve_placement

    lines = []
    for app in _specserve_apps(document):
        config = resolve_placement(parse_app_args(app.get("args") or {}, f"{app['name']}.args").freeze())
        try:
            check_cluster_gpus(config)
        except ConfigError as error:
            raise ConfigError(f"application {app['name']!r}: {error}") from None
        lines.append(f"placement of {app['name']}: {describe_placement(config)}")
    return lines


def _model_groups(app: dict[str, Any]) -> int | None:
    """Model groups (replicas) an application starts; None: not fixed (autoscaling)."""
    groups = 0
    for deployment in app.get("deployments") or [{}]:
        replicas = _deployment_replicas(deployment)[0]
        if replicas is None:
            return None
        groups += replicas
    return groups


def serving_binding(document: dict[str, Any], cores: Sequence[int], gpu_host: bool) -> tuple[tuple[int, ...] | None, str]:
    """The cores ``specserve serve`` binds the serving processes to before it starts Ray (every process
    Ray starts inherits them; :mod:`cluster.serving.cpu_affinity`), and why, for the specserve applications'
    ``resources.cpu_affinity`` on a host with ``cores``: the cores no application's workers take.
    ``auto`` and ``spare`` take part only where the document starts one model group (several would put their
    targets' workers on the same cores)."""
    reserved: set[int] = set()
    reasons = []
    apps = _specserve_apps(document)
    groups = [_model_groups(app) for app in apps]
    single = len(apps) == 1 and groups[0] == 1
    for app in apps:
        resources = parse_app_args(app.get("args") or {}, f"{app['name']}.args").resources
        setting = resources.cpu_affinity
        if setting in SPARING and not single:
            reasons.append(f"{app['name']}: {setting} binds nothing with several model groups")
            continue
        gpus = resources.gpus_per_model
        rest = serving_cores(setting, resources.torch_threads, cores, gpu_host or (gpus != "auto" and gpus > 0))
        if rest is not None:
            reserved |= set(cores) - set(rest)
    serving = tuple(core for core in sorted(set(cores)) if core not in reserved)
    if not reserved or not serving:
        return None, "; ".join(reasons) or "no worker takes a core of its own"
    return serving, f"workers' cores {sorted(reserved)}"


def bind_serving_processes(document: dict[str, Any]) -> None:
    """Before this process starts Ray: bind it to the cores :func:`serving_binding` leaves to the serving
    processes and record the host's cores in :data:`cluster.serving.cpu_affinity.CPU_CORES_ENV` (Ray's processes
    inherit both; the workers bind themselves to their own cores at start)."""
    import torch

    cores = current_cores()
    if not cores:
        return
    serving, why = serving_binding(document, cores, gpu_host=torch.cuda.is_available())
    if serving is None:
        logger.info("cpu affinity: serving processes not bound (%s)", why)
        return
    if bind_process(serving, "serving processes (Ray, Serve, coordinator)") is None:
        return
    os.environ[CPU_CORES_ENV] = ",".join(str(core) for core in cores)
    print(f"cpu affinity: Ray, Serve and the coordinators on cores {list(serving)}; {why}", flush=True)


def run_serve(
    config_path: str,
    host: str | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    block: bool = True,
    direct_http_port: int | None = None,
) -> int:
    """The ``serve`` subcommand; returns the process exit code."""
    import ray

    from cluster.serving.bringup import init_ray

    try:
        document = read_serve_config(config_path)
        validate_document(document, config_path)
        addresses = resolve_addresses(document, host, http_port, grpc_port, direct_http_port)
        document = with_addresses(document, addresses)
        parse_serve_config(document, config_path)
        started_ray = not ray.is_initialized()
        joining_cluster = not started_ray or bool(os.environ.get("RAY_ADDRESS"))
        direct_ports = ingress_replicas(document)  # one per replica
        direct_environment = direct_http_environment(addresses, direct_ports)
        if direct_environment and joining_cluster:
            raise ConfigError(
                "server.direct_http_port: direct HTTP needs the Ray that `specserve serve` starts itself (Serve reads "
                f"{DIRECT_INGRESS_ENV} and its port range when the cluster starts); unset RAY_ADDRESS, or start the "
                f"cluster with {', '.join(f'{k}={v}' for k, v in direct_environment.items())} in its environment and "
                "leave direct_http_port unset here")
        for warning in api_key_warnings(document, addresses, joining_cluster):
            logger.warning("%s", warning)
    except ConfigError as error:
        logger.error("%s", error)
        return 2

    if not joining_cluster:
        bind_serving_processes(document)
        os.environ.update(direct_environment)  # Ray's processes inherit it
    init_ray()
    try:
        for line in placement_lines(document):
            print(line, flush=True)
    except ConfigError as error:
        logger.error("%s", error)
        if started_ray:
            ray.shutdown()
        return 2
    # Ctrl-C and SIGTERM both stop the server (SIGINT is set explicitly: a shell that starts
    # the command in the background leaves SIGINT ignored, and Python keeps it that way).
    previous_handlers = {
        signum: signal.signal(signum, _raise_keyboard_interrupt) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        names = deploy(config_path, addresses, document)
        print(f"specserve is serving {', '.join(names)}", flush=True)
        print(f"HTTP (OpenAI-compatible): {addresses.http_url}/v1", flush=True)
        print(f"gRPC (specserve.SpecServe): {addresses.grpc_target}", flush=True)
        if addresses.direct_http_url is not None:
            more = f" (+{direct_ports - 1} ports, one per replica)" if direct_ports > 1 else ""
            print(f"HTTP direct to the replica, skipping the proxy: {addresses.direct_http_url}/v1{more}", flush=True)
        if block:
            logger.info("serving; press Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:
        logger.info("shutting down")
        return 0
    except RuntimeError as error:
        logger.error("%s", error)
        return 1
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        if block:
            _shutdown(started_ray)


def _shutdown(started_ray: bool) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
    logger.info("stopped")


def add_serve_subcommand(subparsers: Any) -> None:
    """Register ``specserve serve`` on an argparse subparsers object (``cluster.cli.SUBCOMMANDS``)."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a Ray Serve config over HTTP (OpenAI-compatible) and gRPC until Ctrl-C",
        description="Deploy a Ray Serve config file (default: deploy/default.yaml) and serve it until Ctrl-C.",
    )
    parser.add_argument("--config", default="deploy/default.yaml", help="Ray Serve YAML config (default: %(default)s)")
    parser.add_argument("--host", default=None, help="HTTP bind address (default: YAML, else 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP port (default: YAML, else 8000)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default: YAML, else 9000)")
    parser.add_argument("--direct-http-port", type=int, default=None,
                        help="Also serve HTTP from each replica itself on this port and up, one each, skipping Serve's "
                        "proxy (default: the YAML's args.server.direct_http_port, else off; docs/serving.md)")
    parser.set_defaults(handler=_serve_main)


def _serve_main(args: argparse.Namespace) -> int:
    return run_serve(args.config, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                     direct_http_port=args.direct_http_port)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m cluster.serving.serve_command``), same flags as ``specserve serve``."""
    parser = argparse.ArgumentParser(prog="specserve")
    add_serve_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
