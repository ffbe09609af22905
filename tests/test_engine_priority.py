"""Priority under continuous batching: a higher class's steps stay short while lower
classes ride along (the step-cost guard), and a waiting higher-class sequence takes the
slot of a running lower one. The scheduler on its own, with a step cost it is given,
then the real engine."""

from __future__ import annotations

import math
import threading

from kvfleet.contracts import Sampling
from kvfleet.settings import EngineConfig
from workers.engine import Engine
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import Sequence
from workers.engine.step_cost import StepCost
from workers.model import load_model

HIGH, NORMAL, LOW = 0, 1, 2
_order = iter(range(10**9))


def seq(rid: str, rank: int, prompt_len: int = 8, max_new: int = 64) -> Sequence:
    order = next(_order)
    # Distinct prompts (no prefix shared through the block cache): each starts with its own token.
    return Sequence(rid, [1000 + order] + list(range(1, prompt_len)), max_new, Sampling(), priority_rank=rank, stop=(),
                    ignore_eos=True, arrival_order=order)


def cost(a: float, b: float) -> StepCost:
    """A step cost that has seen steps of exactly a + b·n seconds."""
    c = StepCost(min_steps=2)
    for n in (1, 8, 64, 256):
        c.observe(n, a + b * n)
    return c


def scheduler(step_cost: StepCost, *, slack: float = 0.25, max_num_seqs: int = 64, num_blocks: int = 512) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, "fp"), max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                     eos_token_ids=frozenset(), priority_step_slack=slack, step_cost=step_cost)


def run(s: Scheduler) -> ScheduledBatch:
    """One step: schedule, then as if the model sampled token 9 for each finished prefill."""
    batch = s.schedule()
    s.postprocess(batch, [[9] if n == q.num_uncomputed_tokens else []
                          for q, n in zip(batch.seqs, batch.num_new_tokens)])
    return batch


def tokens_of(batch: ScheduledBatch, rank: int) -> int:
    return sum(n for q, n in zip(batch.seqs, batch.num_new_tokens) if q.priority_rank == rank)


def test_step_cost_fits_the_line_and_bounds_the_extra_tokens():
    c = cost(a=0.004, b=0.0001)  # 4 ms a step, 0.1 ms a token: a CPU
    a, b = c.fit()
    assert math.isclose(a, 0.004, rel_tol=1e-6) and math.isclose(b, 0.0001, rel_tol=1e-6)
    # One decode token alone: 4.1 ms; 25% more is ~1 ms, i.e. 10 tokens.
    assert c.extra_tokens(1, 0.25) == 10
    assert c.extra_tokens(1, math.inf) is None  # no guard
    assert StepCost(min_steps=2).extra_tokens(1, 0.25) is None  # nothing learnt yet
    flat = StepCost(min_steps=2)
    for _ in range(4):
        flat.observe(16, 0.002)
    assert flat.extra_tokens(1, 0.25) is None  # one step size: no slope to go by
    gpu = cost(a=0.010, b=0.0)  # a token costs nothing: lower classes ride along freely
    assert gpu.extra_tokens(1, 0.25) is None


def test_lower_classes_fill_a_step_only_within_the_slack_and_are_never_starved():
    s = scheduler(cost(a=0.004, b=0.0001))
    lows = [seq(f"low-{i}", LOW) for i in range(40)]
    for q in lows:
        s.add(q)
    first = run(s)  # only one class in the engine: no guard, all 40 prefill at once
    assert tokens_of(first, LOW) == 40 * 8
    online = seq("online", NORMAL)
    s.add(online)
    guarded = [run(s) for _ in range(6)]
    for batch in guarded:
        assert online in batch.seqs
        # What the normal sequence computes plus what the guard lets the low ones add:
        # 8 prefill tokens alone cost 4.8 ms, 25% more is 12 tokens; then 1 alone, 10 more.
        assert tokens_of(batch, LOW) <= 12 and tokens_of(batch, LOW) >= 1
    assert s.guarded_steps == 6
    # Held back, not pushed out: every low sequence keeps its blocks and its slot.
    assert all(q in s.running for q in lows)
    for _ in range(64):
        if online.is_finished:
            break
        run(s)
    assert online.is_finished
    # The guard's tokens went to the oldest low sequences (service order): some finished.
    still = [q for q in lows if not q.is_finished]
    assert 0 < len(still) < len(lows)
    after = run(s)  # the normal one is gone: low runs unguarded again
    assert tokens_of(after, LOW) == len(still)


def test_without_a_guard_every_class_shares_the_step():
    s = scheduler(cost(a=0.004, b=0.0001), slack=math.inf)
    for i in range(40):
        s.add(seq(f"low-{i}", LOW))
    s.add(seq("online", NORMAL))
    batch = run(s)
    assert tokens_of(batch, LOW) == 40 * 8 and tokens_of(batch, NORMAL) == 8 and s.guarded_steps == 0


def test_a_waiting_higher_class_sequence_takes_a_lower_ones_slot():
    s = scheduler(cost(a=0.004, b=0.0001), max_num_seqs=4)
    lows = [seq(f"low-{i}", LOW) for i in range(4)]
    for q in lows:
        s.add(q)
    run(s)
    assert len(s.running) == 4
    high = seq("high", HIGH)
    s.add(high)
    batch = run(s)
    assert high in batch.seqs and high in s.running
    assert s.num_priority_preemptions == 1
    victim = lows[-1]  # the newest of the lowest class
    assert victim in s.waiting and victim.num_preemptions == 1
    # A lower-class sequence never preempts a higher one.
    s.add(seq("late-low", LOW))
    run(s)
    assert high in s.running and s.num_priority_preemptions == 1


def test_a_higher_class_sequence_preempts_for_blocks_too():
    # 8 blocks of 4 tokens: two 12-token low prompts (3 blocks + 1 to grow each) fill it.
    s = scheduler(cost(a=0.004, b=0.0001), num_blocks=8)
    lows = [seq(f"low-{i}", LOW, prompt_len=14) for i in range(2)]
    for q in lows:
        s.add(q)
    run(s)
    high = seq("high", HIGH, prompt_len=14)
    s.add(high)
    assert not s.block_manager.can_allocate(high)
    run(s)
    assert high in s.running and lows[1] in s.waiting


def test_the_engine_serves_a_normal_request_beside_a_busy_low_class_exactly():
    # Through the real engine and model: the guard changes when tokens are computed,
    # never which tokens. Greedy output beside 24 busy low sequences equals it alone.
    model = load_model("builtin:tiny", device="cpu")
    prompt = model.tokenizer.encode("An online request among batch lines")
    greedy = Sampling(temperature=0.0)
    with Engine(model, EngineConfig(kernels="torch")) as engine:
        alone = engine.generate("alone", prompt, 12, greedy).tokens
        stop = threading.Event()

        def low(k: int) -> None:
            j = 0
            while not stop.is_set():
                engine.generate(f"low-{k}-{j}", model.tokenizer.encode(f"batch line {k} {j}"), 8, greedy,
                                priority_rank=LOW)
                j += 1

        threads = [threading.Thread(target=low, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        try:
            # Wait until the engine has learnt its step cost and low work is running.
            scheduler_ = engine._loop.scheduler
            while scheduler_.step_cost.fit() is None or not scheduler_.running:
                threading.Event().wait(0.01)
            beside = [engine.generate(f"online-{i}", prompt, 12, greedy, priority_rank=NORMAL).tokens
                      for i in range(5)]
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert all(tokens == alone for tokens in beside)
        assert scheduler_.guarded_steps > 0
        assert engine.stats().running == 0
