"""The admission policy's rules, one by one, with plain budgets and a virtual clock."""

from __future__ import annotations

import msgspec
import pytest

from bench.sim.baselines import StrictPriorityPolicy
from bench.sim.simulator import ServiceModel, simulate
from kvfleet.contracts import JobRequest, Priority
from kvfleet.settings import ClassConfig, PolicyConfig
from kvfleet.tenancy import Tenant, Tier
from scheduler.policy import Budget, PendingJob, Policy

HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW
ONE_SECOND = ServiceModel(floor_s=1.0, prefill_s_per_token=0.0, decode_s_per_token=0.0)


def job(job_id: str, priority: Priority, cost: int, t: float = 0.0, *, tenant: str = "acme",
        tier: Tier = Tier.SILVER, deadline: float | None = None, partition: int = 0) -> PendingJob:
    return PendingJob(job_id, tenant, tier, priority, prompt_tokens=cost - 1, max_new_tokens=1,
                      enqueued_at=t, deadline=deadline, partition=partition)


def ids(jobs) -> list[str]:
    return [j.job_id for j in jobs]


def test_high_is_admitted_first_under_contention():
    policy = Policy()
    for j in (job("low", LOW, 1000, 0.0), job("normal", NORMAL, 1000, 0.0), job("high", HIGH, 1000, 1.0)):
        policy.add(j)
    decision = policy.schedule(2.0, Budget(capacity=10_000, in_use=8_500))
    assert ids(decision.admit) == ["high"]
    assert policy.pending() == 2


def test_class_share_is_kept_under_contention():
    # High is over its 60% share and normal under its 30%: normal's job goes first.
    policy = Policy()
    policy.add(job("high", HIGH, 1000, 0.0))
    policy.add(job("normal", NORMAL, 1000, 5.0))
    budget = Budget(10_000, 9_000, class_in_use={HIGH: 7_000, NORMAL: 2_000})
    assert ids(policy.schedule(6.0, budget).admit) == ["normal"]


def _saturating_high_stream(until: float) -> list[PendingJob]:
    """12 high jobs of 1000 tokens per second: 120% of a 10k-token fleet of 1 s jobs."""
    return [job(f"h{i:05d}", HIGH, 1000, i / 12) for i in range(int(until * 12))]


def test_low_wait_is_bounded_under_sustained_high_load():
    # No share for low: only the hard aging bound can get it in. (silver_burst=1: the
    # one tenant may fill the fleet.)
    config = PolicyConfig(high=ClassConfig(1.0, 30.0, 0.0), normal=ClassConfig(0.0, 60.0, 5.0),
                          low=ClassConfig(0.0, 20.0, 10.0), silver_burst=1.0)
    jobs = _saturating_high_stream(120.0) + [job("low", LOW, 1000, 5.0)]
    result = simulate(Policy(config), jobs, capacity=10_000, service=ONE_SECOND)
    low = next(r for r in result.records if r.job.job_id == "low")
    # It goes first at 20 s; tokens free within one 1-second job.
    assert low.outcome == "done" and 20.0 <= low.wait <= 20.0 + 1.0 + 0.1

    strict = simulate(StrictPriorityPolicy(config), jobs, capacity=10_000, service=ONE_SECOND)
    starved = next(r for r in strict.records if r.job.job_id == "low")
    assert starved.wait > 100.0  # served only after the high stream ends


def _long_job_wait(reserve_after_s: float) -> float:
    config = PolicyConfig(base_ceiling_tokens=8192, normal=ClassConfig(0.3, 1000.0, reserve_after_s),
                          silver_burst=1.0)
    shorts = [job(f"s{i:05d}", NORMAL, 1000, i / 12) for i in range(12 * 60)]
    jobs = shorts + [job("long", NORMAL, 8000, 1.0)]
    result = simulate(Policy(config), jobs, capacity=10_000, service=ONE_SECOND)
    return next(r for r in result.records if r.job.job_id == "long").wait


def test_long_job_is_not_starved_by_a_stream_of_short_ones():
    # Held after 5 s of waiting: the next second's releases accumulate for it.
    assert _long_job_wait(reserve_after_s=5.0) <= 5.0 + 1.0 + 0.1
    # Without the hold, the short jobs take every freed token until their stream ends.
    assert _long_job_wait(reserve_after_s=1000.0) > 55.0


def test_over_ceiling_is_rejected_with_reason():
    policy = Policy(PolicyConfig(base_ceiling_tokens=4096))
    policy.add(job("big-low", LOW, 1025))
    policy.add(job("max-high", HIGH, 8192))
    decision = policy.schedule(0.0, Budget(100_000, 0))
    assert ids(decision.admit) == ["max-high"]
    (verdict,) = decision.reject
    assert verdict.job.job_id == "big-low" and verdict.code == "too_many_tokens"
    assert "1025 tokens" in verdict.message and "low ceiling is 1024" in verdict.message
    assert "normal 4096" in verdict.message  # says where it would fit


def test_gold_reserve_is_kept_for_the_gold_tenant():
    tenants = {"gold": Tenant(name="gold", tier=Tier.GOLD, tokens_per_minute=1, share=0.2)}
    policy = Policy(PolicyConfig(silver_burst=1.0), tenants)
    policy.add(job("silver", NORMAL, 1000, 0.0, tenant="silver"))
    budget = Budget(10_000, 7_500, tenant_in_use={"silver": 7_500})
    # 2,500 free, but 2,000 of it is gold's: the silver job does not fit.
    assert policy.schedule(1.0, budget).admit == ()
    policy.add(job("gold", NORMAL, 1_500, 1.0, tenant="gold", tier=Tier.GOLD))
    assert ids(policy.schedule(1.1, budget).admit) == ["gold"]


def test_bronze_over_its_share_borrows_only_what_others_leave():
    policy = Policy(PolicyConfig(bronze_limit=0.2))
    policy.add(job("bronze", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("silver", NORMAL, 1000, 1.0, tenant="acme"))
    budget = Budget(10_000, 1_500, tenant_in_use={"cheap": 1_500})
    # Bronze is over its 20% and older, yet the tenant within its share goes first; the
    # room left is idle, so bronze borrows it.
    assert ids(policy.schedule(1.1, budget).admit) == ["silver", "bronze"]
    # No room left after the silver job: nothing is lent.
    policy.add(job("bronze2", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("silver2", NORMAL, 1000, 1.0, tenant="acme"))
    assert ids(policy.schedule(1.2, Budget(10_000, 9_000, tenant_in_use={"cheap": 1_500})).admit) == ["silver2"]


def test_borrowed_work_yields_to_a_higher_class_of_a_tenant_within_its_share():
    # Borrowing, even a high job comes after the normal jobs of every tenant within its
    # share (the tenant's split by class unknown here: its total counts).
    policy = Policy(PolicyConfig(bronze_limit=0.2))
    policy.add(job("borrow", HIGH, 900, 0.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("n1", NORMAL, 1000, 5.0, tenant="acme"))
    budget = Budget(10_000, 8_500, tenant_in_use={"cheap": 2_000})
    assert ids(policy.schedule(5.1, budget).admit) == ["n1"]  # 500 left: the borrower waits
    # The tenant's share is filled by its best class first: its borrowed low work does
    # not make its high job a borrower.
    policy = Policy(PolicyConfig(bronze_limit=0.2))
    policy.add(job("cheap-high", HIGH, 1000, 1.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("acme-low", LOW, 1000, 0.0, tenant="acme"))
    budget = Budget(10_000, 9_000, tenant_in_use={"cheap": 6_000},
                    tenant_class_in_use={("cheap", LOW): 6_000})
    assert ids(policy.schedule(1.1, budget).admit) == ["cheap-high"]


def test_borrowers_never_hold_and_take_nothing_while_the_budget_is_held():
    policy = Policy(PolicyConfig(silver_burst=1.0, bronze_limit=0.1))
    policy.add(job("long", NORMAL, 900, 0.0))
    policy.add(job("borrow", NORMAL, 100, 0.0, tenant="cheap", tier=Tier.BRONZE))
    held = policy.schedule(6.0, Budget(1000, 800, tenant_in_use={"cheap": 100}))
    assert held.holding.job_id == "long" and held.admit == ()  # it fits, but the budget is held
    # A borrower that waited long does not hold for itself: smaller jobs pass it.
    policy = Policy(PolicyConfig(silver_burst=1.0, bronze_limit=0.1))
    policy.add(job("big-borrow", NORMAL, 900, 0.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("small", NORMAL, 100, 9.0))
    decision = policy.schedule(10.0, Budget(1000, 800, tenant_in_use={"cheap": 100}))
    assert decision.holding is None and ids(decision.admit) == ["small"]


def test_a_hard_limit_stays_hard_on_an_idle_fleet():
    tenants = {"capped": Tenant(name="capped", tier=Tier.SILVER, tokens_per_minute=1, share=0.2, limit=0.3)}
    policy = Policy(PolicyConfig(), tenants)
    for i in range(3):
        policy.add(job(f"c{i}", NORMAL, 1000, 0.0, tenant="capped"))
    # 2,000 in use: one more borrows up to the 30% limit; the next would pass it.
    assert ids(policy.schedule(1.0, Budget(10_000, 2_000, tenant_in_use={"capped": 2_000})).admit) == ["c0"]
    # Without borrowing every share is a hard limit, as bronze's was before.
    policy = Policy(PolicyConfig(bronze_limit=0.2, borrow_idle=False))
    policy.add(job("bronze", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE))
    assert policy.schedule(1.0, Budget(10_000, 1_500, tenant_in_use={"cheap": 1_500})).admit == ()


def test_bronze_is_shed_first_under_overload():
    policy = Policy(PolicyConfig(bronze_shed_after_s=30.0))
    policy.add(job("bronze", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE))
    policy.add(job("silver", NORMAL, 1000, 0.0, tenant="acme"))
    full = Budget(10_000, 10_000)
    assert policy.schedule(29.0, full).shed == ()
    decision = policy.schedule(30.0, full)
    assert ids(v.job for v in decision.shed) == ["bronze"] and decision.shed[0].code == "overloaded"
    assert policy.pending() == 1  # silver keeps waiting: only deadlines end it


def test_expired_jobs_leave_with_their_reason():
    policy = Policy()
    policy.add(job("late", NORMAL, 100, 0.0, deadline=5.0))
    decision = policy.schedule(6.0, Budget(10_000, 10_000))
    assert ids(v.job for v in decision.expire) == ["late"] and decision.expire[0].code == "deadline_passed"


def test_pause_when_budget_spent_and_resume_as_it_frees():
    policy = Policy(PolicyConfig(max_buffered=2))
    policy.add(job("a", NORMAL, 1000, 0.0, partition=3))
    policy.add(job("b", NORMAL, 1000, 0.0, partition=4))
    spent = policy.schedule(0.0, Budget(10_000, 9_500))
    assert spent.admit == () and policy.paused == {(NORMAL, 3), (NORMAL, 4)}
    freed = policy.schedule(1.0, Budget(10_000, 8_500))
    assert ids(freed.admit) == ["a"] and policy.paused == frozenset()


def test_a_tenant_at_its_limit_pauses_only_its_own_partition():
    tenants = {"cheap": Tenant(name="cheap", tier=Tier.BRONZE, tokens_per_minute=1, share=0.1, limit=0.1)}
    policy = Policy(PolicyConfig(max_buffered=2), tenants)
    for i in range(2):
        policy.add(job(f"b{i}", LOW, 500, 0.0, tenant="cheap", tier=Tier.BRONZE, partition=1))
    budget = Budget(10_000, 1_000, tenant_in_use={"cheap": 1_000})
    decision = policy.schedule(1.0, budget)
    assert decision.admit == () and policy.paused == {(LOW, 1)}
    # Partition 2 was never paused, so its next job arrives and runs on the free budget.
    policy.add(job("s", LOW, 500, 1.0, partition=2))
    assert ids(policy.schedule(1.1, budget).admit) == ["s"]


def test_requeued_job_keeps_its_place():
    policy = Policy()
    first, second = job("first", NORMAL, 1000, 0.0), job("second", NORMAL, 1000, 1.0)
    policy.add(second)
    policy.requeue(first)  # lost a ledger race: admitted, then handed back
    assert ids(policy.schedule(2.0, Budget(10_000, 9_000)).admit) == ["first"]


@pytest.mark.parametrize("changes, message", [
    (dict(high=ClassConfig(0.8, 30.0, 0.0)), "class shares sum to 1.20"),
    (dict(base_ceiling_tokens=2), "base_ceiling_tokens=2"),
    (dict(low=ClassConfig(0.1, 10.0, 20.0)), "low.reserve_after_s=20.0"),
    (dict(aging_s=0.0), "aging_s=0.0"),
    (dict(bronze_limit=1.5), "bronze_limit=1.5"),
    (dict(max_buffered=0), "max_buffered=0"),
])
def test_config_is_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**changes)


def test_pending_job_from_a_request():
    request = JobRequest(job_id="j1", tenant="acme", priority=HIGH, model="m", max_new_tokens=100,
                         submitted_at=12.5, deadline=99.0, prompt_tokens=[1, 2, 3])
    pending = PendingJob.from_request(request, tier=Tier.GOLD, partition=4)
    assert (pending.cost, pending.enqueued_at, pending.deadline, pending.partition) == (103, 12.5, 99.0, 4)
    assert (pending.job_id, pending.tenant, pending.tier, pending.priority) == ("j1", "acme", Tier.GOLD, HIGH)
    assert pending.cost == request.cost  # one rule for what a job reserves
    text = msgspec.structs.replace(request, prompt="hello", prompt_tokens=None)
    with pytest.raises(ValueError, match="tokenize it first"):
        PendingJob.from_request(text, tier=Tier.GOLD, partition=4)  # a text prompt has no cost yet


def test_the_decision_names_the_job_the_budget_is_held_for():
    policy = Policy(PolicyConfig(silver_burst=1.0))
    policy.add(job("long", NORMAL, 900, 0.0))
    budget = Budget(1000, 800)  # two short jobs running: the long one does not fit
    assert policy.schedule(1.0, budget).holding is None  # not yet waited its reserve_after_s
    policy.add(job("short", NORMAL, 100, 5.5))
    held = policy.schedule(6.0, budget)
    assert held.holding.job_id == "long" and held.admit == ()  # the short one, though it fits, waits


def _drain_at_one_job_a_second(policy: Policy, until: float) -> None:
    """`policy.schedule` once a second from 0 to `until` on a full fleet where one
    1,000-token job finishes a second: the buffer drains at 1,000 tokens/s."""
    for t in range(int(until) + 1):
        admitted = policy.schedule(float(t), Budget(10_000, 9_000))
        assert len(admitted.admit) == 1 and admitted.shed == ()


def _bronze_behind_a_hundred_silver(deadline: float) -> Policy:
    """100 silver jobs, 1,000 tokens each, and one bronze job behind them: at 1,000
    tokens/s it would start at about 101 s."""
    policy = Policy()
    for i in range(100):
        policy.add(job(f"s{i:03d}", NORMAL, 1000, 0.0))
    policy.add(job("bronze", NORMAL, 1000, 0.5, tenant="cheap", tier=Tier.BRONZE, deadline=deadline))
    return policy


def test_bronze_is_shed_only_once_it_cannot_start_before_its_deadline():
    # The bronze job's deadline is 90 s away: it cannot start in time.
    policy = _bronze_behind_a_hundred_silver(90.0)
    # Until a whole window (30 s) of backlog was seen there is no rate: nothing is shed,
    # though the job has waited past the old fixed 30 s.
    _drain_at_one_job_a_second(policy, 29.0)
    decision = policy.schedule(30.0, Budget(10_000, 9_000))
    (verdict,) = decision.shed
    assert verdict.job.job_id == "bronze" and verdict.code == "overloaded"
    assert "1000 tokens/s" in verdict.message and "after its deadline" in verdict.message
    assert policy.pending() == 69  # the silver jobs only expire, never shed


def test_bronze_that_can_still_start_in_time_waits_however_long():
    # The same queue with the deadline at 200 s: it waits ~100 s, is never shed, and runs.
    policy = _bronze_behind_a_hundred_silver(200.0)
    _drain_at_one_job_a_second(policy, 99.0)
    assert ids(policy.schedule(100.0, Budget(10_000, 9_000)).admit) == ["bronze"]
    # `bronze_shed_after_s` set: the fixed bound sheds it whatever its deadline.
    policy = Policy(PolicyConfig(bronze_shed_after_s=30.0))
    policy.add(job("bronze", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE, deadline=1000.0))
    assert ids(v.job for v in policy.schedule(30.0, Budget(10_000, 10_000)).shed) == ["bronze"]
    # `bronze_shed_late` off as well: bronze only expires.
    policy = Policy(PolicyConfig(bronze_shed_late=False))
    for i in range(100):
        policy.add(job(f"s{i:03d}", NORMAL, 1000, 0.0))
    policy.add(job("bronze", NORMAL, 1000, 0.5, tenant="cheap", tier=Tier.BRONZE, deadline=90.0))
    _drain_at_one_job_a_second(policy, 60.0)
    assert ids(v.job for v in policy.schedule(90.0, Budget(10_000, 10_000)).expire) == ["bronze"]


def test_a_borrowing_bronze_job_counts_every_job_within_a_share_as_ahead():
    # Older than the silver jobs, but over its 20% share: they all go first.
    policy = Policy()
    policy.add(job("bronze", NORMAL, 1000, 0.0, tenant="cheap", tier=Tier.BRONZE, deadline=60.0))
    for i in range(100):
        policy.add(job(f"s{i:03d}", NORMAL, 1000, 0.5))
    budget = Budget(10_000, 9_000, tenant_in_use={"cheap": 3_000})
    for t in range(30):
        assert ids(policy.schedule(float(t), budget).admit) == [f"s{t:03d}"]
    (verdict,) = policy.schedule(30.0, budget).shed  # 70 silver jobs ahead: 70 s, past 60
    assert verdict.job.job_id == "bronze" and "70000 tokens" in verdict.message


def test_normal_and_low_leave_the_reserved_slots_to_high():
    # 16 slots, a quarter (4) kept for high; 11 taken, so 5 free: one for normal or low.
    policy = Policy(PolicyConfig(high_slot_reserve=0.25))
    for j in (job("n1", NORMAL, 100, 0.0), job("n2", NORMAL, 100, 0.0), job("l1", LOW, 100, 0.0)):
        policy.add(j)
    assert ids(policy.schedule(1.0, Budget(100_000, 0, slots=16, jobs=11)).admit) == ["n1"]
    for i in range(5):
        policy.add(job(f"h{i}", HIGH, 100, 1.0))
    # The 4 slots left are high's; the fifth high job waits for a slot like anyone.
    assert ids(policy.schedule(2.0, Budget(100_000, 0, slots=16, jobs=12)).admit) == ["h0", "h1", "h2", "h3"]
    # Without a reserve normal and low take every slot.
    policy = Policy(PolicyConfig(high_slot_reserve=0.0))
    for j in (job("n1", NORMAL, 100, 0.0), job("n2", NORMAL, 100, 0.0), job("l1", LOW, 100, 0.0)):
        policy.add(j)
    assert ids(policy.schedule(1.0, Budget(100_000, 0, slots=16, jobs=13)).admit) == ["n1", "n2", "l1"]


def test_borrowers_leave_the_reserved_slots_to_high_too():
    policy = Policy(PolicyConfig(bronze_limit=0.1, high_slot_reserve=0.25))
    policy.add(job("borrow", NORMAL, 2000, 0.0, tenant="cheap", tier=Tier.BRONZE))  # over its 10%
    assert policy.schedule(1.0, Budget(10_000, 0, slots=8, jobs=6)).admit == ()  # 2 free, both high's
    assert ids(policy.schedule(2.0, Budget(10_000, 0, slots=8, jobs=5)).admit) == ["borrow"]


@pytest.mark.parametrize("changes, message", [
    (dict(high_slot_reserve=1.0), "high_slot_reserve=1.0"),
    (dict(high_slot_reserve=-0.1), "high_slot_reserve=-0.1"),
    (dict(bronze_shed_after_s=0.0), "bronze_shed_after_s=0.0"),
])
def test_shedding_and_reserve_knobs_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**changes)
