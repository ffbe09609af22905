"""The engine's step budget (workers/engine/scheduler.py): chunked prefill, and the
prefill a step takes while sequences are decoding (within `decode_step_slack` of the
decodes alone). The scheduler on its own, with a step cost it is given, first; then the
real engine with a model, whose tokens the bound must not change."""

from __future__ import annotations

import math
import threading

import pytest

from kvfleet.contracts import Sampling
from kvfleet.settings import EngineConfig
from workers.engine import Engine
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import Sequence
from workers.engine.step_cost import StepCost
from workers.model import LoadedModel, load_model

_order = iter(range(10**9))


class FixedCost(StepCost):
    """A step cost that has seen steps of exactly a + b·n seconds and learns nothing
    more (the real engine's steps would move it: the test sets the cost, not the clock)."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__(min_steps=2)
        for n in (1, 8, 64, 256):
            super().observe(n, a + b * n)

    def observe(self, x: float, y: float) -> None:
        pass


#: 4 ms a step and 0.1 ms a token; slack 1.6: one decode alone takes 4.1 ms, and 6.56 ms
#: more is 65 prefill tokens beside it; two decodes, 4.2 ms: 67.
CPU = FixedCost(a=0.004, b=0.0001)
SLACK = 1.6


def seq(rid: str, prompt_len: int, max_new: int = 64, rank: int = 1) -> Sequence:
    order = next(_order)
    # Distinct prompts (no prefix shared through the block cache): each starts with its own token.
    return Sequence(rid, [1000 + order] + list(range(1, prompt_len)), max_new, Sampling(), priority_rank=rank,
                    stop=(), ignore_eos=True, arrival_order=order)


def scheduler(*, slack: float = SLACK, budget: int = 2048, step_cost: StepCost = CPU) -> Scheduler:
    return Scheduler(BlockManager(1024, 16, "fp"), max_num_seqs=64, max_num_batched_tokens=budget,
                     eos_token_ids=frozenset(), step_cost=step_cost, decode_step_slack=slack)


def run(s: Scheduler) -> ScheduledBatch:
    """One step: schedule, then as if the model sampled token 9 for each sequence that
    reached the end of its tokens."""
    batch = s.schedule()
    s.postprocess(batch, [[9] if n == q.num_uncomputed_tokens else []
                          for q, n in zip(batch.seqs, batch.num_new_tokens)])
    return batch


def tokens(batch: ScheduledBatch) -> dict[str, int]:
    return {q.request_id: n for q, n in zip(batch.seqs, batch.num_new_tokens)}


def test_the_bound_is_the_slack_over_the_decodes_alone():
    assert CPU.extra_tokens(1, SLACK) == 65 and CPU.extra_tokens(2, SLACK) == 67


def test_a_step_with_a_decode_bounds_the_prefill_beside_it():
    s = scheduler()
    short = seq("short", prompt_len=8)
    s.add(short)
    run(s)
    assert short.is_decoding
    long = seq("long", prompt_len=200)
    s.add(long)
    # 200 tokens beside one decode: chunks of 65 (the last, 5, samples its first token).
    chunks = [tokens(run(s)) for _ in range(4)]
    assert chunks == [{"short": 1, "long": 65}] * 3 + [{"short": 1, "long": 5}]
    assert long.is_decoding and long.num_completion_tokens == 1
    # More decodes make a longer step alone, and more prefill fits beside them.
    s.add(seq("next", prompt_len=200))
    assert tokens(run(s)) == {"short": 1, "long": 1, "next": 67}


def test_without_a_decode_a_prefill_takes_the_whole_budget():
    s = scheduler()
    for rid, n in (("a", 300), ("b", 500)):
        s.add(seq(rid, prompt_len=n))
    assert tokens(run(s)) == {"a": 300, "b": 500}
    # Past the budget a prompt is still chunked by the budget itself.
    s = scheduler(budget=256)
    s.add(seq("c", prompt_len=300))
    assert [tokens(run(s)) for _ in range(2)] == [{"c": 256}, {"c": 44}]


def test_new_prompts_share_the_bound_and_wait_for_the_next_step_past_it():
    s = scheduler()
    s.add(seq("decoder", prompt_len=8))
    run(s)
    for rid in ("p1", "p2", "p3"):
        s.add(seq(rid, prompt_len=40))
    # p1 whole, p2 the 25 tokens left of the 65, p3 waits.
    assert tokens(run(s)) == {"decoder": 1, "p1": 40, "p2": 25}
    assert [q.request_id for q in s.waiting] == ["p3"]
    # Then two decode (67 beside them): p2 ends its prompt (15) and p3 fits whole (40).
    assert tokens(run(s)) == {"decoder": 1, "p1": 1, "p2": 15, "p3": 40}


def test_a_prompt_that_outranks_every_decode_takes_the_whole_budget():
    """The bound spares the decodes ahead of a prompt in service order: a high prompt
    beside batch lines' decodes is not spread over steps for their sake."""
    s = scheduler()
    s.add(seq("batch", prompt_len=8, rank=2))
    run(s)
    s.add(seq("online", prompt_len=500, rank=0))
    assert tokens(run(s)) == {"online": 500, "batch": 1}


def test_a_decode_ahead_holds_the_prompt_to_the_bound_of_all_the_decodes():
    s = scheduler()
    for rid, rank in (("online-decoder", 0), ("batch", 2)):
        s.add(seq(rid, prompt_len=8, rank=rank))
    run(s)
    s.add(seq("online", prompt_len=200, rank=0))
    # An online decode is ahead of it: 67 tokens, the bound beside two decodes.
    assert tokens(run(s)) == {"online-decoder": 1, "online": 67, "batch": 1}


def test_prompts_behind_the_decodes_share_what_an_outranking_prompt_left():
    s = scheduler()
    s.add(seq("batch-decoder", prompt_len=8, rank=2))
    run(s)
    s.add(seq("online", prompt_len=50, rank=0))
    s.add(seq("batch", prompt_len=40, rank=2))
    # online, ahead of the decode, takes 50; the batch prompt, behind it, gets the 15
    # left of the bound of 65 the step's prefill may hold beside one decode.
    assert tokens(run(s)) == {"online": 50, "batch-decoder": 1, "batch": 15}


@pytest.mark.parametrize("slack, step_cost", [(math.inf, CPU), (SLACK, StepCost()),  # off; no fit yet
                                              (SLACK, FixedCost(a=0.010, b=0.0))])  # a token costs nothing
def test_no_bound_without_a_slack_a_fit_or_a_slope(slack, step_cost):
    s = scheduler(slack=slack, step_cost=step_cost)
    s.add(seq("decoder", prompt_len=8))
    run(s)
    s.add(seq("long", prompt_len=1000))
    assert tokens(run(s)) == {"decoder": 1, "long": 1000}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", device="cpu", dtype="float32")


def _long_beside_a_decode(engine: Engine, long_prompt: list[int]) -> tuple[list[int], list[int], int]:
    """A long prompt submitted once a short request is decoding, so that its chunks share
    steps with that decode: both requests' greedy tokens, and the short one's tokens
    from the long one's submission to its first token (one a step)."""
    events: list[str] = []  # appended on the step thread, in token order
    decoding = threading.Event()

    def on_short(_: int) -> None:
        events.append("short")
        decoding.set()

    short = engine.submit("short", [5, 6, 7, 8], 200, ignore_eos=True, on_token=on_short)
    assert decoding.wait(timeout=60)
    submitted = len(events)
    long = engine.submit("long", long_prompt, 32, ignore_eos=True, on_token=lambda _: events.append("long"))
    short_tokens, long_tokens = short.result(timeout=120).tokens, long.result(timeout=120).tokens
    return short_tokens, long_tokens, events[submitted:].index("long")


def test_the_bound_leaves_greedy_tokens_unchanged(tiny):
    long_prompt = [(7 * i) % (tiny.config.vocab_size - 3) + 3 for i in range(400)]
    with Engine(tiny, EngineConfig(num_blocks=256)) as alone_engine:
        alone = alone_engine.generate("alone", long_prompt, 32, ignore_eos=True).tokens
    with Engine(tiny, EngineConfig(num_blocks=256, decode_step_slack=math.inf)) as plain_engine:
        *plain, _ = _long_beside_a_decode(plain_engine, long_prompt)
    with Engine(tiny, EngineConfig(num_blocks=256, decode_step_slack=SLACK)) as capped_engine:
        # The engine's own fit follows this machine's clock: the test sets the cost.
        capped_engine._loop.scheduler.step_cost = CPU
        *capped, steps_to_first_token = _long_beside_a_decode(capped_engine, long_prompt)
    assert capped == plain and capped[1] == alone
    # The 400 prompt tokens went in chunks of at most 65, each in a step with the short one's decode.
    assert steps_to_first_token >= math.ceil(400 / 65)
