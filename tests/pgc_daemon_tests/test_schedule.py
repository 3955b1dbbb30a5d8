"""The schedule, on plain values: every reason to search (or not) for a model."""

from __future__ import annotations

from typing import Any

import pytest

from store import RunState
from pgc_daemon.optimizer.schedule import (
    Regression,
    Resume,
    RunInfo,
    Situation,
    StartSearch,
    Thresholds,
    Wait,
    decide,
    study_name,
)
from pgc_daemon.policy import Policy, PolicySnapshot

NOW = 100_000.0
LIMITS = Thresholds(min_reservoir=8, min_profile_calls=50, reoptimize_interval_s=1800.0, max_failed_runs=3)
OLD = NOW - 2 * 3600  # past the re-search interval
JUST_NOW = NOW - 60  # within it


def situation(policy: Policy | None = None, version: int = 1, **kw: Any) -> Situation:
    values: dict[str, Any] = dict(
        model="m", graph_hash="g" * 64, hardware="cpu-x",
        policy=PolicySnapshot(policy or Policy(max_trials=4), version), runs=[],
        signature="b64 64", reservoir_size=32, calls_seen=500, now=NOW, thresholds=LIMITS,
    )
    values.update(kw)
    return Situation(**values)


def run(name: str, state: RunState = RunState.DONE, *, version: int = 1, budget: int = 4,
        started: float = OLD) -> RunInfo:
    return RunInfo(name, state, version, budget, started)


NAME = situation().study_name


def test_a_model_without_runs_gets_its_first_search() -> None:
    assert decide(situation()) == StartSearch("first search for this model", NAME)


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"reservoir_size": 3}, "live inputs"),
        ({"calls_seen": 10}, "calls profiled"),
        ({"runs": [run(NAME, RunState.RUNNING)]}, "running"),
        ({"runs": [run("other", RunState.QUEUED), run(NAME)]}, "running"),
        ({"runs": [run(NAME)]}, "up to date"),
    ],
)
def test_no_search_without_inputs_while_one_runs_or_when_up_to_date(kw: dict, reason: str) -> None:
    decision = decide(situation(**kw))
    assert isinstance(decision, Wait) and reason in decision.reason


def test_a_change_of_the_study_terms_starts_a_new_study_at_once() -> None:
    before = run(NAME, version=1, started=JUST_NOW)  # recent: a policy change is not rate-limited
    changed = situation(Policy(max_trials=4, max_accuracy_drop=0.02), version=2, runs=[before])
    decision = decide(changed)
    assert decision == StartSearch("policy changed (version 2)", changed.study_name)
    assert changed.study_name != NAME


@pytest.mark.parametrize(
    "update", [{"time_budget_s": 60.0}, {"canary_s": 1.0}, {"min_speedup": 1.5, "auto_deploy": False}]
)
def test_budget_and_deploy_settings_continue_the_finished_study(update: dict) -> None:
    changed = situation(Policy(max_trials=4, **update), version=2, runs=[run(NAME)])
    assert changed.study_name == NAME
    assert decide(changed) == Wait("up to date")


def test_a_raised_trial_budget_resumes_the_finished_study() -> None:
    raised = situation(Policy(max_trials=6), version=2, runs=[run(NAME, budget=4, started=JUST_NOW)])
    assert raised.study_name == NAME
    assert decide(raised) == Resume("trial budget raised to 6 (was 4)", NAME)
    # the resumed run finished with the new budget: nothing more to do
    done = [run(NAME, budget=6, started=JUST_NOW), run(NAME, budget=4)]
    assert decide(situation(Policy(max_trials=6), version=2, runs=done)) == Wait("up to date")
    # a lowered budget never re-searches
    assert decide(situation(Policy(max_trials=2), version=3, runs=[run(NAME)])) == Wait("up to date")


def test_a_raised_budget_gives_up_after_its_resumes_keep_failing() -> None:
    failed = [run(NAME, RunState.FAILED, budget=6, started=NOW - 100 + i) for i in range(3)]
    runs = [*failed, run(NAME, budget=4, started=OLD)]
    decision = decide(situation(Policy(max_trials=6), version=2, runs=runs))
    assert isinstance(decision, Wait) and "gave up" in decision.reason


def test_traffic_drift_starts_a_new_study_but_not_within_the_re_search_interval() -> None:
    old_shape = study_name("m", "g" * 64, "cpu-x", Policy(max_trials=4), "b1 64")
    assert old_shape != NAME
    drifted = situation(runs=[run(old_shape, started=OLD)])
    assert decide(drifted) == StartSearch("traffic shape drifted to b64 64", NAME)
    held = decide(situation(runs=[run(old_shape, started=JUST_NOW)]))
    assert isinstance(held, Wait) and "interval" in held.reason


def test_a_latency_regression_starts_one_search_but_not_within_the_re_search_interval() -> None:
    slow = Regression(7, "live latency regressed: p50 1.00 -> 2.00 ms")
    decision = decide(situation(runs=[run(NAME, started=OLD)], regression=slow))
    assert decision == StartSearch(slow.message, f"{NAME}:regressed-7")
    held = decide(situation(runs=[run(NAME, started=JUST_NOW)], regression=slow))
    assert isinstance(held, Wait) and "interval" in held.reason
    answered = [run(f"{NAME}:regressed-7", started=OLD - 1), run(NAME, started=OLD - 2)]
    assert decide(situation(runs=answered, regression=slow)) == Wait(
        "a search already answered this regression"
    )


def test_a_dead_workers_study_is_resumed() -> None:
    died = run(NAME, RunState.FAILED, started=JUST_NOW)
    assert decide(situation(runs=[died])) == Resume("resuming the study", NAME)
    cancelled = run(NAME, RunState.CANCELLED, started=JUST_NOW)
    assert decide(situation(runs=[cancelled])) == Resume("resuming the study", NAME)


def test_max_failed_runs_gives_up_on_a_study() -> None:
    failed = [run(NAME, RunState.FAILED, started=NOW - i) for i in range(LIMITS.max_failed_runs)]
    decision = decide(situation(runs=failed))
    assert isinstance(decision, Wait) and "gave up" in decision.reason
    assert isinstance(decide(situation(runs=failed[:-1])), Resume)


def test_study_names_hash_only_the_study_terms_and_the_traffic_shape() -> None:
    base = Policy()
    name = study_name("m", "h" * 64, "cpu-x", base, "b1 s128")
    assert name == study_name("m", "h" * 64, "cpu-x", base.study, "b1 s128")
    for same in ({"max_trials": 99}, {"time_budget_s": 5.0}, {"canary_s": 0.0}, {"min_speedup": 2.0}):
        assert study_name("m", "h" * 64, "cpu-x", Policy(**same), "b1 s128") == name, same
    for other in (
        {"max_accuracy_drop": 0.02},
        {"latency_target_ms": 5.0},
        {"latency_percentile": "p95"},
        {"objective": "most_accurate", "latency_target_ms": 5.0},
    ):
        assert study_name("m", "h" * 64, "cpu-x", Policy(**other), "b1 s128") != name, other
    # the backends allowed name a study too (in any order); none named keeps the names studies
    # had before backends could be chosen, so those studies resume
    assert name == "pgc:m:hhhhhhhhhhhh:cpu-x:979766988a"
    torch_only = study_name("m", "h" * 64, "cpu-x", Policy(backends=["inductor", "eager"]), "b1 s128")
    assert torch_only != name
    assert torch_only == study_name("m", "h" * 64, "cpu-x", Policy(backends=["eager", "inductor"]), "b1 s128")
