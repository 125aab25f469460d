"""Starting chapter 9's service as on a cluster, on a tiny model: the API key reaches the ingress in its environment,
never among the deployment's arguments (which Serve shows to anyone who can read its status); a model directory
missing where a replica runs fails the start with an error naming the directory and the node, within the start
deadline, and leaves no Ray process behind."""

import shutil
import time

import pytest

from minillm.engine_args import EngineArgs
from minillm.serving.launch import API_KEY_ENV
from tiny_models import build_tiny_model

ray_app = pytest.importorskip("minillm.service.ray_app", reason="ray[serve] is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Serve's own pydantic fields


def test_the_api_key_goes_to_the_ingress_in_its_environment(tiny_llama):
    app = ray_app.build_application(EngineArgs(model=str(tiny_llama), device="cpu", dtype="float32"), replicas=1,
                                    api_key="sekret-7f3a")
    ingress = app._bound_deployment
    assert "sekret-7f3a" not in repr((ingress.init_args, ingress.init_kwargs))
    assert ingress.ray_actor_options["runtime_env"]["env_vars"][API_KEY_ENV] == "sekret-7f3a"


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray instance at a time on this machine
def test_a_model_missing_on_a_node_fails_the_start_with_its_path(tmp_path, monkeypatch):
    """The model is found where the service starts, then gone by the time the replicas load it, as on a node of a
    cluster that lacks it."""
    model = build_tiny_model(tmp_path / "model")
    start_ray = ray_app.start_ray

    def start_ray_then_lose_the_model(*args):
        shutil.rmtree(model)
        start_ray(*args)

    monkeypatch.setattr(ray_app, "start_ray", start_ray_then_lose_the_model)
    service = ray_app.RayService(EngineArgs(model=str(model), device="cpu", dtype="float32", num_kv_blocks=32),
                                 replicas=1, start_timeout_s=120)
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError), match=f"model directory {model} not found on node 127.0.0.1"):
        service.start()
    assert time.monotonic() - start < 130
    assert service.url is None  # stopped: Ray shut down
