"""Chapter 9 — minillm's KServe predictor under KServe's own ModelServer (127.0.0.1, a child process) answers as
minillm's server does: the same greedy text through the official openai client and through KServe's V1 predict.
Skipped where kserve is not installed: it needs an environment of its own (`make test-extras` makes one and
runs this there)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("kserve")
openai = pytest.importorskip("openai")

from minillm.service.kserve_model import start_kserve  # noqa: E402
from serving_utils import start_server  # noqa: E402

NAME = "tiny"
PROMPT = "The quick brown fox"
GREEDY = dict(max_tokens=8, temperature=0)
TIMEOUT = 60


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=TIMEOUT, max_retries=0)


def _texts(client: openai.OpenAI) -> tuple[str, str]:
    """The completion's and the chat reply's text for the same greedy request."""
    text = client.completions.create(model=NAME, prompt=PROMPT, **GREEDY).choices[0].text
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}], **GREEDY)
    return text, chat.choices[0].message.content


def test_kserve_model_server_answers_as_minillm(tiny_llama):
    with start_server(tiny_llama, name=NAME) as own, \
            start_kserve(NAME, ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
                                "--max-waiting-requests", "2"]) as ks:
        expected = _texts(_client(own.url + "/v1"))
        assert all(expected), expected
        assert _texts(_client(ks.url + "/openai/v1")) == expected

        with httpx.Client(base_url=ks.url, timeout=TIMEOUT) as http:
            assert http.get(f"/v1/models/{NAME}").json() == {"name": NAME, "ready": True}
            r = http.post(f"/v1/models/{NAME}:predict",
                          json={"instances": [{"prompt": PROMPT, **GREEDY}, {"prompt": [1, 2, 3], **GREEDY}]})
            assert r.status_code == 200, r.text
            predictions = r.json()["predictions"]
            assert predictions[0]["choices"][0]["text"] == expected[0]
            assert predictions[1]["usage"]["prompt_tokens"] == 3

            # a bad instance is a 400 that names it, and the engine goes on serving
            r = http.post(f"/v1/models/{NAME}:predict", json={"instances": [{"prompt": PROMPT, "max_tokens": 0}]})
            assert r.status_code == 400 and "instances.0.max_tokens" in r.json()["error"], r.text
            r = http.post(f"/v1/models/{NAME}:predict", json={"instances": [{"prompt": PROMPT, "stream": True}]})
            assert r.status_code == 400 and "instances.0.stream" in r.json()["error"], r.text
            r = http.post(f"/v1/models/{NAME}:predict", json={"inputs": []})
            assert r.status_code == 400 and "instances" in r.json()["error"], r.text
            # more sequences than may wait: the engine's 429, not a 500
            r = http.post(f"/v1/models/{NAME}:predict",
                          json={"instances": [{"prompt": PROMPT, "n": 3, "max_tokens": 8}]})
            assert r.status_code == 429 and r.headers["retry-after"] == "1" and "limit 2" in r.json()["error"], r.text
            r = http.post(f"/v1/models/{NAME}:predict", json={"instances": [{"prompt": PROMPT, **GREEDY}]})
            assert r.json()["predictions"][0]["choices"][0]["text"] == expected[0]
        assert "127.0.0.1" in ks.log() and "0.0.0.0" not in ks.log()
