"""`EngineArgs` is the one list of engine parameters: every command line takes each of them, bad values are
refused by name before anything loads, and `serve` runs what `LLM` runs (int4, tensor parallel)."""

import dataclasses

import httpx
import pytest
import torch

from minillm import LLM, EngineArgs, LLMEngine, SamplingParams
from minillm.__main__ import build_parser
from test_serve_cli import served  # noqa: F401 (a fixture)

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
# a value for every field that differs from its default, written as a command line would give it
CHANGED = {"model": "/some/model", "device": "cpu", "dtype": "bfloat16", "load_format": "dummy", "block_size": 8,
           "num_kv_blocks": 32, "max_num_seqs": 3, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
           "quantization": "int4", "quantization_group_size": 32, "kv_cache_dtype": "int8",
           "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "enable_expert_parallel": True, "num_threads": 1,
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}', "kv_offloading_size": 0.5,
           "kv_offloading_backend": "file"}


def test_every_field_has_a_changed_value_here():
    assert sorted(CHANGED) == sorted(FIELDS)


def _argv(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--threads" if name == "num_threads" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_command_line_takes_every_engine_parameter(command):
    extra = {"generate": ["a prompt"], "bench": ["--offline"]}.get(command, [])
    args = build_parser().parse_args([command, *extra, *_argv(CHANGED)])
    assert EngineArgs.from_cli_args(args) == EngineArgs(**CHANGED)
    defaults = build_parser().parse_args([command, *extra])
    assert EngineArgs.from_cli_args(defaults) == EngineArgs()


@pytest.mark.parametrize("bad, field", [({"block_size": 0}, "block_size"), ({"max_num_seqs": -1}, "max_num_seqs"),
                                        ({"quantization": "int3"}, "quantization"),
                                        ({"kv_cache_dtype": "float8"}, "kv_cache_dtype"),
                                        ({"load_format": "pt"}, "load_format"), ({"num_threads": 0}, "num_threads"),
                                        ({"tensor_parallel_size": 1.5}, "tensor_parallel_size"),
                                        ({"speculative_config": '{"method": "x"}'}, "speculative_config")])
def test_bad_values_are_named_before_anything_loads(bad, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine("/no/such/model", **bad)  # the path would fail later: the field is checked first


def test_unknown_parameter_is_refused():
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)


def test_engine_takes_engine_args_or_keywords(tiny_llama):
    a = LLMEngine(EngineArgs(model=tiny_llama, device="cpu", num_kv_blocks=16, block_size=4))
    b = LLMEngine(tiny_llama, device="cpu", num_kv_blocks=16, block_size=4)
    assert a.args == b.args and a.stats()["kv_blocks_total"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("flags, kwargs", [(["--quantization", "int4"], {"quantization": "int4"}),
                                           (["--tensor-parallel-size", "2"], {})])
def test_serve_runs_what_llm_runs(tiny_llama, served, flags, kwargs):
    """`serve --quantization int4` gives LLM(quantization="int4")'s greedy text; `--tensor-parallel-size 2` gives
    one process's."""
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2, 40, 41, 42]]
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, **kwargs)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                                                     use_tqdm=False)]
    srv = served("--model", str(tiny_llama), "--dtype", "float32", *flags)
    body = {"prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    choices = httpx.post(srv.url + "/completions", json=body, timeout=120).raise_for_status().json()["choices"]
    assert [c["text"] for c in sorted(choices, key=lambda c: c["index"])] == want


def test_bench_offline_replays_into_an_engine_built_from_the_flags(tiny_llama, tmp_path, capsys):
    from minillm.bench import main

    data = tmp_path / "work.jsonl"
    data.write_text('{"prompt": [1, 2, 3], "max_tokens": 4}\n{"prompt": "hello there", "max_tokens": 3}\n')
    argv = ["--offline", "--model", str(tiny_llama), "--device", "cpu", "--num-kv-blocks", "32", "--block-size", "4",
            "--dataset", str(data), "--ignore-eos", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"{'Successful requests:':<40} 2" in out and f"{'Total generated tokens:':<40} 7" in out
    assert main([*argv, "--max-concurrency", "1", "--request-rate", "5"]) == 2  # one pacing or the other
