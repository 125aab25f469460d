"""Chapter 9 — minillm as a KServe predictor: the class an InferenceService would run, served here by KServe's own
`ModelServer` on one machine (no Kubernetes).

`MiniLLMModel` is a `kserve.Model`: `load` builds the engine, KServe starts its loop (`start_engine`), and `predict`
answers KServe's V1 protocol (`POST /v1/models/{name}:predict`), each instance an OpenAI completion body answered by
minillm's own /v1/completions handler. KServe's OpenAI routes (`kserve.protocol.rest.openai`) import vLLM, which
cannot live beside this engine's pinned stack, so the OpenAI routes are minillm's app mounted at KServe's `/openai`
prefix (`/openai/v1/completions`, `/openai/v1/chat/completions`), over the same engine. `start_kserve` runs it in a
child process (KServe's server takes the main thread's signals) on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import kserve
from kserve.errors import InvalidInput
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..engine import LLMEngine
from ..engine_args import EngineArgs
from ..serving.api_server import build_app
from ..serving.async_llm import AsyncLLM, EngineOverloaded, EngineUnavailable
from ..serving.completions import completion
from ..serving.launch import bind
from ..serving.middleware import bind_hosts
from ..serving.protocol import CompletionRequest, OpenAIError


async def _never() -> None:
    """A client that never leaves: KServe's predict call has no disconnect to watch."""
    await asyncio.Event().wait()


class MiniLLMModel(kserve.Model):
    """minillm's `AsyncLLM` behind KServe's model interface (`load`, `predict`), and its OpenAI app (`openai_app`)."""

    def __init__(self, name: str, engine_args: EngineArgs, host: str = "127.0.0.1", max_waiting_requests: int = 256):
        super().__init__(name)
        self.engine_args, self.host, self.max_waiting_requests = engine_args, host, max_waiting_requests
        self.engine = True  # KServe awaits `start_engine` on its event loop beside the HTTP server
        self.openai_app = None

    def load(self) -> bool:
        llm = AsyncLLM(LLMEngine(self.engine_args), max_waiting_requests=self.max_waiting_requests)
        self.openai_app = build_app(llm, self.name, allowed_hosts=bind_hosts(self.host))
        self.ready = True
        return self.ready

    @property
    def llm(self) -> AsyncLLM:
        return self.openai_app.state.served.llm

    async def start_engine(self) -> None:
        await self.llm.start()

    def stop_engine(self) -> None:
        self.ready = False
        asyncio.ensure_future(self.llm.stop())

    async def predict(self, payload: dict, headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None) -> dict:
        """V1: `{"instances": [completion body, ...]}` -> `{"predictions": [completion response, ...]}`, the
        instances run together and are admitted all or none; a bad instance is a 400 naming it, and stops the
        others."""
        instances = payload.get("instances") if isinstance(payload, dict) else None
        if not isinstance(instances, list) or not instances:
            raise InvalidInput('expected {"instances": [...]}, each an OpenAI completion request body')
        requests = [self._request(i, body) for i, body in enumerate(instances)]
        served = self.openai_app.state.served
        served.llm.check_room(sum(len(r.prompts()) * r.n for r in requests))
        tasks = [asyncio.ensure_future(completion(served, r, _never)) for r in requests]
        try:
            responses = await asyncio.gather(*tasks)
        except OpenAIError as e:
            raise InvalidInput(e.message) from None
        finally:
            for t in tasks:  # a failed instance's siblings are aborted: their KV blocks go back at once
                t.cancel()
        return {"predictions": [json.loads(r.body) for r in responses]}

    @staticmethod
    def _request(index: int, body) -> CompletionRequest:
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise InvalidInput(f"instances.{index}{'.' + where if where else ''}: {first['msg']}") from None
        if req.stream:
            raise InvalidInput(f"instances.{index}.stream: KServe's predict returns whole responses; use "
                               "/openai/v1/completions to stream")
        return req


async def _engine_refused(request: Request, e: EngineOverloaded | EngineUnavailable) -> JSONResponse:
    """The engine's refusals on KServe's routes, in KServe's error shape: 429 when it is full (try again), 503 when
    it is shutting down; KServe's own handler would make both a 500."""
    if isinstance(e, EngineOverloaded):
        return JSONResponse({"error": str(e)}, status_code=429, headers={"Retry-After": "1"})
    return JSONResponse({"error": str(e)}, status_code=503)


class _LoopbackModelServer(kserve.ModelServer):
    """KServe's server on `host`: its REST server binds 0.0.0.0, right in a pod, too wide on a shared machine."""

    def __init__(self, host: str, **kw):
        super().__init__(**kw)
        self.host = host

    async def _serve(self):
        self._rest_server.config.host = self.host
        await super()._serve()


def main(argv: list[str] | None = None) -> None:
    """`python -m minillm.service.kserve_model --model DIR --model_name NAME --http_port PORT`: serve until
    SIGTERM. KServe's own flags (`--http_port`, `--model_name`, ...) and the engine's (`--model`, `--dtype`, ...);
    one REST worker and no gRPC server: the OpenAI app is mounted in this process, and gRPC binds every address."""
    from kserve.model_server import app, parser as kserve_parser

    parser = argparse.ArgumentParser(parents=[kserve_parser], description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address KServe's REST server binds (default: 127.0.0.1; 0.0.0.0 in a pod)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences allowed to wait; beyond this a request gets 429 with Retry-After")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    model = MiniLLMModel(args.model_name, EngineArgs.from_cli_args(args), args.host, args.max_waiting_requests)
    model.load()
    app.mount("/openai", model.openai_app)
    for refusal in (EngineOverloaded, EngineUnavailable):
        app.add_exception_handler(refusal, _engine_refused)
    _LoopbackModelServer(args.host, http_port=args.http_port, enable_grpc=False, workers=1).start([model])


@dataclass
class KServeServer:
    """A KServe ModelServer in a child process: `url` (KServe's routes; OpenAI clients use `url + "/openai/v1"`)."""

    process: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        os.unlink(self.log_path)

    def __enter__(self) -> KServeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_kserve(name: str, engine_flags: list[str], host: str = "127.0.0.1", timeout: float = 180) -> KServeServer:
    """Start `main` in a child process and wait until KServe reports the model ready (V1 `/v1/models/{name}`);
    the child is stopped if it does not get there within `timeout` seconds."""
    with bind(host, 0) as sock:  # a free port, handed to the child
        port = sock.getsockname()[1]
    fd, log_path = tempfile.mkstemp(prefix="minillm-kserve-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "minillm.service.kserve_model", "--model_name", name,
                                    "--http_port", str(port), "--host", host, *engine_flags],
                                   stdout=log, stderr=subprocess.STDOUT)
    server = KServeServer(process, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{server.url}/v1/models/{name}", timeout=5).json().get("ready"):
                return server
        except (httpx.HTTPError, ValueError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            tail = server.log()[-2000:]
            server.stop()
            raise RuntimeError(f"KServe's ModelServer did not become ready:\n{tail}")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
