"""The step watchdog, on a tiny model: while an engine step runs past `step_timeout_s` (hung, not failed), /health
answers 503 naming it and a new request gets a 503 at once; once the step returns, both are back to normal."""

import threading
import time

import httpx
import pytest

from minillm.serving import AsyncLLM, ServerThread, build_app
from serving_utils import slow_steps, tiny_engine, wait_for

STEP_S = 3.0  # one step this long: the watchdog (0.5 s) must see it well before it ends


def test_a_step_that_hangs_turns_health_to_503_until_it_returns(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=64)
    slow_steps(engine, STEP_S)
    body = {"prompt": "Once upon a time", "max_tokens": 1, "ignore_eos": True}
    app = build_app(AsyncLLM(engine, step_timeout_s=0.5), "test-model")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        done: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: done.append(c.post("/v1/completions", json=body)))
        start = time.monotonic()
        slow.start()
        try:
            stuck = wait_for(lambda: (r := c.get("/health")).status_code == 503 and r, STEP_S, "/health to turn 503")
            assert time.monotonic() - start < STEP_S
            error = stuck.json()["error"]
            assert error["type"] == "service_unavailable" and "stuck" in error["message"], error
            refused = c.post("/v1/completions", json=body)
            assert refused.status_code == 503 and "stuck" in refused.json()["error"]["message"]
        finally:
            slow.join(60)
        assert done[0].status_code == 200  # the slow step was slow, not lost
        assert c.get("/health").status_code == 200


def test_the_step_timeout_must_be_positive(tiny_llama):
    with pytest.raises(ValueError, match="step_timeout_s"):
        AsyncLLM(tiny_engine(tiny_llama, num_kv_blocks=16), step_timeout_s=0)
