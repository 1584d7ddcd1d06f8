"""``mmgrpo bench flow-modes`` figures on small inputs: the loop overhead against the pure transformer time of the
same calls, and the call shapes the clock records."""

import pytest
import torch

from mmgrpo.pipelines.flow.bench import ModelClock, median_raw, overheads, pure_seconds


def test_loop_overhead_divides_by_the_raw_time_of_the_same_calls():
    rounds = [{(8, False): 0.05, (8, True): 0.20},
              {(8, False): 0.07, (8, True): 0.30, (4, False): 0.04},  # a shape first seen in this round
              {(8, False): 0.06, (8, True): 0.25}]
    raw = median_raw(rounds)
    assert raw == {(8, False): 0.06, (8, True): 0.25, (4, False): 0.04}
    calls = {(8, False): 10, (8, True): 2, (4, False): 5}  # 10 forwards, 2 forwards + backwards, 5 small forwards
    assert pure_seconds(calls, raw) == pytest.approx(10 * 0.06 + 2 * 0.25 + 5 * 0.04)  # 1.3 s
    runs = [{"seconds": 1.43, "model_s": 1.375, "calls": calls},
            {"seconds": 1.56, "model_s": 1.5, "calls": calls},
            {"seconds": 2.60, "model_s": 2.0, "calls": {(8, False): 20, (8, True): 4, (4, False): 10}}]
    figures = overheads(runs, raw)
    # iteration over pure time: 1.10, 1.20, 1.00 -> median 1.10; over the in-loop model time: 1.04, 1.04, 1.30
    assert figures["loop_overhead"] == pytest.approx(1.10)
    assert figures["inloop_overhead"] == pytest.approx(1.04)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, hidden_states):
        return self.proj(hidden_states)


def test_clock_records_every_call_by_rows_and_grad():
    model = Tiny()
    clock = ModelClock(model)
    with torch.no_grad():
        model(torch.zeros(4, 3))
        model(hidden_states=torch.zeros(8, 3))
    model(torch.zeros(4, 3)).sum().backward()
    model(torch.zeros(4, 3))
    assert clock.calls == {(4, False): 1, (8, False): 1, (4, True): 2} and clock.seconds > 0
