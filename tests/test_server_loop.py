"""The event loop stays free on a tiny model: a batch's stop strings are compiled once, off the loop."""

import threading
import time
import uuid

import httpx
import pytest

from minillm import stop_strings
from serving_utils import start_server

LOOP_THREAD = "minillm-server"  # ServerThread runs uvicorn and its event loop here


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(tiny_llama, num_kv_blocks=512, block_size=4)
    yield srv
    srv.stop()


def test_a_batch_compiles_its_stop_strings_once_off_the_event_loop(server, monkeypatch):
    builds: list[tuple[str, float]] = []  # (thread, seconds) of each automaton built
    build = stop_strings.StopAutomaton.__init__

    def spy(self, stops):
        t0 = time.perf_counter()
        build(self, stops)
        builds.append((threading.current_thread().name, time.perf_counter() - t0))
    monkeypatch.setattr(stop_strings.StopAutomaton, "__init__", spy)
    stops = [uuid.uuid4().hex * 8 for _ in range(16)]  # 16 stop strings of 256 characters, new to any cache
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": ["Once upon a time"] * 64, "max_tokens": 1, "stop": stops})
    assert r.status_code == 200, r.text
    on_loop = [s for thread, s in builds if thread == LOOP_THREAD]
    assert len(builds) == 1 and not on_loop, f"{len(on_loop)} builds on the loop ({sum(on_loop):.3f} s), {builds[:3]}"
