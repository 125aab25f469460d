"""Helpers for server tests: start a server on 127.0.0.1, a client from a given local address, a tokenizer that
holds a prompt until released, read an SSE stream, scrape /metrics, collect the server's log, run `serve` as a
process."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from minillm.engine import LLMEngine
from minillm.serving import AsyncLLM, ServerThread, build_app


def start_server(model, name: str = "test-model", max_waiting_requests: int | None = 256, app_kw: dict | None = None,
                 **engine_kw) -> ServerThread:
    """A started ServerThread over a fresh engine (CPU, float32); stop it with `.stop()` or a with-block.
    `app_kw` goes to `build_app` (limits, api_key, allowed_origins)."""
    return serve_engine(tiny_engine(model, **engine_kw), name, max_waiting_requests, **(app_kw or {}))


def tiny_engine(model, **engine_kw) -> LLMEngine:
    return LLMEngine(model, device="cpu", dtype=torch.float32, **engine_kw)


def serve_engine(engine: LLMEngine, name: str = "test-model", max_waiting_requests: int | None = 256,
                 **app_kw) -> ServerThread:
    """A started ServerThread over an engine a test has prepared (a slowed step, a tokenizer double)."""
    return ServerThread(build_app(AsyncLLM(engine, max_waiting_requests=max_waiting_requests), name, **app_kw)).start()


def client(url: str, address: str, key: str | None = None) -> httpx.Client:
    """A client whose connections come from `address` (127.0.0.x: another client to a per-address limit), with
    `key` as its bearer token if given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30, transport=httpx.HTTPTransport(local_address=address))


class SlowTokenizer:
    """The engine's tokenizer, except that text containing "slow" blocks until the test releases it (or 10 s)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self, text: str) -> None:
        if "slow" in text:
            self.entered.set()
            self.release.wait(10)

    def __call__(self, text, **kw):
        self._hold(text)
        return self.tokenizer(text, **kw)

    def apply_chat_template(self, messages, **kw):
        self._hold(messages[-1]["content"])
        return self.tokenizer.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def slow_steps(engine: LLMEngine, seconds: float) -> None:
    """Make every engine step take `seconds` longer, so a request is still running when a test acts on it."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    engine.step = slow_step


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (comments and blank lines skipped)."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def stream_json(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """POST a streaming request; its chunks as dicts. The stream must end with [DONE]."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def scrape(client: httpx.Client) -> dict[str, float]:
    """The samples of /metrics without the `minillm:` prefix and the model label:
    `{"num_requests_running": 0.0, 'request_success_total{finished_reason="stop"}': 3.0, ...}`."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name.removeprefix("minillm:") + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def wait_idle(client: httpx.Client, seconds: float = 20) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is in use; the last scrape."""
    deadline = time.monotonic() + seconds
    while True:
        m = scrape(client)
        if m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.05)


def wait_for(condition, seconds: float, what: str):
    """Poll `condition` until it returns something true (returned), failing after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


class Records(logging.Handler):
    """Keeps every log record it is given, for a test to read what a server logged."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


class Served:
    """A `python -m minillm serve` child process on 127.0.0.1 and a free port; always killed at the end."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", "0", "--device", "cpu",
                                      "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.ready = lines.get(timeout=180)  # the line it prints once it serves
        assert " at http://127.0.0.1:" in self.ready, self.ready
        self.url = self.ready.split(" at ")[1].split()[0]  # http://127.0.0.1:PORT/v1

    def stop(self, sig: int, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
