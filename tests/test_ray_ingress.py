"""Several ingress replicas (chapter 9), on a tiny model: every response names the ingress replica that handled
it, Serve's proxy spreads requests over both, and one rate limit holds across them (their buckets live in one
`GatewayBuckets`). Killing an ingress replica mid-stream ends the streams it carried, never with a hang; the
other replica's streams finish, new requests are served, Serve starts a replacement, and the engine frees every
block (the orphaned requests run out on the replica and free theirs)."""

import json
import os
import signal
import time
from collections import Counter

import httpx
import pytest

from minillm.__main__ import main
from minillm.engine_args import EngineArgs
from minillm.service.gateway import RateLimit
from serving_utils import wait_for
from tiny_models import build_tiny_model

ray_app = pytest.importorskip("minillm.service.ray_app", reason="ray[serve] is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
MODEL = "tiny"
RECOVERY_S = 120  # an ingress replica's restart: a new process imports the app and reads the tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A wider and deeper tiny model, so that a long stream takes seconds (as test_ray_service.py's)."""
    return build_tiny_model(tmp_path_factory.mktemp("ray-model"), hidden_size=256, intermediate_size=512,
                            num_hidden_layers=6, max_position_embeddings=1024)


class Stream:
    """A streamed completion whose first event has arrived, and the ingress replica that carries it."""

    def __init__(self, url: str, key: str):
        self.client = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"})
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        self.response = self.client.send(self.client.build_request("POST", url + "/v1/completions", json=body),
                                         stream=True)
        assert self.response.status_code == 200, self.response.read()
        self.ingress = self.response.headers["x-minillm-ingress"]
        self.lines = self.response.iter_lines()
        next(line for line in self.lines if line.startswith("data: "))

    def rest(self) -> tuple[list[str], str | None]:
        """The remaining events, and the error that cut the stream, if one did."""
        events = []
        try:
            events += [line[6:] for line in self.lines if line.startswith("data: ")]
        except httpx.HTTPError as e:
            return events, type(e).__name__
        finally:
            self.response.close()
            self.client.close()
        return events, None


def test_ingress_replicas_share_one_rate_limit_and_outlive_a_killed_one(model):
    args = EngineArgs(model=str(model), device="cpu", dtype="float32", num_kv_blocks=64)
    with ray_app.RayService(args, replicas=1, ingress_replicas=2, model_name=MODEL, api_key="key-a,key-b",
                            rate_limit=RateLimit(requests_per_second=0.05, burst=6)) as svc:
        assert len(svc.ingress_pids()) == 2
        # key-a's requests, each on a connection of its own, so that the proxy spreads them
        codes, ingresses = [], Counter()
        for _ in range(30):
            r = httpx.post(svc.url + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer key-a"},
                           timeout=30)
            codes.append(r.status_code)
            ingresses[r.headers["x-minillm-ingress"]] += 1
        assert set(ingresses) == set(svc.ingress_pids()), ingresses  # both ingress replicas answered
        assert codes.count(200) == 6 and codes.count(429) == 24, codes  # one budget (one per replica: up to 12)

        streams = [Stream(svc.url, "key-b") for _ in range(4)]  # key-b: a client with a bucket of its own
        victim = Counter(s.ingress for s in streams).most_common(1)[0][0]
        os.kill(svc.ingress_pids()[victim], signal.SIGKILL)
        start = time.monotonic()
        for s in streams:
            events, cut = s.rest()
            if s.ingress == victim:  # ended, one way or another, but not with a normal finish
                assert cut is not None or "[DONE]" not in events or any('"error"' in e for e in events), events[-3:]
            else:
                assert cut is None and events[-1] == "[DONE]", (cut, events[-3:])
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - start < 90

        def served() -> bool:  # the survivor answers at once; the proxy may still try the dead one for a moment
            r = httpx.post(svc.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                           headers={"Authorization": "Bearer key-b"}, timeout=30)
            return r.status_code == 200
        wait_for(served, 30, "a request served after the kill")
        wait_for(lambda: len(svc.ingress_pids()) == 2 and victim not in svc.ingress_pids(), RECOVERY_S,
                 "Serve to start another ingress replica")
        wait_for(lambda: all(s["kv_blocks_free"] == s["kv_blocks_total"] and not s["num_running"]
                             for s in svc.replica_stats()), 90, "every block freed on the engine replica")


def test_ingress_replicas_flag_is_checked_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", "--ingress-replicas", "0"])
    assert e.value.code == 2 and "--ingress-replicas must be at least 1" in capsys.readouterr().err
