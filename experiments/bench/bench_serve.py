r"""Latency and throughput of the HTTP service, over loopback.

    python experiments/bench/bench_serve.py --workdir=runs/nanogpt_tied
    python experiments/bench/bench_serve.py --quick   # a tiny run trained here, seconds

Starts ``experiments/serve.py`` on 127.0.0.1 (a free port) and sends the same
``--requests`` sampled requests (one prompt, ``--max_new_tokens`` each) from
1, 4 and 16 concurrent clients. For each it prints p50 and p99 latency, and
generated tokens per second over the wall time; the ratio column divides by
the 1-client row, which serves the requests one at a time, so at 16 clients
it is the gain from dynamic batching. The machine's float32 matmul rate
(``timing.matmul_rate``), measured in the same run, says how fast the machine
was. The results and the machine they were measured on are in
``docs/serving.md``.
"""

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

flags.DEFINE_string(
    "workdir",
    None,
    "A training run's directory; without it, --quick trains a tiny one.",
)
flags.DEFINE_bool(
    "quick",
    False,
    "A tiny run (trained here unless --workdir), "
    "8 new tokens and, unless --requests, 32 requests per row.",
)
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
flags.DEFINE_integer("matmul_size", 1024, "Side of the timed float32 matmul.")
FLAGS = flags.FLAGS


def tiny_run(workdir: str) -> str:
    config = configuration.load_config("tiny")
    config.update_from_flattened_dict({"train.steps": 20, "sample.num_samples": 0})
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


def measure(url: str, num_clients: int, body: dict) -> dict:
    """Latencies and tokens of ``FLAGS.requests`` requests from ``num_clients``
    threads, each with a connection opened before the clock starts."""
    remaining = iter(range(FLAGS.requests))
    claim = threading.Lock()
    ready = threading.Barrier(num_clients + 1)
    results = []

    def client():
        with httpx.Client(timeout=600) as session:
            session.get(url + "/healthz").raise_for_status()
            ready.wait()
            while True:
                with claim:
                    if next(remaining, None) is None:
                        return
                start = time.perf_counter()
                response = session.post(url + "/v1/generate", json=body)
                response.raise_for_status()
                length = response.json()["completions"][0]["length"]
                results.append((time.perf_counter() - start, length))

    threads = [threading.Thread(target=client) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    before = batch_rows(url)
    ready.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    rows, batches = np.subtract(batch_rows(url), before)
    latencies = np.array([r[0] for r in results])
    return {
        "p50": np.percentile(latencies, 50),
        "p99": np.percentile(latencies, 99),
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "rows_per_batch": rows / max(batches, 1),
    }


def batch_rows(url: str) -> tuple[float, float]:
    """Rows and batches the service has run so far, from /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return (
        values.get('lmhead_batch_rows_sum{kind="sample"}', 0.0),
        values.get('lmhead_batch_rows_count{kind="sample"}', 0.0),
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    if FLAGS.quick:
        FLAGS.max_new_tokens = 8
        FLAGS.requests = FLAGS.requests if FLAGS["requests"].present else 32
    elif not FLAGS.workdir:
        raise app.UsageError("Give --workdir=RUN, or --quick.")
    with tempfile.TemporaryDirectory() as scratch:
        workdir = FLAGS.workdir or tiny_run(os.path.join(scratch, "run"))
        extra = ["--prompt_lengths=8", "--new_tokens=8"] if FLAGS.quick else []
        process, url = start_server(workdir, extra)
        try:
            body = {
                "prompt": FLAGS.prompt,
                "max_new_tokens": FLAGS.max_new_tokens,
                "temperature": FLAGS.temperature,
            }
            measure(url, 4, body)  # the first requests of a process run slower
            rows = {c: measure(url, c, body) for c in CLIENTS}
        finally:
            process.terminate()
            process.wait()
    rate = timing.matmul_rate(FLAGS.matmul_size)
    print(
        f"\n{FLAGS.requests} requests per row, {FLAGS.max_new_tokens} new tokens "
        f"each; float32 matmul {rate / 1e9:.0f} GFLOP/s\n"
    )
    print(
        "| clients | p50 latency (ms) | p99 latency (ms) | tokens/s | vs one at "
        "a time | rows per batch |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for clients, row in rows.items():
        print(
            f"| {clients} | {row['p50'] * 1e3:.1f} | {row['p99'] * 1e3:.1f} | "
            f"{row['tokens_per_s']:.0f} | "
            f"{row['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x | "
            f"{row['rows_per_batch']:.1f} |"
        )


if __name__ == "__main__":
    app.run(main)
