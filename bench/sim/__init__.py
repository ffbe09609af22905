"""The scheduler benchmark's simulator: `scheduler.policy` replayed with a virtual clock
(simulator.py) against textbook baselines (baselines.py). Used by bench/scheduler.py and
the policy's tests; no service imports it."""
