"""Chapter 9's service on Ray Serve, on a tiny model: two engine replicas behind chapter 8's app. The official
`openai` client gets what `LLM.generate` computes; every response names its replica and round robin uses
both; the gateway's rate limit answers 429, and Serve's proxy does not let a local client name another address
in `X-Forwarded-For` to escape it; a client that leaves aborts its request on the replica; nothing
listens beyond loopback; a replica killed mid-stream ends its stream with an error event (never a hang), the
service answers 503 while no replica is up and serves again once Serve has restarted them; stopping leaves
no Ray process behind. One service serves the module (it takes seconds to start); the tests run in order."""

import json
import shutil
import subprocess
import time

import httpx
import openai
import psutil
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from minillm import LLM, SamplingParams
from minillm.engine_args import EngineArgs
from minillm.service.gateway import RateLimit
from serving_utils import wait_for, wait_idle
from tiny_models import build_tiny_model

ray_app = pytest.importorskip("minillm.service.ray_app", reason="ray[serve] is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one service per module: keep it on one worker
MODEL = "tiny"
QUESTION = [{"role": "user", "content": "Prefill builds the cache."}]
PROMPT = "The quick brown fox"
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}  # seconds long
LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")
RECOVERY_S = 120  # a replica's restart: a new process imports torch and loads the model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny_llama, made wider and deeper: it decodes 200 tokens faster than a stats round trip, this one takes
    seconds for a long stream, so a test can act in the middle of one."""
    return build_tiny_model(tmp_path_factory.mktemp("ray-model"), hidden_size=256, intermediate_size=512,
                            num_hidden_layers=6, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def service(model):
    svc = ray_app.RayService(EngineArgs(model=str(model), device="cpu", dtype="float32", num_kv_blocks=64),
                             replicas=2, router="round_robin", model_name=MODEL,
                             rate_limit=RateLimit(requests_per_second=1, burst=20))
    with svc:
        yield svc


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", dtype=torch.float32, num_kv_blocks=64)


@pytest.fixture
def http(service):
    with httpx.Client(base_url=service.url, timeout=30) as c:
        yield c


def test_the_openai_client_gets_llm_generate_s_text_from_both_replicas(service, llm):
    want_chat = llm.chat(QUESTION, SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0].text
    want_text = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    replicas = []
    with openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                                   temperature=0, stream=True)
            replicas.append(raw.headers["x-minillm-replica"])
            chunks = [ChatCompletionChunk.model_validate(c.model_dump()) for c in raw.parse()]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                              temperature=0, stream=True,
                                                              extra_body={"ignore_eos": True})
            replicas.append(raw.headers["x-minillm-replica"])
            assert "".join(c.choices[0].text for c in raw.parse() if c.choices) == want_text
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                              temperature=0, extra_body={"ignore_eos": True})
            replicas.append(raw.headers["x-minillm-replica"])
            assert len(raw.headers.get_list("x-request-id")) == 1  # Serve's proxy adds it; the app's is dropped
            assert Completion.model_validate(raw.parse().model_dump()).choices[0].text == want_text
    ids = {s["replica_id"] for s in service.replica_stats()}
    assert len(ids) == 2 and set(replicas) == ids
    assert all(a != b for a, b in zip(replicas, replicas[1:])), replicas  # round robin: each in turn


def test_the_gateway_limits_each_client_with_a_429(service):
    """Another loopback address is another client: its bucket (burst 20, 1 per second) runs dry on its own."""
    with httpx.Client(base_url=service.url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2")) as c:
        responses = [c.get("/v1/models") for _ in range(26)]
    codes = [r.status_code for r in responses]
    assert codes[:20] == [200] * 20 and 429 in codes[20:], codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert httpx.get(service.url + "/v1/models", timeout=30).status_code == 200  # 127.0.0.1 has its own bucket


def test_a_client_that_leaves_mid_stream_frees_the_replica_s_blocks(service, http):
    with http.stream("POST", "/v1/completions", json=LONG) as r:
        lines = r.iter_lines()  # held, so the connection stays open until the block ends
        next(line for line in lines if line.startswith("data: "))
        assert sum(s["num_unfinished"] for s in service.replica_stats()) == 1  # one token in, many to go
    wait_for(lambda: all(s["num_unfinished"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                         for s in service.replica_stats()), 10, "the replica to abort the request")
    metrics = wait_idle(http)  # the replicas' stats, summed at the ingress
    assert metrics['request_success_total{finished_reason="abort"}'] == 1


def ours() -> list[psutil.Process]:
    """This process and every process it started (the local Ray instance: GCS, raylet, workers, agents)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def test_nothing_listens_beyond_loopback(service):
    if shutil.which("ss") is None:
        pytest.skip("`ss` (iproute2) is not installed")
    pids = {p.pid for p in ours()}
    listeners = []
    for line in subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        fields = line.split()
        owners = {int(part.split(",")[0]) for part in line.split("pid=")[1:]}
        if owners & pids:
            listeners.append((fields[3].rsplit(":", 1)[0], line))
    assert len(listeners) >= 8, listeners  # the GCS, the raylet, the proxy, the replicas, ...
    assert service.url.startswith("http://127.0.0.1:")
    assert [line for address, line in listeners if address not in LOOPBACK] == []


def test_a_killed_replica_ends_its_stream_with_an_error_and_the_service_recovers(service, http):
    before = {s["replica_id"] for s in service.replica_stats()}
    start = time.monotonic()
    with http.stream("POST", "/v1/completions", json=LONG) as r:
        assert r.status_code == 200
        victim = r.headers["x-minillm-replica"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # output reached the client: too late to retry
        assert service.kill_replica(victim)["replica_id"] == victim  # SIGKILL, as a crash: no goodbye to Serve
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]  # within the 30 s timeout
    assert time.monotonic() - start < 30
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["type"] == "service_unavailable", events[-3:]
    (survivor,) = before - {victim}
    short = {**LONG, "stream": False, "max_tokens": 4}
    done = http.post("/v1/completions", json=short)
    assert done.status_code == 200 and done.headers["x-minillm-replica"] == survivor

    service.kill_replica(survivor)  # now no replica is left until Serve restarts them
    wait_for(lambda: http.get("/health").status_code == 503, 30, "the ingress to notice")
    refused = http.post("/v1/completions", json=short)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"

    wait_for(lambda: http.get("/health").status_code == 200, RECOVERY_S, "Serve to restart a replica")
    again = http.post("/v1/completions", json=short)
    assert again.status_code == 200 and again.headers["x-minillm-replica"] not in before
    wait_for(lambda: len(service.replica_stats()) == 2, RECOVERY_S, "both replicas back")


def test_a_forwarded_address_does_not_make_another_client(service):
    """Serve's proxy is uvicorn, which believes X-Forwarded-For from 127.0.0.1 by default; without
    `forwarded_allow_ips` it believes no one, so claimed addresses share the sender's bucket (run last: it
    empties 127.0.0.1's)."""
    codes = [httpx.get(service.url + "/v1/models", headers={"X-Forwarded-For": f"10.0.0.{i}"}, timeout=30).status_code
             for i in range(26)]
    assert 429 in codes, codes


def test_stopping_leaves_no_ray_process(service):
    ray_processes = [p for p in ours() if p.name() in ("raylet", "gcs_server")]
    assert len(ray_processes) == 2
    service.stop()
    gone, alive = psutil.wait_procs(ray_processes, timeout=15)
    assert alive == []
    left = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True).stdout.split()
    assert not {p.pid for p in ray_processes} & {int(pid) for pid in left}
    with pytest.raises(RuntimeError, match="not running"):
        service.replica_stats()  # rather than start a Ray instance of its own to look for the application
