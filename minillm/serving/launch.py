"""Chapter 8 — running the server: `python -m minillm serve` in the foreground, or `ServerThread` in the background.

Shutting down is the same in both: new requests are refused (503), requests in flight get `drain_seconds`
to finish, whatever is left is aborted (each open stream still ends with a final chunk and `[DONE]`),
and only then does uvicorn close its connections. SIGINT or SIGTERM starts it; a second one forces exit.
If an engine step fails, every request in flight gets a 500 (or an error event), and the server stops the
same way with exit status 1, so a supervisor restarts it (as vLLM does).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import time

import uvicorn

from ..engine_args import EngineArgs
from ..weights import DEFAULT_MODEL
from .api_server import BODY_TIMEOUT_S, build_app
from .async_llm import STEP_TIMEOUT_S, AsyncLLM
from ..service.gateway import AUTH_FAILURE_LIMIT, RateLimit
from .limits import ServerLimits
from .middleware import api_keys, bind_hosts, host_patterns

API_KEY_ENV = "MINILLM_API_KEY"  # the API keys (comma-separated) when --api-key is not given
LIMIT_CONCURRENCY = 1024  # connections, or requests in progress, beyond which uvicorn answers 503
TIMEOUT_KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
MAX_HEADER_BYTES = 16 << 10  # request line and headers still unfinished past this are refused (400; h11's default)
AUTOSCALING_FLAGS = (  # Serve's autoscaling_config, one flag per field
    ("--min-replicas", int, "autoscaling: fewest replicas (default: 1); 0 scales to zero when idle "
                      "and needs --num-kv-blocks"),
    ("--max-replicas", int, "autoscale between --min-replicas and this many replicas, starting at --replicas"),
    ("--target-ongoing-requests", float, "autoscaling: requests in flight per replica to aim at (default: Serve's, 2)"),
    ("--upscale-delay-s", float, "autoscaling: seconds of high load before adding a replica (default: Serve's, 30)"),
    ("--downscale-delay-s", float, "autoscaling: seconds of low load before removing one (default: Serve's, 600)"),
)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), so clients can connect as soon as its address is known."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


async def shutdown(server: uvicorn.Server, llm: AsyncLLM, drain_seconds: float) -> None:
    """Refuse new requests, let those in flight finish for up to `drain_seconds`, abort the rest, then exit."""
    llm.stop_accepting()
    deadline = time.monotonic() + drain_seconds
    while llm.num_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    llm.abort_all()
    deadline = time.monotonic() + 5
    while llm.open_streams and time.monotonic() < deadline:  # let each stream send its last chunk and [DONE]
        await asyncio.sleep(0.01)
    server.should_exit = True


def uvicorn_config(app, forwarded_allow_ips: str | None, limit_concurrency: int | None = LIMIT_CONCURRENCY,
                   timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE_S, max_header_bytes: int = MAX_HEADER_BYTES,
                   **kw) -> uvicorn.Config:
    """uvicorn's settings for the app (`kw`), believing `X-Forwarded-For` and `-Proto` only from the proxies at
    `forwarded_allow_ips`: uvicorn's default trusts 127.0.0.1, so any local client could name its own address,
    and with it its rate-limit bucket. Connections are bounded: `limit_concurrency` (a 503 beyond),
    `timeout_keep_alive` seconds idle, `max_header_bytes` of request line and headers not yet complete (a cap
    of h11's parser, which uvicorn sets; of httptools', the default where installed, it sets none)."""
    return uvicorn.Config(app, proxy_headers=bool(forwarded_allow_ips),
                          forwarded_allow_ips=forwarded_allow_ips or None, limit_concurrency=limit_concurrency,
                          timeout_keep_alive=timeout_keep_alive, http="h11",
                          h11_max_incomplete_event_size=max_header_bytes, **kw)


class _Server(uvicorn.Server):
    """uvicorn, with a first SIGINT/SIGTERM that drains instead of cutting streams, and an engine failure that
    stops it too; `exit_code` is 1 after a failure, else 0."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, drain_seconds: float):
        super().__init__(config)
        self.llm, self.drain_seconds, self.draining = llm, drain_seconds, False
        llm.failure_listeners.append(self._engine_failed)

    @property
    def exit_code(self) -> int:
        return 0 if self.llm.error is None else 1

    def _engine_failed(self, error: BaseException) -> None:
        """On the event loop, once every reader has its error: stop taking requests and exit."""
        self.draining = True
        asyncio.ensure_future(shutdown(self, self.llm, 0))

    def handle_exit(self, sig, frame) -> None:
        if self.draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.llm.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(
            shutdown(self, self.llm, self.drain_seconds)))


class ServerThread:
    """The app served by uvicorn in a background thread on 127.0.0.1 and a free port (tests, notebooks).

    Use as a context manager, or call `start()` and `stop()`; `url` is the base URL (`.../v1` for clients).
    If the engine fails, the server stops by itself and `failed` is true (`exit_code` 1, as `serve` exits).
    `forwarded_allow_ips`: as `serve --forwarded-allow-ips` (default: no proxy is believed). `connection_kw`:
    `uvicorn_config`'s connection bounds (limit_concurrency, timeout_keep_alive, max_header_bytes).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 0.0,
                 forwarded_allow_ips: str | None = None, **connection_kw):
        self.llm: AsyncLLM = app.state.served.llm
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.drain_seconds = drain_seconds
        config = uvicorn_config(app, forwarded_allow_ips, log_level="error", access_log=False, lifespan="on",
                                **connection_kw)
        self.server = _Server(config, self.llm, drain_seconds)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="minillm-server")

    def start(self, timeout: float = 120) -> ServerThread:
        if self.thread.is_alive():
            return self
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60) -> None:
        """Drain and stop (see `shutdown`); the thread is joined."""
        if self.thread.is_alive() and self.server.started:
            future = asyncio.run_coroutine_threadsafe(shutdown(self.server, self.llm, self.drain_seconds),
                                                      self.llm.loop)
            future.result(timeout)
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    @property
    def failed(self) -> bool:
        return self.server.exit_code != 0

    @property
    def exit_code(self) -> int:
        return self.server.exit_code

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences allowed to wait; beyond this a request gets 429 with Retry-After")
    parser.add_argument("--drain-seconds", type=float, default=5.0,
                        help="on SIGINT/SIGTERM, how long requests in flight may run before they are aborted; "
                             "on Ray Serve also when a replica is removed (scaling down, a stop)")
    parser.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S, metavar="SECONDS",
                        help="an engine step running this long is taken for hung: /health answers 503 and new "
                             "requests are refused (on Ray the replica is restarted) until it returns; 0: never "
                             f"(default: {STEP_TIMEOUT_S:g})")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require `Authorization: Bearer <key>` on every route but /health, /metrics and "
                             f"/version; prefer ${API_KEY_ENV}: a flag shows in the process list (ps), an "
                             f"environment variable does not (default: ${API_KEY_ENV}, else no key). Several "
                             "keys (the flag repeated, or comma-separated) are one per client: each key gets its "
                             "own rate-limit bucket. An address that fails the key "
                             f"{AUTH_FAILURE_LIMIT.capacity} times gets a 429 until it may try again, once every "
                             f"{1 / AUTH_FAILURE_LIMIT.requests_per_second:g} s")
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="the Host header names answered, any port (against DNS rebinding: a web page whose "
                             "name points at this machine), e.g. llm.example.com or *.example.com, or * for any; "
                             "default: the --host bound: for a loopback one 127.0.0.1, localhost and ::1, for "
                             "0.0.0.0 or :: any host")
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="web pages from these origins may call the API (CORS), e.g. http://localhost:3000 "
                             "or *; default: none")
    parser.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                        help="comma-separated addresses or networks (or *) of the proxies whose X-Forwarded-For "
                             "names the client (its rate-limit bucket, the access log), here or at Ray Serve's "
                             "proxy; default: none, every client is the address it connects from")
    parser.add_argument("--rate-limit", type=float, default=None, metavar="RPS",
                        help="requests per second each client may send (its address, or its API key when "
                             "several are given); "
                             "beyond it a 429 with Retry-After; default: no limit")
    parser.add_argument("--rate-limit-burst", type=int, default=None, metavar="N",
                        help="requests a client may send at once before --rate-limit applies (default: RPS)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve /tokenizer_info (the tokenizer's settings and chat template); default: a 404")
    conn = parser.add_argument_group("connections", "bounds on what one client's connections may hold (the "
                                                     "one-engine server; Ray Serve's proxy keeps its own)")
    conn.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY, metavar="N",
                      help="open connections, or requests in progress, beyond which uvicorn answers 503 "
                           f"(default: {LIMIT_CONCURRENCY})")
    conn.add_argument("--timeout-keep-alive", type=float, default=TIMEOUT_KEEP_ALIVE_S, metavar="S",
                      help=f"seconds an idle keep-alive connection stays open (default: {TIMEOUT_KEEP_ALIVE_S})")
    conn.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES, metavar="BYTES",
                      help="a request line and headers still unfinished past this many bytes are refused with "
                           f"a 400 (uvicorn's h11_max_incomplete_event_size; default: {MAX_HEADER_BYTES})")
    conn.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                      help="seconds a request body may take to arrive; a client still sending it then gets a 408 "
                           f"(default: {BODY_TIMEOUT_S:g})")
    scale = parser.add_argument_group("replicas", "chapter 9: several engines behind one endpoint, on Ray Serve")
    scale.add_argument("--replicas", type=int, default=1,
                       help="engine replicas, one process each; more than 1 serves them on Ray Serve, on a local "
                            "Ray instance that listens on 127.0.0.1 only (default: 1, chapter 8's server)")
    scale.add_argument("--router", default=None,
                       help="how a request picks its replica: round_robin, least_loaded, prefix or session "
                            "(default: Serve's, power of two choices)")
    scale.add_argument("--ingress-replicas", type=int, default=1, metavar="N",
                       help="processes running the ingress (tokenizing, SSE encoding, routing) on Ray Serve; "
                            "more than 1 keep the rate limits in one shared store (default: 1)")
    scale.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="join this Ray cluster (auto, or HOST:PORT) instead of starting a local instance; "
                            "with token authentication (Ray's default) set RAY_AUTH_MODE=token and its token")
    for flag, kind, text in AUTOSCALING_FLAGS:
        scale.add_argument(flag, type=kind, default=None, help=text)
    scale.add_argument("--pd", type=pd_counts, default=None, metavar="P:D",
                       help="prefill/decode disaggregation: P prefill and D decode engines, one process each, "
                            "behind this one server (e.g. 1:1); threads are split evenly among them; without Ray")
    ServerLimits.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def pd_counts(text: str) -> tuple[int, int]:
    """`--pd`'s "P:D": how many prefill and decode instances."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"--pd takes P:D, two whole numbers of at least 1 (e.g. 1:1), got {text!r}")
    return int(parts[0]), int(parts[1])


def autoscaling_from_cli(args: argparse.Namespace) -> dict | None:
    """Serve's autoscaling fields from `--max-replicas` and the flags beside it; None without `--max-replicas`."""
    names = [flag[2:].replace("-", "_") for flag, _, _ in AUTOSCALING_FLAGS]
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if given and "max_replicas" not in given:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in given)}: autoscaling needs --max-replicas")
    return given or None


def app_options(args: argparse.Namespace) -> dict:
    """`build_app`'s keywords from the command line (the API key from $MINILLM_API_KEY unless `--api-key` is
    given), each checked before the model loads."""
    limits = ServerLimits.from_cli_args(args)
    if args.rate_limit_burst is not None and args.rate_limit is None:
        raise ValueError("--rate-limit-burst needs --rate-limit")
    rate_limit = RateLimit(args.rate_limit, args.rate_limit_burst) if args.rate_limit is not None else None
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be a positive number of seconds, got {args.body_timeout}")
    api_key = ",".join(args.api_key) if args.api_key else os.environ.get(API_KEY_ENV)
    if api_key:
        api_keys(api_key)  # refuses a value that holds no key (",")
    allowed_hosts = args.allowed_hosts or bind_hosts(args.host)
    host_patterns(allowed_hosts)
    return dict(limits=limits, api_key=api_key, allowed_origins=args.allowed_origins, rate_limit=rate_limit,
                allowed_hosts=allowed_hosts, body_timeout_s=args.body_timeout,
                enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)


def connection_options(args: argparse.Namespace) -> dict:
    """`uvicorn_config`'s connection bounds from the command line, checked before the model loads."""
    for flag, value in (("--limit-concurrency", args.limit_concurrency), ("--max-header-bytes", args.max_header_bytes),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    return dict(limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive,
                max_header_bytes=args.max_header_bytes)


def serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, drain; exit 0, or 1 if the engine failed. With more than one
    replica (or `--ray-address`, or autoscaling), chapter 9's service on Ray Serve instead (`ray_app`)."""
    import torch

    from ..engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app_kw, connection_kw = app_options(args), connection_options(args)
    autoscaling = autoscaling_from_cli(args)
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.ingress_replicas < 1:
        raise ValueError(f"--ingress-replicas must be at least 1, got {args.ingress_replicas}")
    on_ray = (args.replicas > 1 or args.ingress_replicas > 1 or args.ray_address is not None
              or autoscaling is not None)
    if on_ray and args.pd is not None:
        raise ValueError("--pd serves one pool of prefill and decode processes on this machine, without Ray: drop "
                         "--replicas, --ingress-replicas, --ray-address and the autoscaling flags")
    if on_ray:
        from ..service.ray_app import serve_on_ray

        return serve_on_ray(args, autoscaling, app_kw)
    if args.router is not None:
        raise ValueError("--router chooses among replicas: give --replicas N with N > 1")
    engine_args = EngineArgs.from_cli_args(args)
    if args.pd is not None:
        from ..disagg import PDPair

        engine = PDPair(engine_args, num_prefill=args.pd[0], num_decode=args.pd[1])
        layout = f"{args.pd[0]} prefill + {args.pd[1]} decode instances"
    else:
        engine = LLMEngine(engine_args)
        layout = f"{torch.get_num_threads()} threads"
    name = args.served_model_name or (engine.path.name if args.model else DEFAULT_MODEL)
    llm = AsyncLLM(engine, max_waiting_requests=args.max_waiting_requests, step_timeout_s=args.step_timeout or None)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        print(f"minillm: serving {name} at http://{host}:{port}/v1 on {engine.stats()['device']} ({layout}); "
              "Ctrl-C to stop", flush=True)

    app = build_app(llm, name, on_started=ready, **app_kw)
    config = uvicorn_config(app, args.forwarded_allow_ips, log_level=args.log_level,
                            access_log=args.log_level in ("debug", "info"), **connection_kw)
    server = _Server(config, llm, args.drain_seconds)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    print("minillm: stopped" if server.exit_code == 0 else "minillm: stopped after the engine failed (see above)",
          file=sys.stderr, flush=True)
    return server.exit_code
