"""How the server fails, on a tiny model: a client that leaves a non-streamed request is a quiet abort; a failed
engine step gives every request in flight a generic 500 (or error event) that tells nothing of the cause, and
the server stops: `ServerThread.failed`, and `python -m minillm serve` exits non-zero so a supervisor can
restart it."""

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving_utils import Records, scrape, serve_engine, slow_steps, tiny_engine, wait_idle

BODY = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
SECRET = "secret-cause-7f3a"  # the failing step's message: it must reach the log, never a client


def wait_running(c: httpx.Client, n: int) -> None:
    while scrape(c)["num_requests_running"] < n:
        time.sleep(0.01)


def test_a_client_leaving_a_non_streamed_request_is_a_quiet_abort(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    slow_steps(engine, 0.02)
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "minillm")]
    with serve_engine(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for logger in loggers:  # after uvicorn configured its loggers, which drops their handlers
            logger.addHandler(records)
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/completions", json=BODY, timeout=0.5)
            wait_idle(c)
            assert scrape(c)['request_success_total{finished_reason="abort"}'] == 1
        finally:
            for logger in loggers:
                logger.removeHandler(records)
    assert len(records.records) <= 1 and not any(r.exc_info for r in records.records), \
        [r.getMessage() for r in records.records]


def fail_steps(engine, armed: threading.Event) -> None:
    """Once `armed` is set, every engine step raises an error whose text a client must never see."""
    step = engine.step

    def failing_step():
        if armed.is_set():
            raise RuntimeError(f"{SECRET} in /opt/minillm/engine.py")
        return step()
    engine.step = failing_step


def test_a_failed_step_gives_generic_500s_and_stops_the_server_thread(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    slow_steps(engine, 0.02)
    armed = threading.Event()
    fail_steps(engine, armed)
    srv = serve_engine(engine)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c, ThreadPoolExecutor(1) as pool:
            whole = pool.submit(c.post, "/v1/completions", json=BODY)
            with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as streamed:
                lines = streamed.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                wait_running(c, 2)
                armed.set()
                events = [line[6:] for line in lines if line.startswith("data: ")]
            r = whole.result()
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error"
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "internal error"
        assert SECRET not in r.text + "".join(events) and "/opt" not in r.text + "".join(events)
        srv.thread.join(30)
        assert not srv.thread.is_alive() and srv.failed and srv.exit_code == 1
    finally:
        srv.stop()


LAUNCHER = """
import os, sys, threading, time
from minillm.engine import LLMEngine
from minillm.__main__ import main

step = LLMEngine.step

def step_for_test(self):
    time.sleep(0.02)
    if os.path.exists(sys.argv[1]):
        raise RuntimeError("{secret} in " + sys.argv[1])
    return step(self)

LLMEngine.step = step_for_test
sys.exit(main(["serve", *sys.argv[2:]]))
"""


def test_serve_exits_non_zero_after_an_engine_failure(tiny_llama, tmp_path):
    """`python -m minillm serve` (here through a launcher that makes steps fail once a file exists), its API key
    from $MINILLM_API_KEY: requests in flight get generic errors, and the process exits with status 1."""
    launcher, trigger = tmp_path / "launch.py", tmp_path / "fail-now"
    launcher.write_text(LAUNCHER.format(secret=SECRET))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MINILLM_API_KEY": "k-env"}
    proc = subprocess.Popen([sys.executable, str(launcher), str(trigger), "--model", str(tiny_llama), "--device", "cpu",
                             "--threads", "1", "--port", "0", "--num-kv-blocks", "64", "--block-size", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        url = lines.get(timeout=120).split(" at ")[1].split()[0].removesuffix("/v1")
        auth = {"Authorization": "Bearer k-env"}
        with httpx.Client(base_url=url, timeout=60, headers=auth) as c, ThreadPoolExecutor(1) as pool:
            assert httpx.get(url + "/v1/models").status_code == 401
            whole = pool.submit(c.post, "/v1/completions", json=BODY)
            with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as streamed:
                lines_in = streamed.iter_lines()
                next(line for line in lines_in if line.startswith("data: "))
                wait_running(c, 2)
                trigger.touch()
                events = [line[6:] for line in lines_in if line.startswith("data: ")]
            r = whole.result()
        assert proc.wait(60) == 1
        stderr = proc.stderr.read()
        assert r.status_code == 500 and json.loads(events[-2])["error"]["message"] == "internal error"
        assert SECRET not in r.text + "".join(events) and str(tmp_path) not in r.text + "".join(events)
        assert SECRET in stderr and "Traceback" in stderr  # the cause, for the operator
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
