"""Every other trial the sampler would make is a neighbor of the best so far: what that is, and
that a search finds a recipe one choice from its best baseline on a flat landscape (the digits
CNN's shape: one recipe well ahead of many within noise of each other)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

from compiler import LayerSensitivity, SensitivityReport
from pgc_daemon.optimizer.search.baselines import drop_change
from pgc_daemon.optimizer.search.neighbors import incumbent, neighbors, next_neighbor
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.space import Space
from pgc_daemon.optimizer.search.study import Search
from pgc_daemon.policy import Policy

CHOICES = ("fp32", "int8-static-pc", "int8-dynamic-pc")
SPACE = Space(hot_layers=("a", "b"), layer_choices=CHOICES, default_choices=CHOICES,
              backends=("inductor", "eager"))
FASTEST = Policy(max_accuracy_drop=0.01)
BEST_BASELINE = SPACE.params("int8-static-pc", "inductor")
#: one choice from the best baseline, and far ahead of every other recipe
NEEDLE = {**BEST_BASELINE, "layer:b": "fp32"}


def _record(params: dict[str, Any], number: int, ratio: float, drop: float = 0.0,
            feasible: bool = True) -> TrialRecord:
    recipe = SPACE.recipe(params)
    return TrialRecord(number=number, state="complete", params=params, recipe=recipe.to_dict(),
                       recipe_hash=recipe.hash, label=recipe.label(), ratio=ratio,
                       speedup=1 / ratio, drop=drop, feasible=feasible)


def test_neighbors_change_one_choice_each_default_first() -> None:
    out = list(neighbors(SPACE, BEST_BASELINE))
    assert len(out) == 3 * (len(CHOICES) - 1) + 1  # default, a, b; one other backend
    for p in out:
        assert sum(p[k] != BEST_BASELINE[k] for k in BEST_BASELINE) == 1
    assert [k for p in out[:2] for k in p if p[k] != BEST_BASELINE[k]] == ["default", "default"]
    assert out[-1]["backend"] == "eager"


def test_the_incumbent_is_the_best_feasible_trial_under_the_objective() -> None:
    fast = _record(SPACE.params("int8-static-pc", "inductor"), 0, 0.4, drop=0.008)
    gentle = _record(SPACE.params("int8-dynamic-pc", "inductor"), 1, 0.6, drop=0.001)
    broken = _record(SPACE.params("int8-static-pc", "eager"), 2, 0.2, drop=0.05, feasible=False)
    records = [fast, gentle, broken]
    assert incumbent(records, FASTEST) is fast
    accurate = Policy(max_accuracy_drop=0.01, objective="most_accurate", latency_target_ms=5.0)
    assert incumbent(records, accurate) is gentle
    assert incumbent([broken], FASTEST) is None
    assert next_neighbor(SPACE, [broken], FASTEST) is None  # nothing to move next to


def test_the_next_neighbor_skips_recipes_tried_and_backends_ranked_out() -> None:
    best = _record(BEST_BASELINE, 0, 0.5)
    first = next_neighbor(SPACE, [best], FASTEST)
    assert first == {**BEST_BASELINE, "default": "fp32"}
    tried = [best, _record(first, 1, 0.7)]
    second = {**BEST_BASELINE, "default": "int8-dynamic-pc"}
    assert next_neighbor(SPACE, tried, FASTEST) == second
    # a recipe refused before any build has no record: the study names it, or the moves
    # proposed it again on every ask until the search gave up
    third = next_neighbor(SPACE, tried, FASTEST, tried=[SPACE.recipe(second).hash])
    assert third is not None and third != second
    # every quantization neighbor tried: only eager is left, and the trials rank it out
    rest = [p for p in neighbors(SPACE, BEST_BASELINE) if p["backend"] == "inductor"]
    done = [best] + [_record(p, i + 1, 0.7) for i, p in enumerate(rest)]
    assert next_neighbor(SPACE, done, FASTEST)["backend"] == "eager"
    assert next_neighbor(SPACE, done, FASTEST, {("backend", "eager"): 2.0}) is None


def test_moves_sensitivity_predicts_to_break_the_budget_come_last() -> None:
    """The incumbent's measured drop plus what sensitivity says a move adds: a move over the
    budget waits until every other neighbor was tried (it is not dropped: sensitivity sums
    layers measured alone, and can be wrong)."""
    report = SensitivityReport(metric="cosine", inputs=8)
    for layer, choice, drop in (("a", "int8-static-pc", 0.004), ("a", "int8-dynamic-pc", 0.001),
                                ("b", "int8-static-pc", 0.0005), ("c", "fp32", 0.0)):
        report.rows.append(LayerSensitivity(layer, choice, 1 - drop, None, None, None, None))
    start = SPACE.params("int8-dynamic-pc", "inductor", a="int8-dynamic-pc")
    best = _record(start, 0, 0.5, drop=0.0075)  # 0.0025 of room left
    assert drop_change(report, SPACE, start, {**start, "layer:a": "int8-static-pc"}) == \
        pytest.approx(0.003)
    # the default covers c alone (every measured layer but the hot ones): no change predicted
    assert drop_change(report, SPACE, start, {**start, "default": "int8-static-pc"}) == 0.0
    plain = list(neighbors(SPACE, start))
    order = []
    records = [best]
    while (move := next_neighbor(SPACE, records, FASTEST, sensitivity=report)) is not None:
        order.append(move)
        records.append(_record(move, len(records), 0.9))
    assert sorted(map(str, order)) == sorted(map(str, plain))  # every neighbor, once
    over = {**start, "layer:a": "int8-static-pc"}  # 0.0075 + 0.003 > 0.01: the only one
    assert order[-1] == over
    assert order[:-1] == [p for p in plain if p != over]


def _flat(params: dict[str, Any]) -> float:
    """0.60-0.70 by a hash of the recipe: a flat landscape with no structure to learn."""
    digest = hashlib.sha256(SPACE.recipe(params).hash.encode()).digest()
    return 0.60 + digest[0] / 2550


def _search(seed: int, moves: bool) -> list[TrialRecord]:
    def evaluate(number: int, params: dict[str, Any], recipe: Any) -> TrialRecord:
        if recipe == SPACE.recipe(NEEDLE):
            ratio = 0.3
        elif recipe == SPACE.recipe(BEST_BASELINE):
            ratio = 0.5
        else:
            ratio = _flat(params)
        return _record(params, number, ratio)

    evaluated: list[TrialRecord] = []
    search = Search(base=None, space=SPACE, policy=FASTEST, timing_inputs=[],
                    evaluator=SimpleNamespace(metric="cosine"),  # type: ignore[arg-type]
                    calibration=[], storage=None, name=f"neighbors-{seed}", seed=seed,
                    evaluate=evaluate, neighbor_moves=moves,
                    # the moves alone: ranking out (test_baselines) would take the fp32
                    # default and eager, two thirds of this small space, from both arms
                    rank_backends=False,
                    on_trial=lambda rec, done, budget: evaluated.append(rec))
    search.enqueue([SPACE.params("fp32", "inductor"), BEST_BASELINE])
    search.run(12)
    return evaluated


def _found(records: list[TrialRecord]) -> int:
    needle = SPACE.recipe(NEEDLE).hash
    return next((i for i, r in enumerate(records, 1) if r.recipe_hash == needle), 99)


@pytest.mark.parametrize("seed", range(5))
def test_a_search_alternates_neighbor_moves_and_finds_the_recipe_next_to_its_best(seed) -> None:
    records = _search(seed, moves=True)
    assert len(records) == 12
    # after the two baselines: a neighbor of the best so far, a sample, a neighbor, ...
    for i in range(2, _found(records), 2):
        best = incumbent(records[:i], FASTEST)
        moved = records[i].params
        assert sum(moved[k] != best.params[k] for k in moved) == 1, (i, moved)
        assert records[i].origin == "neighbor"
        assert records[i].origin_note == " (next to the best so far)"
    assert [r.origin for r in records[:2]] == ["baseline", "baseline"]
    assert {r.origin for r in records[3:_found(records):2]} <= {"sampler"}
    # the needle is the fifth neighbor: the ninth trial after the baselines at the latest
    assert _found(records) <= 11


def test_the_moves_bound_the_worst_case_the_sampler_alone_leaves_open() -> None:
    """TPE alone often finds the needle too here (its samples crowd around the best
    baseline), but not always within the budget; with the moves every seed has it by the
    ninth trial after the baselines."""
    alone = [_found(_search(seed, moves=False)) for seed in range(10)]
    moved = [_found(_search(seed, moves=True)) for seed in range(10)]
    assert max(moved) <= 11
    assert max(alone) > 12


def test_moves_a_peer_backend_builds_alike_are_one_recipe_and_tried_once() -> None:
    choices = (*CHOICES, "bf16")
    space = Space(hot_layers=("a", "b"), layer_choices=choices, default_choices=choices,
                  backends=("onnxruntime", "inductor"))
    ort = space.params("int8-dynamic-pc", "onnxruntime")
    as_fp32, as_bf16 = ({**ort, "layer:a": c} for c in ("fp32", "bf16"))
    # ONNX Runtime builds no bf16 layer: the label says fp32, as it runs
    assert space.recipe(as_bf16) == space.recipe(as_fp32)
    assert space.recipe(as_bf16).label() == "int8-dynamic-pc+1 fp32 · onnxruntime"
    on_inductor = [space.recipe({**p, "backend": "inductor"}) for p in (as_fp32, as_bf16)]
    assert on_inductor[0] != on_inductor[1]  # where bf16 is built, it is another recipe

    def record(params: dict[str, Any], number: int, ratio: float) -> TrialRecord:
        recipe = space.recipe(params)
        return TrialRecord(number=number, state="complete", params=params,
                           recipe=recipe.to_dict(), recipe_hash=recipe.hash,
                           label=recipe.label(), ratio=ratio, speedup=1 / ratio, drop=0.0,
                           feasible=True)

    tried = [record(ort, 0, 0.5), record(as_fp32, 1, 0.7)]
    moves = []
    while (move := next_neighbor(space, tried, FASTEST)) is not None:
        moves.append(move)
        tried.append(record(move, len(tried), 0.7))
    assert as_bf16 not in moves  # built like a move already measured: never measured again
    assert len({space.recipe(m).hash for m in moves}) == len(moves)
    assert any(m["backend"] == "inductor" for m in moves)
