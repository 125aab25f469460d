"""Chapter 9's service scaled to zero, on a tiny model: with `min_replicas` 0 an idle service keeps no replica,
a streamed request that arrives then still gets `LLM.generate`'s greedy text (Serve starts a replica for it,
and the request waits for it, its response's headers sent meanwhile rather than no byte), and the service
empties again once it is idle."""

import json
import time

import httpx
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine_args import EngineArgs
from serving_utils import wait_for

ray_app = pytest.importorskip("minillm.service.ray_app", reason="ray[serve] is not installed")
from minillm.service import replica_header  # noqa: E402  (ray[serve] is there)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"),  # one Ray instance at a time on this machine
              # Serve compares the look-back with its deprecated metrics_interval_s (10 s); a scale to zero a
              # second after the last request is what this test wants
              pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")]
PROMPT = "Scale to zero"
IDLE_TO_ZERO = {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 0,
                "look_back_period_s": 1}  # Serve's defaults wait 30 s of look-back and 600 s before removing
START_S = 120  # a replica's start: a new process imports torch and loads the model


def test_an_idle_service_scales_to_zero_and_a_request_brings_a_replica_back(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32)
    with ray_app.RayService(args, replicas=1, autoscaling=IDLE_TO_ZERO, model_name="tiny") as service:
        wait_for(lambda: not service.replica_states(), START_S, "the idle service to scale to zero")
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
                "ignore_eos": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=START_S) as r:
            headers_after = time.monotonic() - start
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        waited = time.monotonic() - start
        assert service.replica_states().get("RUNNING") == 1
        wait_for(lambda: not service.replica_states(), START_S, "the service to scale to zero again")
    want = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=32).generate(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert text == want
    assert waited > 1  # it waited for a replica to start: a cold start, not a warm replica's milliseconds
    assert headers_after < min(waited - 1, replica_header.REPLICA_WAIT_S + 3)  # the client was not left without a byte
