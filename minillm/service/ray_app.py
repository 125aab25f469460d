"""Chapter 9 — the service on Ray Serve: chapter 8's OpenAI app at the ingress, engine replicas behind it.

Two deployments make one Serve application. `LLMServer` (replica.py) runs the engines, one process each.
`OpenAIIngress` runs chapter 8's app, unchanged, over a `RemoteLLM` (remote_llm.py), behind Serve's HTTP
proxy; the request router that picks a replica for each request is configured on `LLMServer` and runs in
the ingress's handle. The ingress tokenizes, applies the chat template, encodes every SSE event and routes, for
all the replicas: with `ingress_replicas` > 1 it runs in several processes too, and a third deployment,
`GatewayBuckets`, keeps the rate limits' buckets for all of them. Serve keeps the replica counts (fixed, or the
engines autoscaled between bounds on the requests in flight per replica) and restarts a replica whose process
dies. `RayService` starts all of it and always stops all of it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from ray import serve

from ..config import ModelConfig
from ..engine import context_length, default_device_dtype
from ..engine_args import EngineArgs
from ..ports import free_port
from ..threads import available_cores
from ..weights import DEFAULT_MODEL, resolve_model
from ..serving.api_server import build_app
from ..serving.async_llm import STEP_TIMEOUT_S
from ..serving.launch import API_KEY_ENV
from .gateway import AUTH_FAILURE_LIMIT, Buckets, RateLimit
from .ray_cluster import LOOPBACK, QUIET, listen_on_node_ip, require_model_dir, start_ray, start_serve
from .replica_header import IngressHeaders
from .remote_llm import RemoteLLM
from .replica import LLMServer

APP_NAME = "minillm"
INGRESS_MAX_ONGOING_REQUESTS = 100_000  # every HTTP request passes the one ingress; the app's own 429 is the limit
START_S = 600.0  # how long `RayService.start` waits for the application to run (every model load included)
REDEPLOY_STOP_S = 120  # how long `RayService.redeploy` waits for the old replicas to stop (their drain included)
DRAIN_S = 30.0  # how long a replica being removed (scaling down, redeploy, stop) lets its requests finish
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Serve notices a replica that stopped answering and starts another


@serve.deployment(name="GatewayBuckets", num_replicas=1, ray_actor_options={"num_cpus": 0})
class GatewayBuckets:
    """The gateway's token buckets for every ingress replica: one process keeps them, so each client's budget holds
    whichever replica its requests reach. (Budgets split per replica would sum to the limit only if Serve's proxy
    spread each client's requests evenly, which it does not promise.) A request costs the ingress one call here."""

    def __init__(self, limits: dict[str, RateLimit]):
        self.maps = {name: Buckets(limit) for name, limit in limits.items()}

    def take(self, name: str, client: str) -> float:
        return self.maps[name].take(client, time.monotonic())

    def wait(self, name: str, client: str) -> float:
        return self.maps[name].wait(client, time.monotonic())


class SharedBuckets:
    """One of `GatewayBuckets`' maps, behind the coroutines the gateway's middlewares call (`LocalBuckets`')."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    async def take(self, client: str) -> float:
        return await self.handle.take.remote(self.name, client)

    async def wait(self, client: str) -> float:
        return await self.handle.wait.remote(self.name, client)


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress:
    """Chapter 8's app (`build_app`) over the replicas, with `x-minillm-replica` on what they served and
    `x-minillm-ingress` naming this ingress replica. The API
    key, if any, comes in `$MINILLM_API_KEY` (see `build_application`); `buckets`, when given, is the
    `GatewayBuckets` that ingress replicas share."""

    def __init__(self, llm, model: str, model_name: str, max_waiting_requests: int | None, app_kw: dict,
                 max_model_len: int | None = None, buckets=None):
        listen_on_node_ip()
        require_model_dir(model)
        self.llm = RemoteLLM(llm, model, max_waiting_requests, max_model_len)
        self.model_name, self.app_kw, self.buckets = model_name, app_kw, buckets
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def process(self) -> tuple[str, int]:
        """This ingress replica's id and process id."""
        return self.replica_id, os.getpid()

    def __serve_build_asgi_app__(self):
        shared = None if self.buckets is None else (lambda name: SharedBuckets(self.buckets, name))
        app = build_app(self.llm, self.model_name, api_key=os.environ.get(API_KEY_ENV) or None,
                        shared_buckets=shared, **self.app_kw)
        app.add_middleware(IngressHeaders, ingress_id=self.replica_id)
        return app


def replica_resources(engine_args: EngineArgs, max_replicas: int) -> tuple[int, dict]:
    """Each replica's threads and Ray resources: the machine's cores (and GPUs) shared among the replicas, unless
    `num_threads` is given. Replicas sharing a GPU need their KV caches sized (each would take 85% of it)."""
    cores = available_cores()
    threads = engine_args.num_threads or max(1, cores // max_replicas)
    resources = {"num_cpus": min(threads, cores / max_replicas)}  # so that every replica fits on this machine
    if default_device_dtype(engine_args.device, None)[0].type == "cuda":
        resources["num_gpus"] = min(1.0, torch.cuda.device_count() / max_replicas)
        if resources["num_gpus"] < 1 and engine_args.num_kv_blocks is None:
            raise ValueError(f"{max_replicas} replicas would share {torch.cuda.device_count()} GPU(s): set "
                             "num_kv_blocks (--num-kv-blocks) so their KV caches fit side by side")
    return threads, resources


def build_application(engine_args: EngineArgs, replicas: int = 2, router: str | None = None,
                      router_options: dict | None = None, autoscaling: dict | None = None, model_name: str | None = None,
                      max_waiting_requests: int | None = 256, drain_seconds: float = DRAIN_S,
                      step_timeout_s: float | None = STEP_TIMEOUT_S, ingress_replicas: int = 1,
                      **app_kw) -> serve.Application:
    """The Serve application: `replicas` engines (or `autoscaling`, Serve's AutoscalingConfig fields, starting
    at `replicas`; `min_replicas` 0 lets Serve remove every replica of an idle service), routed by `router`
    (a name in `routers.ROUTERS`; None: Serve's default; `router_options`: its policy's keywords, such as the
    load guard's thresholds), behind the app; a replica whose step runs past
    `step_timeout_s` fails its health check. A replica that Serve removes (scaling down, a redeploy, a stop)
    first lets its requests in flight run for up to `drain_seconds` (Serve's graceful shutdown). `app_kw` goes
    to `build_app` (limits, api_key, allowed_origins, rate_limit); the API key goes to the ingress in its
    environment, not among the deployment's arguments, which Serve shows (`serve status`, the dashboard).
    `ingress_replicas`: processes running the ingress (tokenizing, SSE, routing); more than one share their
    rate limits' buckets through `GatewayBuckets`."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if not isinstance(ingress_replicas, int) or ingress_replicas < 1:
        raise ValueError(f"ingress_replicas must be a whole number of at least 1, got {ingress_replicas!r}")
    scales_to_zero = bool(autoscaling) and autoscaling.get("min_replicas", 1) < 1
    if scales_to_zero and engine_args.num_kv_blocks is None:
        raise ValueError("min_replicas 0 (scale to zero) needs num_kv_blocks (--num-kv-blocks): with no replica "
                         "up, the ingress computes the context length from it")
    path = resolve_model(engine_args.model)  # once, here, so every process loads the same directory
    max_replicas = autoscaling["max_replicas"] if autoscaling else replicas
    threads, resources = replica_resources(engine_args, max_replicas)
    options = dict(ray_actor_options=resources, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                   max_ongoing_requests=engine_args.max_num_seqs + (max_waiting_requests or engine_args.max_num_seqs),
                   graceful_shutdown_timeout_s=drain_seconds, graceful_shutdown_wait_loop_s=0.1,
                   logging_config={"log_level": QUIET})
    if autoscaling:
        options["autoscaling_config"] = {"initial_replicas": replicas, **autoscaling}
    else:
        options["num_replicas"] = replicas
    if router is not None:
        from .routers import request_router_config

        options["request_router_config"] = request_router_config(router, engine_args, router_options)
    elif router_options:
        raise ValueError("router_options need a router")
    max_model_len = (context_length(ModelConfig.from_dir(path), engine_args.num_kv_blocks, engine_args.block_size)
                     if scales_to_zero else None)  # otherwise learned from a replica
    llm = LLMServer.options(**options).bind(replace(engine_args, model=str(path), num_threads=threads),
                                            step_timeout_s)
    name = model_name or (path.name if engine_args.model else DEFAULT_MODEL)
    key = {"runtime_env": {"env_vars": {API_KEY_ENV: app_kw.pop("api_key", None) or ""}}}
    buckets = None
    if ingress_replicas > 1:
        limits = {"auth failures": app_kw.get("auth_failure_limit", AUTH_FAILURE_LIMIT)}
        if app_kw.get("rate_limit") is not None:
            limits["requests"] = app_kw["rate_limit"]
        buckets = GatewayBuckets.options(logging_config={"log_level": QUIET}).bind(limits)
    return OpenAIIngress.options(num_replicas=ingress_replicas, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
                                 ray_actor_options={"num_cpus": 0, **key},
                                 graceful_shutdown_timeout_s=drain_seconds, graceful_shutdown_wait_loop_s=0.1,
                                 logging_config={"log_level": QUIET}).bind(
        llm, str(path), name, max_waiting_requests, app_kw, max_model_len, buckets)


def deploy(app: serve.Application, timeout_s: float) -> None:
    """Deploy (or update) the application and wait until it runs; RuntimeError with Serve's reason if it fails
    to deploy (a replica's constructor kept failing), TimeoutError past `timeout_s`."""
    serve.run_many([serve.RunTarget(app, name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP_NAME)
        state = str(getattr(status.status, "value", status.status)) if status else "NOT_STARTED"
        if state == "RUNNING":
            return
        reasons = "; ".join(m for m in [status.message if status else ""]
                            + [d.message for d in (status.deployments.values() if status else ())] if m)
        if state == "DEPLOY_FAILED":
            raise RuntimeError(f"the service failed to start: {reasons}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service did not start within {timeout_s:g} s ({state}): {reasons}")
        time.sleep(0.5)


class RayService:
    """The service on Ray, started and stopped as one: `with RayService(EngineArgs(...), replicas=2) as svc:`.

    Without `ray_address`, a local Ray instance is started for it on 127.0.0.1 with this machine's cores;
    `url` is the base URL (`.../v1` for clients). Serve's proxy believes `X-Forwarded-For` only from
    `forwarded_allow_ips` (as `serve --forwarded-allow-ips`; default: none). Starting fails with Serve's
    reason if the application fails to deploy (a replica that cannot load the model, say), or after
    `start_timeout_s`. Stopping deletes the application and shuts Ray down, also when starting failed half
    way. Other keywords go to `build_application`.
    """

    def __init__(self, engine_args: EngineArgs | None = None, *, ray_address: str | None = None,
                 host: str = LOOPBACK, port: int = 0, forwarded_allow_ips: str | None = None,
                 start_timeout_s: float = START_S, **app_options):
        self.engine_args = engine_args or EngineArgs()
        self.start_timeout_s = start_timeout_s
        self.ray_address, self.host, self.port = ray_address, host, port
        self.forwarded_allow_ips = forwarded_allow_ips
        self.app_options = app_options
        self.url: str | None = None

    def start(self) -> RayService:
        app = build_application(self.engine_args, **self.app_options)  # a bad option fails before Ray starts
        try:
            start_ray(self.ray_address, available_cores())
            port = self.port or free_port(self.host)
            start_serve(self.host, port, self.forwarded_allow_ips)
            self.url = f"http://{self.host}:{port}"  # from here on, stop() deletes the application
            deploy(app, self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def redeploy(self, **app_options) -> RayService:
        """Replace the running application with one built from these options over the current ones (another
        `router`, say), on the same Ray instance and HTTP proxy: Serve starts replicas under the new options and
        retires the old ones; Ray and the proxy do not restart. Returns once the new replicas serve and the old
        ones have stopped (so that what runs next does not share the machine with them)."""
        self._check_running()
        options = {**self.app_options, **app_options}
        app = build_application(self.engine_args, **options)  # a bad option fails before anything changes
        deploy(app, self.start_timeout_s)
        self.app_options = options
        deadline = time.monotonic() + REDEPLOY_STOP_S
        while set(self.replica_states()) - {"RUNNING"}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"old replicas still not stopped {REDEPLOY_STOP_S} s after the redeploy: "
                                   f"{self.replica_states()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Delete the application (replicas drain for `drain_seconds`), then shut Ray down."""
        import ray

        try:
            if self.url is not None:
                serve.delete(APP_NAME)
        finally:
            self.url = None
            ray.shutdown()

    def replica_stats(self) -> list[dict]:
        """Every live replica's `LLMServer.stats()` (replica id, pid, KV cache, queues); dead ones are left out."""
        self._check_running()
        handle = serve.get_deployment_handle(LLMServer.name, APP_NAME)
        with ThreadPoolExecutor(1) as pool:  # a notebook's cell runs inside an event loop, where Serve will not block
            results = pool.submit(lambda: handle.broadcast("stats").results(timeout_s=30, return_exceptions=True))
            return [r for r in results.result() if isinstance(r, dict)]

    def replica_states(self) -> dict[str, int]:
        """How many engine replicas are in each of Serve's states now (STARTING, RUNNING, STOPPING, ...; none: {})."""
        self._check_running()
        deployment = serve.status().applications[APP_NAME].deployments[LLMServer.name]
        return {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items() if n}

    def _check_running(self) -> None:
        if self.url is None:  # Serve would start a fresh Ray instance to look for the application
            raise RuntimeError("the service is not running: start() it first")

    def ingress_pids(self) -> dict[str, int]:
        """Each live ingress replica's process id, by its replica id (what `x-minillm-ingress` names)."""
        self._check_running()
        handle = serve.get_deployment_handle(OpenAIIngress.name, APP_NAME)
        with ThreadPoolExecutor(1) as pool:  # as `replica_stats`: Serve will not block inside an event loop
            results = pool.submit(lambda: handle.broadcast("process").results(timeout_s=30, return_exceptions=True))
            return dict(r for r in results.result() if isinstance(r, tuple))

    def kill_replica(self, replica_id: str | None = None) -> dict:
        """Kill one replica's process (SIGKILL, as a crash would), by id or the first found; returns its stats.
        Serve starts a replacement. Local instances only: the pid is this machine's."""
        stats = [s for s in self.replica_stats() if replica_id in (None, s["replica_id"])]
        if not stats:
            raise ValueError(f"no replica {replica_id!r}")
        os.kill(stats[0]["pid"], signal.SIGKILL)
        return stats[0]

    def __enter__(self) -> RayService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_on_ray(args, autoscaling: dict | None, app_kw: dict) -> int:
    """`python -m minillm serve --replicas N ...`: run the service until SIGINT/SIGTERM, then stop it; exit 0.
    `autoscaling`: Serve's autoscaling fields (launch.py's flags); `app_kw` goes to `build_app`."""
    name = args.served_model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    service = RayService(EngineArgs.from_cli_args(args), ray_address=args.ray_address, host=args.host,
                         port=args.port, forwarded_allow_ips=args.forwarded_allow_ips,
                         replicas=args.replicas, router=args.router,
                         autoscaling=autoscaling, model_name=name,
                         max_waiting_requests=args.max_waiting_requests, drain_seconds=args.drain_seconds,
                         step_timeout_s=args.step_timeout or None, ingress_replicas=args.ingress_replicas, **app_kw)
    try:
        service.start()
    except KeyboardInterrupt:  # Ctrl-C while the replicas load: start() has already stopped what it began
        return 0
    except (RuntimeError, TimeoutError) as e:  # the application did not start: Serve's reason, not a traceback
        print(f"minillm: {e}", file=sys.stderr, flush=True)
        return 1
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets a SIGTERM handler of its own
        signal.signal(sig, lambda *_: stopping.set())
    scaling = (f"{args.replicas} replicas" if not args.max_replicas
               else f"{args.replicas} replicas (autoscaled up to {args.max_replicas})")
    if args.ingress_replicas > 1:
        scaling += f" behind {args.ingress_replicas} ingress replicas"
    print(f"minillm: serving {name} at {service.url}/v1 with {scaling} on Ray Serve "
          f"(router: {args.router or 'power of two choices'}); Ctrl-C to stop", flush=True)
    try:
        stopping.wait()
    finally:
        service.stop()
    print("minillm: stopped", file=sys.stderr, flush=True)
    return 0
