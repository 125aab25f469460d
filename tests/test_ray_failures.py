"""Chapter 9's service on Ray Serve when replicas go away, on a tiny model: requests held by a replica whose
engine failed, or that was killed, before any output reached their client are sent to the other replica and
all succeed (counted in `request_retries_total`); the failed replica leaves at once rather than attract
requests it would fail; a replica removed by scaling down first lets its streams finish. The service
requires an API key, which reaches its ingress in the environment. One service serves the module (it takes
seconds to start); the tests run in order."""

import functools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from minillm.engine_args import EngineArgs
from serving_utils import scrape, sse_events, wait_for
from tiny_models import build_tiny_model

ray_app = pytest.importorskip("minillm.service.ray_app", reason="ray[serve] is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray instance at a time on this machine
BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 300, "ignore_eos": True}
KEY = "sk-failures"
POISON = [7] * 8  # a prompt starting so makes the first engine step that runs it raise, once in the whole service
RECOVERY_S = 120  # a replica's restart: a new process imports torch and loads the model


def poisoned_engines(marker: str):
    """A setup hook for every Ray worker: the engine that first takes a `POISON` prompt (the one to create
    `marker`) fails its next step, as a bug would."""
    def hook():
        from minillm.engine import LLMEngine

        add_request, step = LLMEngine.add_request, LLMEngine.step

        def poisoned_add_request(self, request_id, prompt, *args, **kw):
            if isinstance(prompt, list) and prompt[:len(POISON)] == POISON and not os.path.exists(marker):
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                self.poisoned = True
            return add_request(self, request_id, prompt, *args, **kw)

        def poisoned_step(self):
            if getattr(self, "poisoned", False):
                raise RuntimeError("a poisoned step")
            return step(self)
        LLMEngine.add_request, LLMEngine.step = poisoned_add_request, poisoned_step
    return hook


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Two replicas in turn, one sequence running at a time on each (the others wait), one thread each (so that
    a change of the replica count alone leaves the replicas' options as they are); engines that a `POISON`
    prompt fails."""
    model = build_tiny_model(tmp_path_factory.mktemp("ray-model"), hidden_size=256, intermediate_size=512,
                             num_hidden_layers=6, max_position_embeddings=1024)
    args = EngineArgs(model=str(model), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=1,
                      num_threads=1)
    hook = poisoned_engines(str(tmp_path_factory.mktemp("poison") / "taken"))
    svc = ray_app.RayService(args, replicas=2, router="round_robin", model_name="tiny", api_key=KEY)
    with pytest.MonkeyPatch.context() as patch:  # the local Ray instance, started with the hook for its workers
        patch.setattr(ray, "init", functools.partial(ray.init, runtime_env={"worker_process_setup_hook": hook}))
        svc.start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def http(service):
    with httpx.Client(base_url=service.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_the_api_key_reached_the_ingress(service, http):
    assert httpx.get(service.url + "/v1/models", timeout=30).status_code == 401
    assert http.get("/v1/models").status_code == 200


def test_requests_a_failed_engine_held_are_retried_and_its_replica_leaves(service, http):
    poisoned = {**BODY, "prompt": POISON + [20, 21], "max_tokens": 50}
    with ThreadPoolExecutor(4) as pool:  # two per replica: the poisoned one first, so its replica holds another
        responses = list(pool.map(lambda _: http.post("/v1/completions", json=poisoned), range(4)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert len({r.headers["x-minillm-replica"] for r in responses}) == 1  # all served by the healthy replica
    assert scrape(http)["request_retries_total"] >= 1
    wait_for(lambda: service.replica_states().get("RUNNING") == 1, 10, "the failed replica to leave")
    short = {**BODY, "max_tokens": 4}
    assert [http.post("/v1/completions", json=short).status_code for _ in range(4)] == [200] * 4
    wait_for(lambda: len(service.replica_stats()) == 2, RECOVERY_S, "Serve to replace the replica")


def test_requests_a_killed_replica_held_are_retried_on_the_other(service, http):
    retries = scrape(http)["request_retries_total"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=BODY) for _ in range(4)]  # two per replica
        stats = wait_for(lambda: (s := service.replica_stats()) and sum(r["num_unfinished"] for r in s) == 4 and s,
                         60, "four requests on the replicas")
        victim = next(s for s in stats if s["num_unfinished"] == 2)
        service.kill_replica(victim["replica_id"])  # one running, one waiting there: no output sent to a client
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert {r.json()["choices"][0]["finish_reason"] for r in responses} == {"length"}
    assert victim["replica_id"] not in {r.headers["x-minillm-replica"] for r in responses}
    assert scrape(http)["request_retries_total"] >= retries + 2
    wait_for(lambda: len(service.replica_stats()) == 2, RECOVERY_S, "Serve to restart the replica")


def test_a_replica_removed_by_scaling_down_lets_its_stream_finish(service, http):
    streams: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def read(i: int) -> None:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 600, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streams[i].append(line[len("data: "):])
                    started[i].set()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]  # one on each replica
    for t in readers:
        t.start()
    try:
        assert all(e.wait(60) for e in started)
        start = time.monotonic()
        service.redeploy(replicas=1)  # returns once the removed replica has stopped
        stopped_after = time.monotonic() - start
    finally:
        for t in readers:
            t.join(120)
    for events in streams:
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) > 100
    assert stopped_after > 1  # it waited for the stream, not cut it
    assert service.replica_states() == {"RUNNING": 1}
