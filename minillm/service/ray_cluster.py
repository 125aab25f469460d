"""Chapter 9 — the Ray instance under the replicas: one started on this machine (loopback only, quiet), or joined.

A local instance is a handful of processes (the GCS, a raylet, an object store, Serve's controller and HTTP
proxy, one worker per replica) that talk over TCP. A textbook's server must not open them to the network,
so the instance minillm starts binds every one to 127.0.0.1: `_node_ip_address`, no dashboard, and
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray then keeps to 127.0.0.1 and never probes a public DNS address to
find its interface). Ray 2.60 also turns on token authentication for a local instance (the token is kept in
~/.ray/auth_token). Joining an existing cluster (`--ray-address`) is the user's explicit choice, and its
addresses are the cluster's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 96 << 20  # outputs are small; Ray wants at least 75 MiB
QUIET = "ERROR"


def start_ray(address: str | None, num_cpus: int) -> None:
    """Start a local instance with `num_cpus` logical CPUs on 127.0.0.1 (address None), or connect to `address`.

    A local instance, or a cluster joined at a loopback address, keeps this process on loopback for good (Ray's
    address setting is process-wide), so join a cluster elsewhere from a fresh process.
    """
    import ray

    if address is None or address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        keep_to_loopback()
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES,
                 include_dashboard=False, _node_ip_address=LOOPBACK, log_to_driver=False, logging_level=logging.ERROR)
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    logging.getLogger("ray.serve").setLevel(QUIET)


def keep_to_loopback() -> None:
    """Make Ray take 127.0.0.1 as this machine's address (otherwise it rewrites 127.0.0.1 to the address of the
    interface that reaches the internet), in this process and in every Ray process it starts; no usage stats."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by each Ray process when it imports ray,
    ray_constants.ENABLE_RAY_CLUSTER = False  # and this one may have imported it already
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def start_serve(host: str, port: int, forwarded_allow_ips: str | None = None) -> None:
    """Serve's HTTP proxy on `host:port` (one proxy, on the head node), its gRPC proxy off, its logs quiet.

    The proxy is uvicorn with its defaults, which believe `X-Forwarded-For` from 127.0.0.1: any local client
    could name its own address, and with it its rate-limit bucket. uvicorn reads the proxies it believes from
    `FORWARDED_ALLOW_IPS`, and the proxy actor inherits its environment from Serve's controller, so the
    controller is started with `forwarded_allow_ips` there (empty: none). Serve applies this when it starts
    its controller, not to one already running on a joined cluster.
    """
    from ray import serve

    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port},
                grpc_options={"grpc_servicer_functions": []}, logging_config={"log_level": QUIET},
                controller_options={"runtime_env": {"env_vars": {"FORWARDED_ALLOW_IPS": forwarded_allow_ips or ""}}})


def listen_on_node_ip() -> None:
    """Make this replica's inter-deployment gRPC server listen on the node's address rather than on every one.

    Ray Serve 2.60 starts that server in each replica on `[::]:0`, every interface, and has no setting for its
    address (it is written in the code; ray-project/ray#64544 asks for one for its port). A replica calls this
    in its constructor, which runs before the server starts. On a local instance the node's address is 127.0.0.1.
    """
    import ray
    from ray.serve._private import replica

    add_port, node_ip = replica.add_port_to_grpc_server, ray.util.get_node_ip_address()

    def add_port_on_node_ip(server, address: str) -> int:
        return add_port(server, address.replace("[::]", f"[{node_ip}]" if ":" in node_ip else node_ip))

    replica.add_port_to_grpc_server = add_port_on_node_ip


def require_model_dir(path: str) -> None:
    """FileNotFoundError naming this node unless the model directory `path` is here. On a cluster joined with
    `--ray-address`, the ingress and every replica read the model from the path resolved where the service
    was started, whichever node they run on."""
    if not Path(path).is_dir():
        import ray

        raise FileNotFoundError(f"model directory {path} not found on node {ray.util.get_node_ip_address()}: "
                                "every node of the Ray cluster needs the model at this path (copy it there, or "
                                "use storage the nodes share)")
