"""`python -m minillm serve` as a process: it prints its URL when ready, and on SIGTERM or SIGINT it stops
taking requests, ends open streams cleanly (a final chunk, then [DONE]) and exits with status 0.
`python -m minillm bench` drives it and saves vLLM's metric set."""

import json
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import requires_default_model
from serving_utils import Served

pytestmark = [pytest.mark.slow, requires_default_model]


@pytest.fixture
def served(request):
    servers = []

    def start(*args):
        servers.append(Served(*args))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def open_stream(url: str, max_tokens: int):
    """A streaming request whose first event has arrived: (client, the rest of its lines, to read later)."""
    client = httpx.Client(timeout=120)
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    response = client.send(client.build_request("POST", url + "/completions", json=body), stream=True)
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    return client, lines


def events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_sigterm_aborts_open_streams_cleanly_and_exits_0(served):
    srv = served("--drain-seconds", "0")
    client, lines = open_stream(srv.url, 400)
    assert srv.stop(signal.SIGTERM) == 0
    data = events(lines)
    client.close()
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"


def test_sigint_lets_streams_finish_within_the_drain_and_exits_0(served):
    srv = served("--drain-seconds", "60")
    client, lines = open_stream(srv.url, 24)
    srv.proc.send_signal(signal.SIGINT)
    data = events(lines)
    assert srv.proc.wait(60) == 0
    client.close()
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in srv.proc.stderr.read()


def test_bench_cli_drives_the_server_and_saves_the_vllm_metric_set(served, tmp_path):
    srv = served()
    data = tmp_path / "work.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}: what is a cache?", "max_tokens": 6 + i}) + "\n"
                            for i in range(6)))
    out = subprocess.run([sys.executable, "-m", "minillm", "bench", "--base-url", srv.url, "--dataset", str(data),
                          "--ignore-eos", "--request-rate", "20", "--goodput", "ttft:60000", "tpot:60000",
                          "--save-result", "result.json", "--result-dir", str(tmp_path), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == sum(6 + i for i in range(6))
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    for key in ("ttft_ms_p99", "tpot_ms_median", "itl_ms_mean", "e2el_ms_p90", "output_throughput"):
        assert result[key] > 0, key
    assert "Successful requests" in out.stdout
    assert srv.stop(signal.SIGTERM) == 0
