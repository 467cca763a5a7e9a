r"""Latency and throughput of the HTTP service, over loopback.

    python experiments/bench/bench_serve.py --workdir=runs/nanogpt_tied
    python experiments/bench/bench_serve.py --quick   # a tiny run trained here, 8 new tokens, 32 requests a row: seconds
    python experiments/bench/bench_serve.py --quick --streamed

``experiments/serve.py`` on 127.0.0.1, sent the same sampled
``/v1/completions`` requests from 1, 4 and 16 concurrent clients (p50 and
p99 latency, tokens/s, the ratio to one client at a time), or with
``--streamed`` streamed completions of mixed lengths (tokens/s, latencies,
time to first token, start-up cold and warm). ``docs/benchmarks.md`` says
how; ``docs/serving.md`` has the results.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags, logging

from lmhead.lm import configuration, train

# experiments/bench/ -> the repository, where experiments/serve.py runs.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENTS = (1, 4, 16)

timing.cli.workdir_flag(required=False)  # without it, --quick trains one
timing.cli.quick_flag()
flags.DEFINE_integer("requests", 128, "Requests per row of the table.", lower_bound=1)
flags.DEFINE_integer(
    "max_new_tokens",
    32,
    "Tokens per request (at most the service's cap).",
    lower_bound=1,
)
flags.DEFINE_string("prompt", "ROMEO:", "The prompt of every request.")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature of every request.")
flags.DEFINE_integer("startup_timeout_s", 900, "How long to wait for the warm-up.")
timing.cli.matmul_size_flag(1024)
flags.DEFINE_bool(
    "streamed",
    False,
    "Streamed completions of mixed lengths, and start-up times.",
)
flags.DEFINE_integer("clients", 16, "Concurrent clients of --streamed.")
flags.DEFINE_integer("min_tokens", 8, "Least max_tokens of --streamed.")
flags.DEFINE_integer("max_tokens", 128, "Most max_tokens of --streamed.")
flags.DEFINE_bool(
    "ignore_eos",
    True,
    "Every request runs to its max_tokens past the end-of-text token (vLLM's "
    "ignore_eos), so that each generates the tokens asked of it; "
    "--noignore_eos for a server that predates the token and the extension.",
)
flags.DEFINE_integer(
    "unmeasured_passes",
    2,
    "Passes of the same requests before the measured one, per server.",
    lower_bound=0,
)
SHORT = 16  # the requests whose p99 latency --streamed reports
FLAGS = flags.FLAGS


def tiny_run(workdir: str, block_size: int | None = None) -> str:
    config = configuration.load_config("tiny")
    config.update_from_flattened_dict({"train.steps": 20, "sample.num_samples": 0})
    if block_size is not None:
        config.data.block_size = block_size
    train.train_and_evaluate(config, workdir)
    return workdir


def start_server(workdir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``experiments/serve.py`` on 127.0.0.1, once it listens, and its URL."""
    process = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "experiments", "serve.py"),
            f"--workdir={workdir}",
            "--host=127.0.0.1",
            "--port=0",
            "--beam_sizes=",
            "--max_queue=256",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(FLAGS.startup_timeout_s, process.kill)
    timer.start()
    for line in process.stdout:
        print("  server:", line.rstrip(), flush=True)
        if line.startswith("serving on "):
            timer.cancel()
            return process, line.split()[-1]
    timer.cancel()
    raise RuntimeError(f"serve.py exited with {process.wait()} before listening.")


def run_clients(url: str, items, num_clients: int, send) -> tuple[list, float]:
    """Sends ``send(session, item)`` for each of ``items`` from ``num_clients``
    threads, each with a connection opened before the clock starts; returns
    what the calls returned and the wall time from the start to the last."""
    remaining = iter(items)
    claim, ready = threading.Lock(), threading.Barrier(num_clients + 1)
    results = []

    def client():
        with httpx.Client(timeout=600) as session:
            session.get(url + "/healthz").raise_for_status()
            ready.wait()
            while True:
                with claim:
                    item = next(remaining, None)
                if item is None:
                    return
                results.append(send(session, item))

    threads = [threading.Thread(target=client) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def request_body(max_tokens: int, **fields) -> dict:
    """A sampled ``/v1/completions`` request of ``FLAGS.prompt`` for
    ``max_tokens`` tokens, with ``ignore_eos`` where ``FLAGS.ignore_eos``."""
    body = {
        "model": "lmhead",
        "prompt": FLAGS.prompt,
        "max_tokens": max_tokens,
        "temperature": FLAGS.temperature,
        **fields,
    }
    if FLAGS.ignore_eos:
        body["ignore_eos"] = True
    return body


def measure(url: str, num_clients: int, body: dict) -> dict:
    """Latencies and tokens of ``FLAGS.requests`` requests to /v1/completions
    from ``num_clients`` clients."""

    def send(session, _):
        start = time.perf_counter()
        response = session.post(url + "/v1/completions", json=body)
        response.raise_for_status()
        length = response.json()["usage"]["completion_tokens"]
        return time.perf_counter() - start, length

    results, wall = run_clients(url, range(FLAGS.requests), num_clients, send)
    p50, p99 = np.percentile([r[0] for r in results], [50, 99])
    return {"p50": p50, "p99": p99, "tokens_per_s": sum(r[1] for r in results) / wall}


def stream_completion(session: httpx.Client, url: str, body: dict) -> tuple:
    """``(latency, time to first token, completion tokens)`` of one streamed
    completion."""
    start, first, tokens = time.perf_counter(), None, 0
    with session.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if first is None and any(c["text"] for c in chunk["choices"]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - start, first, tokens


def load(url: str, lengths: list[int], num_clients: int) -> dict:
    """Streams one completion per entry of ``lengths`` (its ``max_tokens``)
    from ``num_clients`` clients; the table's row."""

    def send(session, item):
        index, max_tokens = item
        body = request_body(
            max_tokens,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
        )
        return (max_tokens, *stream_completion(session, url, body))

    results, wall = run_clients(url, enumerate(lengths), num_clients, send)
    latency = [r[1] for r in results]
    first = [r[2] for r in results if r[2] is not None]
    short = [r[1] for r in results if r[0] <= SHORT]
    return {
        "tokens_per_s": sum(r[3] for r in results) / wall,
        **dict(zip(("p50", "p99"), np.percentile(latency, [50, 99]))),
        "short_p99": np.percentile(short, 99) if short else float("nan"),
        **dict(zip(("ttft_p50", "ttft_p99"), np.percentile(first, [50, 99]))),
    }


def streamed(workdir: str, extra: list[str], scratch: str) -> None:
    """The streamed load's row, with cold and warm start-up times."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(FLAGS.min_tokens, FLAGS.max_tokens + 1, FLAGS.requests)
    starts = {}
    flags_ = [*extra, f"--compilation_cache={os.path.join(scratch, 'xla_cache')}"]
    for start in ("cold", "warm"):
        began = time.perf_counter()
        process, url = start_server(workdir, flags_)
        starts[start] = time.perf_counter() - began
        try:
            if start == "warm":
                for _ in range(FLAGS.unmeasured_passes):
                    load(url, lengths.tolist(), FLAGS.clients)
                row = load(url, lengths.tolist(), FLAGS.clients)
        finally:
            process.terminate()
            process.wait()
    rate = timing.Matmul(FLAGS.matmul_size).rate()
    print(
        f"\n{timing.machine()}; {FLAGS.requests} streamed completions, max_tokens drawn from "
        f"{FLAGS.min_tokens}..{FLAGS.max_tokens}, {FLAGS.clients} clients; "
        f"float32 matmul {rate / 1e9:.0f} GFLOP/s\n"
    )
    header = ["tokens/s", "p50 latency (s)", "p99 latency (s)"]
    header += [f"p99 latency, max_tokens <= {SHORT} (s)"]
    header += ["time to first token p50 / p99 (s)", "start-up cold / warm (s)"]
    cells = [f"{row['tokens_per_s']:.0f}", f"{row['p50']:.2f}", f"{row['p99']:.2f}"]
    cells += [
        f"{row['short_p99']:.2f}",
        f"{row['ttft_p50']:.3f} / {row['ttft_p99']:.3f}",
    ]
    cells += [f"{starts['cold']:.1f} / {starts['warm']:.1f}"]
    print(timing.table(header, [cells], "---:"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    if FLAGS.quick:
        FLAGS.max_new_tokens = 8
        FLAGS.requests = FLAGS.requests if FLAGS["requests"].present else 32
    elif not FLAGS.workdir:
        raise app.UsageError("Give --workdir=RUN, or --quick.")
    if FLAGS.streamed:
        with tempfile.TemporaryDirectory() as scratch:
            block = 8 + FLAGS.max_tokens if FLAGS.quick else None
            workdir = FLAGS.workdir or tiny_run(os.path.join(scratch, "run"), block)
            extra = ["--prompt_lengths=8"] if FLAGS.quick else []
            streamed(workdir, extra, scratch)
        return
    with tempfile.TemporaryDirectory() as scratch:
        workdir = FLAGS.workdir or tiny_run(os.path.join(scratch, "run"))
        extra = ["--prompt_lengths=8", "--new_tokens=8"] if FLAGS.quick else []
        process, url = start_server(workdir, extra)
        try:
            body = request_body(FLAGS.max_new_tokens)
            measure(url, 4, body)  # the first requests of a process run slower
            rows = {c: measure(url, c, body) for c in CLIENTS}
        finally:
            process.terminate()
            process.wait()
    rate = timing.Matmul(FLAGS.matmul_size).rate()
    print(
        f"\n{timing.machine()}; {FLAGS.requests} requests per row, {FLAGS.max_new_tokens} new tokens "
        f"each; float32 matmul {rate / 1e9:.0f} GFLOP/s\n"
    )
    header = ["clients", "p50 latency (ms)", "p99 latency (ms)", "tokens/s"]
    lines = [
        (clients, f"{row['p50'] * 1e3:.1f}", f"{row['p99'] * 1e3:.1f}",
         f"{row['tokens_per_s']:.0f}",
         f"{row['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x")
        for clients, row in rows.items()
    ]  # fmt: skip
    print(timing.table([*header, "vs one at a time"], lines, "---:"))


if __name__ == "__main__":
    app.run(main)
