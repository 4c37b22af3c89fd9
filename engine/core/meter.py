"""An engine's running figures for `EngineStats`: steps, prompt and generated tokens, throughput
over a sliding window and a smoothed step time.

Apart from the loop (engine/core/loop.py) because it is arithmetic over what the steps report,
not part of how the thread runs them; the loop adds the queue and cache figures it owns.
"""

from __future__ import annotations

import time
from collections import deque

from engine.core.scheduler import SchedulerOutput
from engine.protocol import EngineStats

THROUGHPUT_WINDOW_S = 10.0


class Meter:
    """Throughput over a sliding window and a smoothed step time; written by the engine thread."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._step_time_s = 0.0
        self._recent: deque[tuple[float, int]] = deque()

    def record_step(self, elapsed_s: float, plan: SchedulerOutput, num_sampled: int) -> None:
        now = time.monotonic()
        self.num_steps += 1
        self.num_prompt_tokens += sum(chunk.num_tokens for chunk in plan.prefill)
        self._step_time_s = (
            elapsed_s if self.num_steps == 1 else 0.9 * self._step_time_s + 0.1 * elapsed_s
        )
        self._recent.append((now, num_sampled))
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def snapshot(self, model: str, num_waiting: int, num_running: int) -> EngineStats:
        recent = list(self._recent)
        tokens_per_second = 0.0
        if len(recent) > 1 and recent[-1][0] > recent[0][0]:
            tokens_per_second = sum(n for _, n in recent[1:]) / (recent[-1][0] - recent[0][0])
        return EngineStats(
            model=model,
            num_waiting=num_waiting,
            num_running=num_running,
            tokens_per_second=tokens_per_second,
            step_time_ms=self._step_time_s * 1000.0,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
        )
