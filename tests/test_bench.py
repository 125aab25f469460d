"""Benchmark client: seeded workloads, the JSONL loader, goodput options, token timestamps from streamed chunks,
the summary table, and the command line up to the network (no server here; the serving tests bring one)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from minillm.bench import (WORKLOADS, Chunk, corpus_ids, expand_token_times, for_endpoint, format_result, load_jsonl,
                           main, make_workload, parse_goodput, run_hf, run_http, run_minillm)
from minillm.metrics import RequestMetrics, check_slo, summarize
from minillm.ports import free_port
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# --- workloads ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_lengths_seeded(name, tokenizer):
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    work = make_workload(name, 40, tokenizer, seed=3)
    assert len(work) == 40 and len(corpus_ids(tokenizer)) > p_hi
    assert all(p_lo <= len(p) <= p_hi and o_lo <= m <= o_hi for p, m in work)
    assert all(0 <= t < len(tokenizer) for p, _ in work for t in p)
    assert make_workload(name, 40, tokenizer, seed=3) == work  # deterministic
    assert make_workload(name, 40, tokenizer, seed=4) != work  # and the seed matters


def write_lines(tmp_path, *lines: str):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl(tmp_path):
    messages = [{"role": "user", "content": "Bonjour, 模型"}]
    path = write_lines(tmp_path, json.dumps({"prompt": "hello", "max_tokens": 7}), "",
                       json.dumps({"prompt": [1, 2, 3]}), json.dumps({"messages": messages, "max_tokens": 2}))
    assert load_jsonl(path, max_tokens=16) == [("hello", 7), ([1, 2, 3], 16), (messages, 2)]


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '{"prompt": "a", "messages": []}', '{"max_tokens": 3}',
                                 '{"prompt": ""}', '{"prompt": [1, -2]}', '{"prompt": [1, "2"]}', '{"prompt": [true]}',
                                 '{"messages": ["hi"]}', '{"messages": []}', '{"prompt": "a", "max_tokens": 0}',
                                 '{"prompt": "a", "max_tokens": "5"}', '{"prompt": "a", "max_tokens": 2.5}'])
def test_load_jsonl_names_the_bad_line(tmp_path, bad):
    with pytest.raises(ValueError, match="line 2: "):
        load_jsonl(write_lines(tmp_path, '{"prompt": "fine"}', bad), max_tokens=16)


def test_load_jsonl_empty(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(write_lines(tmp_path, "", "  "), max_tokens=16)


def test_for_endpoint(tokenizer):
    ids = tokenizer("The quick brown fox").input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert for_endpoint([("text", 4), (ids, 5)], "completions") == [("text", 4), (ids, 5)]
    assert for_endpoint([("text", 4), (ids, 5), (messages, 6)], "chat", tokenizer) == [
        ([{"role": "user", "content": "text"}], 4), ([{"role": "user", "content": "The quick brown fox"}], 5),
        (messages, 6)]
    with pytest.raises(ValueError, match="request 0 holds chat messages"):
        for_endpoint([(messages, 6)], "completions")
    with pytest.raises(ValueError, match="endpoint"):
        for_endpoint([("text", 4)], "embeddings")


def test_parse_goodput():
    slo = parse_goodput(["ttft:500", "tpot:100", "e2el:2500.5"])
    assert slo == {"ttft_ms": 500, "tpot_ms": 100, "e2el_ms": 2500.5}
    check_slo(slo)  # what summarize accepts
    assert parse_goodput([]) == {}
    for bad in ["itl:5", "ttft", "ttft:", "ttft:-1", "ttft:fast", "ttft_ms:5", "ttft:nan"]:
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


# --- token timestamps from chunks ---------------------------------------------------------------------------

def test_token_times_from_cumulative_usage():
    chunks = [Chunk(1.0, True, 1), Chunk(2.0, True, 3), Chunk(2.5, False, 3), Chunk(3.0, True, 4),
              Chunk(3.1, False, 4)]  # the third only finishes, the last is the usage-only chunk
    assert expand_token_times(chunks) == [1.0, 2.0, 2.0, 3.0]


def test_token_times_without_per_chunk_usage():
    text_then_usage = [Chunk(1.0, True, None), Chunk(2.0, True, None), Chunk(2.2, False, None), Chunk(2.3, False, 3)]
    assert expand_token_times(text_then_usage) == [1.0, 2.0, 2.3]  # the uncounted token at the final chunk
    assert expand_token_times(text_then_usage[:3]) == [1.0, 2.0]  # no usage at all: a token per text chunk
    assert expand_token_times([Chunk(1.0, True, None), Chunk(2.0, True, None), Chunk(2.1, False, 1)]) == [1.0]
    assert expand_token_times([]) == []


def test_chunk_read_openai_types():
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    completion = Completion.model_validate({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                            "choices": [{"index": 0, "text": " fox", "finish_reason": "length"}],
                                            "usage": usage})
    assert Chunk.read(completion, 1.5) == Chunk(1.5, True, 2)
    chat = ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                               "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                          "content": ""}, "finish_reason": None}]})
    assert Chunk.read(chat, 2.0) == Chunk(2.0, False, None)
    chat.choices[0].delta.content = "fox"
    assert Chunk.read(chat, 2.0).text
    chat.choices = []
    assert Chunk.read(chat, 2.0) == Chunk(2.0, False, None)


# --- offline throughput drivers: minillm against Hugging Face generate ----------------------------------------

def test_throughput_drivers_count_each_requests_own_tokens(tiny_llama):
    """Both drivers run every request to its own max_tokens; HF static batches of 1 and 3 (left padded) alike."""
    import torch
    from transformers import AutoModelForCausalLM

    from minillm import LLM

    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    work = [(list(range(3, 3 + n)), m) for n, m in [(5, 4), (9, 2), (2, 7), (12, 1)]]
    results = [run_minillm(llm, work), run_hf(hf, work, 1, 0), run_hf(hf, work, 3, 0)]
    for r in results:
        assert r["output_tokens"] == 14 and r["seconds"] > 0


# --- report and command line ------------------------------------------------------------------------------

def test_format_result():
    r = RequestMetrics(arrival_time=0.0, prompt_tokens=4)
    for t in (0.1, 0.2, 0.4):
        r.record_token(t)
    r.finished_time = 0.4
    summary = summarize([r], 1.0, {"ttft_ms": 50}, (50, 99))
    table = format_result(summary, failed=2, percentiles=(50, 99), goodput=True)
    lines = table.splitlines()
    assert lines[0].startswith("=====") and "Serving Benchmark Result" in lines[0] and lines[-1] == "=" * 50
    expected = {"Successful requests:": "1", "Failed requests:": "2", "Request goodput (req/s):": "0.00",
                "Mean TTFT (ms):": "100.00", "P99 TPOT (ms):": "150.00", "Median ITL (ms):": "150.00",
                "P50 E2EL (ms):": "400.00"}
    for name, value in expected.items():
        assert f"{name:<40} {value}" in lines, name
    assert "goodput" not in format_result(summary, failed=0, percentiles=(50, 99))


def test_cli_bad_dataset(tmp_path, capsys):
    assert main(["--dataset", str(write_lines(tmp_path, "oops")), "--no-progress"]) == 2
    assert "line 1" in capsys.readouterr().err
    assert main(["--dataset", str(write_lines(tmp_path, '{"prompt": "x"}')), "--num-prompts", "3"]) == 2
    assert "holds 1 requests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--percentiles", "50,101"])


def test_cli_counts_failed_requests(tmp_path, capsys):
    """Nothing listens on the port: every request fails, is reported, and the run still ends cleanly."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    data = str(write_lines(tmp_path, '{"prompt": "a"}', '{"prompt": [1, 2]}'))
    assert main(["--base-url", url, "--model", "m", "--dataset", data, "--no-progress", "--save-result",
                 "--result-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "request 0: APIConnectionError" in err and "all 2 requests failed" in err
    assert not (tmp_path / "out").exists()
    assert main(["--base-url", url, "--dataset", data]) == 1  # no --model: listing the models fails
    assert url in capsys.readouterr().err


def test_run_http_checks_arguments():
    for kwargs in ({"arrivals": [0.0]}, {"arrivals": [1.0, 0.0]}, {"endpoint": "embeddings"}, {"max_concurrency": 0}):
        args = {"arrivals": [0.0, 0.0]} | kwargs
        with pytest.raises(ValueError):
            asyncio.run(run_http("http://127.0.0.1:9/v1", "m", [("a", 1), ("b", 1)], **args))


def test_import_does_not_load_torch():
    """The HTTP client runs on machines without the engine's dependencies."""
    code = "import sys, minillm.bench; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_api_key_from_the_environment_is_its_first_key(monkeypatch):
    """The server takes several comma-separated keys in $MINILLM_API_KEY; the benchmark client sends one of them."""
    import argparse

    from minillm.bench import add_arguments
    for value, expected in (("k1, k2", "k1"), ("solo", "solo"), ("", None)):
        monkeypatch.setenv("MINILLM_API_KEY", value)
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert parser.parse_args(["--base-url", "http://127.0.0.1:1"]).api_key == expected
