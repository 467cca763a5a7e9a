"""experiments/dpo_shakespeare.py, a short run: DPO through the fused head
on Shakespeare pairs raises the reward margin and accuracy on its pairs."""

import re

from tests import run_experiment


def test_reward_margin_and_accuracy_rise():
    result = run_experiment(
        "dpo_shakespeare.py", "--pairs=16", "--steps=20", "--log_every=10", timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = re.findall(
        r"^step (\d+): loss (\S+) margin (\S+) accuracy (\S+)$", result.stdout, re.M
    )
    assert [int(step) for step, *_ in logged] == [0, 10, 20]
    (_, loss_0, margin_0, _), *_, (_, loss_n, margin_n, accuracy_n) = logged
    # The policy starts as its reference: every reward is 0, the loss log 2.
    assert float(loss_0) == 0.6931 and abs(float(margin_0)) < 1e-3
    assert float(margin_n) > 0.1 and float(loss_n) < float(loss_0)
    assert float(accuracy_n) >= 0.75
