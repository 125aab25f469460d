"""Speed as the model grows: minillm's int4 engine against llama.cpp and ik_llama.cpp on random-weight models of real
shapes (135M to 1.7B parameters), the same numbers in all three engines.

Each shape is written once as a float16 GGUF (`benchmarks/random_gguf.py`), quantized by llama.cpp's own
`llama-quantize` to Q4_1 (the embedding, which is also the tied head, to Q8_0, as in the default model's file), and
read back into minillm, where Q4_1 lands exactly on its int4 grid of group 32. A short greedy continuation from
`llama-server` and from minillm checks that the file was written and read back right: the first output's ten
likeliest tokens are nearly the same set, with log-probabilities within 0.2 nats (the greedy tokens themselves may
part at once: a random model's likeliest tokens are near-ties that rounding reorders). Then, per thread count, in
passes whose order flips every pass, each engine in its own process:

- llama.cpp and ik_llama.cpp: `llama-bench` pp128, pp512 and tg128 (ik_llama.cpp also with `-rtr 1`, its weights
  repacked at load; the better of the two counts);
- minillm: batch-1 greedy decode of 128 tokens (1 / time per output token), prefill of 128 and 512 tokens (one
  request, its first token's wall time), and decode steps at batch 16 and 32 (context 64) against their bytes floor:
  the step's weights and KV cache read once at the read bandwidth measured with the same threads just before, by
  the parent process (its array, larger than any cache, stays out of minillm's peak memory);
- peak resident memory of each process (`VmHWM`, polled).

Decode GB/s counts the bytes of weights a decode step reads (each engine's own storage); the table gives each figure
and minillm's ratio to ik_llama.cpp and llama.cpp. Threads are the same for every engine; nothing else should run.

    .venv/bin/python -m benchmarks.scaling [--shapes smollm2-135m ...] [--threads 1 2] [--rounds 2]
        [--work DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from gguf import GGUFReader

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llamacpp_build import IK_LLAMA_CPP, LLAMA_CPP, build, started, tail
from benchmarks.llamacpp_server import llama_url, wait_ready
from benchmarks.random_gguf import SHAPES, Shape, gguf_to_hf, write_gguf
from benchmarks.record import save_json
from minillm.ports import free_port

PROMPT_LENGTHS = (128, 512)
DECODE_TOKENS = 128
BATCHES = (16, 32)
BATCH_CONTEXT = 64
AGREE_TOKENS = 16
TOP = 10  # candidates of the first output compared between engines
LOGPROB_GAP = 0.2  # nats; misread weights scramble the top candidates instead
TARGETS = {"decode_vs_ik": 1.2, "bandwidth_share": 0.8, "pp512_vs_llamacpp": 1.0, "batched_vs_floor": 1.25}


# --- the files -----------------------------------------------------------------------------------------------

def prepare(shape: Shape, folder: Path, quantize: Path, threads: int) -> tuple[Path, Path]:
    """The shape's Q4_1 GGUF and the Hugging Face directory decoded from it, made unless already in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    q4, hf = folder / "q4_1.gguf", folder / "hf"
    if not q4.is_file():
        f16 = folder / "f16.gguf"
        write_gguf(shape, f16)
        log = folder / "quantize.log"
        with started([str(quantize), "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0", str(f16),
                      str(q4) + ".partial", "Q4_1", str(threads)], log) as proc:
            if proc.wait() != 0:
                raise RuntimeError(f"llama-quantize failed:\n{tail(log)}")
        Path(str(q4) + ".partial").replace(q4)
        f16.unlink()
    if not (hf / "config.json").is_file():
        gguf_to_hf(q4, shape, hf)
    return q4, hf


def agree_prompt(seed: int = 0) -> list[int]:
    """The greedy check's prompt: 16 token ids of the default tokenizer's real vocabulary, seeded."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 49152) for _ in range(16)]


def llama_greedy(server: Path, gguf: Path, threads: int, log: Path) -> dict:
    """`llama-server`'s greedy continuation of `agree_prompt()` on `gguf`, and the log-probabilities of the first
    output's top `TOP` candidates."""
    port = free_port()
    cmd = [str(server), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "256",
           "--parallel", "1", "--threads", str(threads), "--threads-batch", str(threads), "--no-webui",
           "--no-repack"]  # its plain Q4_1 kernels on every CPU (the AMX ones can die, see `bench_llama`)
    with started(cmd, log) as proc:
        wait_ready(proc, log, llama_url(port), "llama-server")
        reply = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=300,
                           json={"prompt": agree_prompt(), "n_predict": AGREE_TOKENS, "temperature": 0,
                                 "n_probs": TOP, "cache_prompt": False, "return_tokens": True, "ignore_eos": True})
        reply.raise_for_status()
        body = reply.json()
    first = body["completion_probabilities"][0]["top_logprobs"]
    return {"tokens": body["tokens"], "top": {str(c["id"]): c["logprob"] for c in first}}


def agreed(a: dict) -> bool:
    """Whether an `agreement` says the two engines ran the same numbers. Not the greedy tokens: a random model's
    likeliest tokens are near-ties (log-probabilities a few hundredths apart), which rounding may reorder."""
    return a["top_shared"] >= TOP - 2 and a["max_logprob_gap"] < LOGPROB_GAP


def agreement(ours: dict, theirs: dict) -> dict:
    """How far the two engines agree: greedy tokens before they part, the first output's top candidates they
    share, and the largest gap between the log-probabilities of those."""
    from benchmarks.llamacpp import agreeing_prefix

    shared = set(ours["top"]) & set(theirs["top"])
    return {"tokens": agreeing_prefix(ours["tokens"], theirs["tokens"]), "top_shared": len(shared),
            "max_logprob_gap": max(abs(ours["top"][i] - theirs["top"][i]) for i in shared)}


# --- one process per measurement, its peak memory kept --------------------------------------------------------

def peak_mib(pid: int) -> float:
    """A running process's peak resident memory so far in MiB (its `VmHWM`; 0 once it has gone). Read from /proc
    rather than from `wait4`'s `ru_maxrss`, which starts a child at its parent's size at fork."""
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


class Died(RuntimeError):
    """A measured program that ended on a signal, e.g. SIGILL."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_number = signal_number


def measured(cmd: list[str], log: Path, timeout: float) -> tuple[str, float]:
    """Run `cmd` to the end (killed after `timeout` s): its standard output and its peak resident memory in MiB,
    polled every 20 ms (weights stay loaded to the end, so the last reading is the peak)."""
    with open(log, "ab") as err, tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        deadline, peak = time.monotonic() + timeout, 0.0
        try:
            while proc.poll() is None:
                peak = max(peak, peak_mib(proc.pid))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s:\n{tail(log)}")
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0:
            message = f"{' '.join(cmd[:3])} … exited with status {proc.returncode}:\n{tail(log)}"
            raise Died(message, -proc.returncode) if proc.returncode < 0 else RuntimeError(message)
        out.seek(0)
        return out.read().decode(), peak


def llama_bench(cmd: list[str], log: Path) -> dict:
    """One `llama-bench` run's figures: tok/s per test (pp128, pp512, tg128) and the peak MiB."""
    text, peak = measured(cmd + ["-o", "json"], log, timeout=3600)
    figures = {"peak_mib": peak}
    for row in json.loads(text[text.index("["):]):
        figures[f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"] = row["avg_ts"]
    return figures


def bench_llama(binary: Path, gguf: Path, threads: int, rounds: int, log: Path, repack: bool = False) -> dict:
    """`llama-bench` pp128, pp512 and tg128 on `gguf` (mean tok/s over `rounds` repetitions) and its peak MiB.

    On a CPU with AMX, mainline llama.cpp repacks Q4_1 weights for its AMX kernels, and this version's AMX prefill
    dies of SIGILL on some such CPUs (a tile instruction without its tile configuration). There prefill is measured
    again without repacking (`--repack 0`, its AVX-512 kernels) and decode with it; `prefill_repacked` says which."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(rounds), *(["-rtr", "1"] if repack else [])]
    prompts, decode = ["-p", ",".join(map(str, PROMPT_LENGTHS))], ["-n", str(DECODE_TOKENS)]
    try:
        return {**llama_bench(cmd + prompts + decode, log), "prefill_repacked": True}
    except Died as e:
        if e.signal_number != signal.SIGILL:
            raise
    tg, pp = llama_bench(cmd + ["-p", "0"] + decode, log), llama_bench(cmd + prompts + ["-n", "0", "--repack", "0"], log)
    return {**pp, **tg, "peak_mib": max(pp["peak_mib"], tg["peak_mib"]), "prefill_repacked": False}


def bench_minillm(hf: Path, threads: int, rounds: int, log: Path) -> dict:
    """This module's `--child` run on the shape's directory, in a process of its own. The read bandwidth of its
    bytes floor is measured here, with the same threads, just before: its array (larger than any cache, a gigabyte
    on a server) would otherwise count in the child's peak memory."""
    import torch

    from minillm.roofline import measure_bandwidth

    torch.set_num_threads(threads)
    bandwidth = measure_bandwidth("read")
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--child", str(hf), "--threads", str(threads),
           "--rounds", str(rounds), "--bandwidth", str(bandwidth)]
    text, peak = measured(cmd, log, timeout=3600)
    return {**json.loads(text.strip().splitlines()[-1]), "peak_mib": peak}


# --- minillm's side, run as `--child` -------------------------------------------------------------------------

def child(hf: Path, threads: int, rounds: int, bandwidth: float) -> dict:
    """minillm int4 on `hf`: decode, prefill and batched figures (their bytes floor at `bandwidth` bytes/s), the
    bytes a step reads, the greedy check's tokens; printed as one JSON line."""
    import torch

    from minillm import LLM, SamplingParams
    from minillm.metrics import tpot
    from minillm.roofline import paired_steps, running_step_bytes, start_decoding, step_weight_bytes

    os.environ["MINILLM_NUM_THREADS"] = str(threads)
    tokens = max(BATCHES) * (BATCH_CONTEXT + 64)
    llm = LLM(model=str(hf), quantization="int4", quantization_group_size=32, enable_prefix_caching=False,
              max_num_seqs=max(BATCHES), num_kv_blocks=max(tokens, max(PROMPT_LENGTHS) + 64) // 16 + 64)
    engine = llm.engine
    torch.manual_seed(0)
    vocab = engine.config.vocab_size
    greedy = SamplingParams(max_tokens=AGREE_TOKENS, ignore_eos=True, logprobs=TOP)
    out = llm.generate([agree_prompt()], greedy, use_tqdm=False)[0].outputs[0]
    agree = {"tokens": list(out.token_ids), "top": {str(i): p.logprob for i, p in out.logprobs[0].items()}}

    decode = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    prompt = torch.randint(0, vocab, (16,)).tolist()
    llm.generate([prompt], decode, use_tqdm=False)  # warm-up
    tg = statistics.median(1 / tpot(llm.generate([prompt], decode, use_tqdm=False)[0].metrics)
                           for _ in range(rounds))
    figures = {"tg128": tg, "step_weight_bytes": step_weight_bytes(engine.model), "agree_tokens": agree,
               "fused_step": engine.model.fused_decode(engine.kv_cache) is not None}
    one = SamplingParams(max_tokens=1)
    for n in PROMPT_LENGTHS:
        ids = torch.randint(0, vocab, (n,)).tolist()
        llm.generate([ids], one, use_tqdm=False)  # warm-up at this length
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            llm.generate([ids], one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        figures[f"pp{n}"] = n / statistics.median(times)
    gen = torch.Generator().manual_seed(0)
    for batch in BATCHES:
        ids = start_decoding(engine, batch, BATCH_CONTEXT, gen)
        paired_steps(engine, lambda: None, 2)  # warm-up at this batch
        step = statistics.median(paired_steps(engine, lambda: None, 4 * rounds)[0])
        floor = running_step_bytes(engine) / bandwidth
        figures[f"batch{batch}_ms"], figures[f"batch{batch}_floor_ms"] = 1e3 * step, 1e3 * floor
        for rid in ids:
            engine.abort(rid)
    figures["read_bandwidth"] = bandwidth
    return figures


# --- the comparison -------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> list[dict]:
    """Every shape of `args.shapes` prepared, checked and measured; the rows, saved to `args.json` as they come."""
    llama = build(["llama-bench", "llama-quantize", "llama-server"], LLAMA_CPP, args.build_jobs)
    ik = build(["llama-bench"], IK_LLAMA_CPP, args.build_jobs)["llama-bench"]
    records = []
    if args.append and args.json is not None and args.json.is_file():  # rows of shapes not measured this time
        records = [r for r in json.loads(args.json.read_text())["records"] if r["shape"] not in args.shapes]
    for name in args.shapes:
        shape = SHAPES[name]
        folder = args.work / name
        log = folder / "run.log"
        q4, hf = prepare(shape, folder, llama["llama-quantize"], max(args.threads))
        theirs = llama_greedy(llama["llama-server"], q4, max(args.threads), log)
        gguf_weight_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(q4)).tensors)
        for threads in args.threads:
            runs: dict[str, list[dict]] = {"minillm": [], "llama.cpp": [], "ik_llama.cpp": [], "ik_llama.cpp -rtr": []}
            engines = {"minillm": lambda: bench_minillm(hf, threads, args.rounds, log),
                       "llama.cpp": lambda: bench_llama(llama["llama-bench"], q4, threads, args.rounds, log),
                       "ik_llama.cpp": lambda: bench_llama(ik, q4, threads, args.rounds, log),
                       "ik_llama.cpp -rtr": lambda: bench_llama(ik, q4, threads, args.rounds, log, repack=True)}
            for r in range(args.passes):
                order = list(engines)[::1 if r % 2 == 0 else -1]
                for engine in order:
                    print(f"{name}, {threads} thread(s), pass {r + 1}: {engine}", flush=True)
                    runs[engine].append(engines[engine]())
            record = {"shape": name, "params": shape.num_params, "threads": threads,
                      "gguf_weight_bytes": gguf_weight_bytes, "llama_greedy": theirs, "runs": runs}
            row = summarize(record)
            records = sorted(records + [row], key=lambda r: (r["threads"], r["params"]))
            print(table([row]), flush=True)
            if args.json is not None:  # kept after every row: a long run stopped early keeps what it measured
                save_json(args.json, settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                          records=records)
        if not args.keep:
            for f in hf.glob("*"):
                f.unlink()
    return records


def summarize(record: dict) -> dict:
    """Medians over passes of each engine's figures, ik_llama.cpp's better variant, and the targets' ratios."""
    med = {engine: {k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "agree_tokens"}
           for engine, runs in record["runs"].items()}
    ik_plain, ik_rtr = med.pop("ik_llama.cpp"), med.pop("ik_llama.cpp -rtr")
    med["ik_llama.cpp"] = {k: max(ik_plain[k], ik_rtr[k]) if k != "peak_mib" else ik_plain[k] for k in ik_plain}
    ours, llama, ik = med["minillm"], med["llama.cpp"], med["ik_llama.cpp"]
    agree = agreement(record["runs"]["minillm"][0]["agree_tokens"], record["llama_greedy"])
    gb = {"minillm": ours["tg128"] * ours["step_weight_bytes"] / 1e9,
          "llama.cpp": llama["tg128"] * record["gguf_weight_bytes"] / 1e9,
          "ik_llama.cpp": ik["tg128"] * record["gguf_weight_bytes"] / 1e9}
    return {**{k: v for k, v in record.items() if k != "runs"}, "runs": record["runs"], "median": med,
            "decode_gb_s": gb, "agreement": agree,
            "decode_vs_ik": ours["tg128"] / ik["tg128"], "decode_vs_llamacpp": ours["tg128"] / llama["tg128"],
            "bandwidth_share": gb["minillm"] * 1e9 / ours["read_bandwidth"],
            "pp512_vs_llamacpp": ours["pp512"] / llama["pp512"],
            "pp128_vs_llamacpp": ours["pp128"] / llama["pp128"],
            **{f"batch{b}_vs_floor": ours[f"batch{b}_ms"] / ours[f"batch{b}_floor_ms"] for b in BATCHES}}


def table(records: list[dict]) -> str:
    """One row per shape and thread count: every engine's figures and minillm's ratios."""
    lines = [f"{'shape':>13} {'params':>6} {'thr':>3} | {'tg128 tok/s (GB/s)  minillm / ik / llama.cpp':>46} | "
             f"{'pp512 tok/s  minillm / llama.cpp / ik':>38} | {'pp128 m/l':>11} | {'b16, b32 / floor':>16} | "
             f"{'peak MiB m/l/ik':>16} | agree"]
    for r in records:
        m, l, k, gb = r["median"]["minillm"], r["median"]["llama.cpp"], r["median"]["ik_llama.cpp"], r["decode_gb_s"]
        a = r["agreement"]
        lines.append(
            f"{r['shape']:>13} {r['params'] / 1e9:5.2f}B {r['threads']:3d} | "
            f"{m['tg128']:6.1f} ({gb['minillm']:4.1f}) / {k['tg128']:6.1f} ({gb['ik_llama.cpp']:4.1f}) / "
            f"{l['tg128']:6.1f}  = {r['decode_vs_ik']:4.2f}× ik, {r['bandwidth_share']:.2f} of BW | "
            f"{m['pp512']:6.1f} / {l['pp512']:6.1f} / {k['pp512']:6.1f} = {r['pp512_vs_llamacpp']:4.2f}× | "
            f"{m['pp128']:5.0f}/{l['pp128']:5.0f} | {r['batch16_vs_floor']:5.2f}, {r['batch32_vs_floor']:5.2f}     | "
            f"{m['peak_mib']:5.0f}/{l['peak_mib']:5.0f}/{k['peak_mib']:5.0f} | {a['tokens']}/{AGREE_TOKENS}, "
            f"{a['top_shared']}/{TOP} ±{a['max_logprob_gap']:.3f}")
    return "\n".join(lines)


def verdicts(records: list[dict]) -> list[str]:
    """Each target, met or missed, with the rows that miss it."""
    checks = [("decode_vs_ik", "int4 batch-1 decode ≥ 1.2× ik_llama.cpp", lambda r: True, ">="),
              ("bandwidth_share", "≥ 0.8 of the measured read bandwidth at 1B and above",
               lambda r: r["params"] >= 1e9, ">="),
              ("pp512_vs_llamacpp", "int4 prefill pp512 ≥ 1.0× llama.cpp Q4_1", lambda r: True, ">="),
              ("batch16_vs_floor", "batch 16 step within 1.25× of its bytes floor", lambda r: True, "<="),
              ("batch32_vs_floor", "batch 32 step within 1.25× of its bytes floor", lambda r: True, "<=")]
    out = [f"the engines agree (≥ {TOP - 2} of the first output's top {TOP} shared, log-probabilities within "
           f"{LOGPROB_GAP}): " + ("yes" if all(agreed(r["agreement"]) for r in records) else "NO")]
    for key, what, applies, sense in checks:
        target = TARGETS[key if not key.startswith("batch") else "batched_vs_floor"]
        rows = [r for r in records if applies(r)]
        missed = [f"{r['shape']}/{r['threads']}t {r[key]:.2f}" for r in rows
                  if (r[key] < target if sense == ">=" else r[key] > target)]
        out.append(f"{what}: {'met' if not missed else 'missed at ' + ', '.join(missed)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2, help="repetitions inside each engine's run")
    parser.add_argument("--passes", type=int, default=2, help="runs of each engine, the order flipped each pass")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minillm-scaling",
                        help="where the GGUF files and decoded directories are kept")
    parser.add_argument("--keep", action="store_true", help="keep each shape's decoded directory")
    parser.add_argument("--build-jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in --json for the shapes not measured now")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.rounds < 1 or args.passes < 1:
        parser.error("--threads, --rounds and --passes must be at least 1")
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads[0], args.rounds, args.bandwidth)))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        records = run(args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"\nminillm int4 against llama.cpp ({LLAMA_CPP.package} {LLAMA_CPP.version}) and ik_llama.cpp "
          f"({IK_LLAMA_CPP.package} {IK_LLAMA_CPP.version}) on the same Q4_1 weights; medians of {args.passes} "
          f"passes\n" + table(records))
    print("\n".join(verdicts(records)))
    if args.json is not None:
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
