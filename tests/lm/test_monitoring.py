"""Tests for lmhead/lm/monitoring.py: the metric files, step timings,
memory and the summary's keys."""

import json
import os

import ml_collections
import pytest

from lmhead.lm import monitoring


class TestMetricWriter:
    def test_a_resumed_run_drops_the_records_after_its_checkpoint(self, tmp_path):
        workdir = str(tmp_path)
        writer = monitoring.MetricWriter(workdir, resume_step=0)
        for step in (10, 20, 30):
            writer.write(step, {"train/loss": float(step)})
        writer.close()
        resumed = monitoring.MetricWriter(workdir, resume_step=20)
        resumed.write(30, {"train/loss": 3.0})
        resumed.close()
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert records == [
            {"step": 10, "train/loss": 10.0},
            {"step": 20, "train/loss": 20.0},
            {"step": 30, "train/loss": 3.0},
        ]
        assert resumed.records == records
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(workdir))


class TestStepTimer:
    def test_laps_and_percentiles(self):
        timer = monitoring.StepTimer()
        assert timer.percentiles_ms() == {}
        timer.start()
        for _ in range(3):
            timer.step_done()
        seconds = timer.lap(3)
        assert timer.steps == 3 and timer.wall == seconds >= 0
        assert len(timer.step_seconds) == 3
        timer.step_seconds = [0.001, 0.002, 0.003, 0.010]
        assert timer.percentiles_ms(2) == pytest.approx(
            {"step_ms_p50": 6.5, "step_ms_p90": 9.3}
        )


def test_memory_metrics():
    metrics = monitoring.memory_metrics()
    assert set(metrics) <= set(monitoring.MEASURED_METRICS)
    assert metrics["memory/host_peak_rss_bytes"] >= metrics.get(
        "memory/host_rss_bytes", 0
    )


class TestSummaries:
    def test_best_summary(self):
        config = ml_collections.ConfigDict(
            {"train": {"patience": 0, "eval_train_batches": 1, "steps": 20}}
        )
        records = [
            {"step": 10, "eval/loss": 2.0, "train_eval/loss": 1.5},
            {"step": 20, "eval/loss": 1.0, "train_eval/loss": 0.5},
        ]
        assert monitoring.best_summary(config, records, 20) == {
            "best_step": 20,
            "best": {"eval/loss": 1.0},
            "train_at_best": {"train_eval/loss": 0.5},
            "steps_run": 20,
            "stopped_early": False,
        }
