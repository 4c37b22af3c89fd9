"""bench/batches.py: the verdicts follow the definitions its docstring and bench/RESULTS.md give
(free = the batch's tokens/s alone less the interactive tokens/s beside it)."""

from bench.batches import BatchRun, Interactive, summary


def test_the_summary_measures_the_batch_against_what_the_interactive_streams_leave_free():
    alone = Interactive(ttft=[0.2] * 9 + [0.3], tokens=1200, seconds=20.0)  # 60 tokens/s
    alone.engine_ttft = [0.05] * 10
    mixed = Interactive(ttft=[0.23] * 9 + [0.5], tokens=200, seconds=20.0)  # 10 tokens/s
    mixed.engine_ttft = [0.1] * 9 + [0.4]
    results = {
        "alone": alone,
        "mixed": mixed,
        # C = 160 tokens/s; beside the streams 128. Samples: rows of each, waiting, preempted.
        "capacity": BatchRun(1000, 32000, 200.0, samples=[(64, 0, 0, 0), (62, 0, 2, 0)]),
        "beside": BatchRun(1000, 32000, 250.0, samples=[(60, 4, 4, 10), (59, 3, 4, 25)]),
        "cpu": {"B": (1.9, 1.8)},
    }
    text = "\n".join(summary(results))
    assert (
        "| B: batch alone | 200.0 | – | – | – | – | – | – | 5.00 | 160.0 | 63.0 + 0.0 | 1.0 | 0 |"
        in text
    )
    assert (
        "| M: batch + interactive | 250.0 | 10 | 0.230 | 0.476 | 0.100 | 0.373 | 10.0 | 4.00 "
        "| 128.0 | 59.5 + 3.5 | 4.0 | 15 |"
    ) in text
    assert "p50 1.15x, p99 1.63x of alone (target <= 1.2x): p50 pass, p99 FAIL." in text
    # 128 / (160 - 10) = 85.3%, where subtracting A's 60 tokens/s would claim 128%.
    assert "Free = C - I = 160.0 - 10.0 = 150.0 tokens/s; the batch used 128.0: 85.3%" in text
    assert "(target >= 80%): pass." in text
    assert "- CPU while B ran, in cores busy of" in text
