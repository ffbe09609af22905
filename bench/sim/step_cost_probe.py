"""Measures the engine's step cost t(n) = a + b·n on builtin:bench, for the simulator's
batching model (bench/sim/simulator.py `BatchService`).

    python -m bench.sim.step_cost_probe [--device cpu] [--threads 1]

Runs decode batches of 1, 4, 16 and 48 sequences (short prompts, `ignore_eos`) and a few
long prefills, records every step's (tokens computed, seconds) from the engine's own
timing (the step loop's `step_cost.observe`), and fits a least-squares line over all of
them: the same fit the engine's scheduler learns (workers/engine/step_cost.py), without
its decay. Prints one JSON object with `a_s`, `b_s_per_token` and the steps it used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from workers.engine.engine import Engine, EngineConfig  # noqa: E402
from workers.model import load_model  # noqa: E402


class _Recorder:
    """Stands in for the scheduler's StepCost and keeps every (tokens, seconds)."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []

    def observe(self, x: float, y: float) -> None:
        self.steps.append((x, y))
        self.inner.observe(x, y)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def probe(device: str) -> dict:
    loaded = load_model("builtin:bench", device=device)
    rng = random.Random(0)
    config = EngineConfig(kv_memory_bytes=512 * 2**20, max_num_seqs=64)
    with Engine(loaded, config) as engine:
        engine.generate("warm-up", [1, 2, 3, 4], 4)
        scheduler = engine._loop.scheduler  # the probe's one reach inside: the step timings

        def install():
            scheduler.step_cost = _Recorder(scheduler.step_cost)
        engine.call_soon(install).result()
        for batch in (1, 4, 16, 48):  # decode-dominated steps of n tokens
            handles = [engine.submit(f"d{batch}-{i}", [rng.randrange(256) for _ in range(8)], 48, ignore_eos=True)
                       for i in range(batch)]
            for h in handles:
                h.result()
        for length in (128, 256, 512):  # prefill steps of many tokens
            engine.generate(f"p{length}", [rng.randrange(256) for _ in range(length)], 2, ignore_eos=True)
        steps = engine.call_soon(lambda: list(scheduler.step_cost.steps)).result()
    n = len(steps)
    mx = sum(x for x, _ in steps) / n
    my = sum(y for _, y in steps) / n
    b = sum((x - mx) * (y - my) for x, y in steps) / sum((x - mx) ** 2 for x, _ in steps)
    a = my - b * mx
    by_size: dict[int, list[float]] = {}
    for x, y in steps:
        by_size.setdefault(int(x), []).append(y)
    median = {k: sorted(v)[len(v) // 2] for k, v in sorted(by_size.items()) if len(v) >= 5}
    return {"model": "builtin:bench", "device": device, "threads": torch.get_num_threads(), "steps": n,
            "a_s": a, "b_s_per_token": b, "median_step_s_by_tokens": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(probe(args.device), indent=2))


if __name__ == "__main__":
    main()
