"""What a search tries before its sampler, chosen by the policy's objective.

``fastest`` starts at the fast end, where its answer usually is (:meth:`Space.baselines`:
fp32 and all-int8 compiled, each installed peer in its own int8, the most sensitive layers
kept in fp32). ``most_accurate`` wants the least accuracy drop that still meets a latency
target, so it starts at the accurate end instead and climbs a *ladder*: fp32 compiled, bf16
where it is offered, then recipes that change more and more layers, each layer in its
*gentlest* choice (the one per-layer sensitivity says costs it least), in the order of the
drop sensitivity predicts for them (the sum of their layers' drops alone), and last the
fastest recipe (all-int8 static), so that TPE, told both ends, searches between them. The
first rung that meets the target is then close to the most accurate recipe that does.
Measured on MiniLM (``bench/search.py``, scenario ``minilm_most_accurate``): fast baselines
first, TPE conditioned on them kept searching near int8 and needed more trials than TPE
with no baselines at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compiler import Backend, Recipe, SensitivityReport
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.space import LAYER_PREFIX, SAFE, Space
from pgc_daemon.policy import Policy

__all__ = ["Choice", "baselines_for", "drop_change", "most_sensitive", "ranked_out", "slowdown"]

#: a parameter and its value as :func:`ranked_out` names them: ``("backend", "eager")``
Choice = tuple[str, str]

#: Layer choices from the least to the most lossy where sensitivity did not measure them
#: (and to break ties): what precision and scheme usually cost, on MiniLM and the digits
#: models (dynamic per-channel int8 cosine 0.9999 against 0.9997 static, 0.993 per-tensor).
GENTLE_ORDER = ("bf16", "fp16", "int8-weight_only-pc", "int8-dynamic-pc", "int8-static-pc",
                "int8-dynamic-pt")
#: A backend or default choice whose fastest feasible trial is this much slower than the
#: fastest of any is no longer sampled for ``fastest`` (:func:`ranked_out`)
RANK_OUT = 1.25
#: a backend whose first builds all failed, this many of them, takes no more trials: they
#: fail for the model, not the recipe (a trace that fixed a branch, an output type export
#: cannot flatten: 3 of 12 trials each on bench/foreign.py's branchy and dataclass_out)
BROKEN_AFTER = 2
#: the slowdown a broken backend is ranked out with (what the sampler is told)
BROKEN = 100.0
#: How many rungs the ladder has at most, the fastest end included: the rest of a default
#: budget (12 trials) is the sampler's.
LADDER_RUNGS = 6


def baselines_for(space: Space, policy: Policy,
                  sensitivity: SensitivityReport | None) -> list[dict[str, Any]]:
    """The trial parameters a search over ``space`` enqueues before its sampler runs."""
    if policy.objective == "most_accurate":
        return ladder(space, sensitivity)
    return space.baselines(most_sensitive(sensitivity, space.hot_layers, policy.max_accuracy_drop))


def most_sensitive(
    report: SensitivityReport | None, hot: Sequence[str], max_drop: float
) -> list[str]:
    """Hot layers whose int8 alone costs a noticeable part of the budget (a quarter or more),
    most sensitive first, at most two: an enqueued trial keeps them in fp32."""
    if report is None:
        return []
    worst: dict[str, float] = {}
    for row in report.rows:
        if row.layer in hot and row.drop is not None:
            worst[row.layer] = max(worst.get(row.layer, 0.0), row.drop)
    ranked = sorted((d, n) for n, d in worst.items() if d >= max_drop / 4)
    return [n for _, n in reversed(ranked)][:2]


def ladder(space: Space, report: SensitivityReport | None) -> list[dict[str, Any]]:
    """``most_accurate``'s baselines: fp32 compiled first, the fastest end last, and between
    them the rungs in the order of their predicted drop (see the module's doc)."""
    backend = "inductor" if "inductor" in space.backends else space.backends[0]
    gentle = {n: _gentlest(report, [n], space.choices_of(n)) for n in space.hot_layers}
    hot = sorted(space.hot_layers, key=lambda n: _drop(report, [n], gentle[n]))
    covered = _covered(report, space)
    default = _gentlest(report, covered, space.default_choices)
    rungs: list[tuple[float, dict[str, Any]]] = []
    if "bf16" in space.default_choices:
        bf16 = {n: "bf16" for n in hot if "bf16" in space.choices_of(n)}
        rungs.append((_drop(report, covered, "bf16")
                      + sum(_drop(report, [n], "bf16") for n in bf16),
                      space.params("bf16", backend, **{n: SAFE for n in hot} | bf16)))
    if default != SAFE:  # every layer but the hot ones, then the hot ones one at a time
        base = _drop(report, covered, default)
        changed: dict[str, str] = {}
        rungs.append((base, space.params(default, backend, **{n: SAFE for n in hot})))
        for n in hot:
            changed[n] = gentle[n]
            rungs.append((base + sum(_drop(report, [m], c) for m, c in changed.items()),
                          space.params(default, backend, **{m: SAFE for m in hot} | changed)))
    for n in hot:  # one hot layer alone: for a target fp32 compiled just misses
        if gentle[n] != SAFE:
            rungs.append((_drop(report, [n], gentle[n]),
                          space.params(SAFE, backend, **{n: gentle[n]})))
    rungs.sort(key=lambda r: r[0])
    out = [space.params(SAFE, backend)] + [p for _, p in rungs]
    fastest = "int8-static-pc" if "int8-static-pc" in space.default_choices else default
    out = _unique(out)[: LADDER_RUNGS - 1]
    return _unique(out + [space.params(fastest, backend)])


def drop_change(report: SensitivityReport | None, space: Space, params: Mapping[str, Any],
                moved: Mapping[str, Any]) -> float:
    """The change in accuracy drop sensitivity predicts for ``moved`` against ``params``: for
    each parameter that differs, the summed drop of the layers it covers (the default: every
    measured layer but the hot ones) in the new choice less that in the old (0 where nothing
    was measured)."""
    change = 0.0
    for name, new in moved.items():
        old = params.get(name)
        if new == old or not isinstance(new, str) or not isinstance(old, str):
            continue
        if name == "default":
            layers = _covered(report, space)
        elif name.startswith(LAYER_PREFIX):
            layers = [name[len(LAYER_PREFIX):]]
        else:
            continue
        change += _drop(report, layers, new) - _drop(report, layers, old)
    return change


def _covered(report: SensitivityReport | None, space: Space) -> list[str]:
    """The measured layers the default covers (every measured layer but the hot ones)."""
    if report is None:
        return []
    return sorted({r.layer for r in report.rows} - set(space.hot_layers))


def _gentlest(report: SensitivityReport | None, layers: Sequence[str],
              choices: Sequence[str]) -> str:
    """Of ``choices`` other than fp32, the one whose summed drop over ``layers`` is least
    (ties and unmeasured choices: :data:`GENTLE_ORDER`); fp32 where there is no other."""
    lossy = [c for c in choices if c != SAFE]
    if not lossy:
        return SAFE
    rank = {c: i for i, c in enumerate(GENTLE_ORDER)}
    return min(lossy, key=lambda c: (_drop(report, layers, c), rank.get(c, len(rank))))


def _drop(report: SensitivityReport | None, layers: Sequence[str], choice: str) -> float:
    """The summed drop of ``layers`` each alone in ``choice`` (0 where not measured)."""
    if report is None or choice == SAFE:
        return 0.0
    rows = (report.get(n, choice) for n in layers)
    return sum(r.drop for r in rows if r is not None and r.drop is not None)


def _unique(params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for i, p in enumerate(params) if p not in params[:i]]


def ranked_out(records: Sequence[TrialRecord], backends: Sequence[str]) -> dict[Choice, float]:
    """The choices the trials so far rule out for ``fastest``, each with how much slower its
    fastest feasible trial is than the fastest of any (over :data:`RANK_OUT`): a backend
    (``("backend", label)``) or the default choice, which covers every layer but the hot ones
    (``("default", choice)``). fp32 eager is the reference, so eager's point is known before
    any trial (ratio 1); a choice with no feasible trial yet stays.

    Seen on the digits LSTM: once the baselines had put ONNX Runtime and Inductor at 1.6x,
    TPE still sampled eager int8 (0.4-0.6x) in a third of its trials. On MiniLM with six hot
    layers and a strict budget, half of TPE's samples and the incumbent's first neighbor kept
    the default in fp32 (1.5-1.8x) once int8 defaults stood at 2.5-3.4x."""
    kinds = _broken(records)
    broken = {("backend", b): BROKEN for b in backends if Backend.parse(b).kind in kinds}
    feasible = [(r, Recipe.from_dict(r.recipe).backend.label()) for r in records
                if r.state == "complete" and r.feasible and r.ratio]
    best: dict[Choice, float] = {("backend", "eager"): 1.0} if "eager" in backends else {}
    for r, backend in feasible:
        best[("backend", backend)] = min(best.get(("backend", backend), r.ratio), r.ratio)
    if not best:
        return broken
    fastest = min(best.values())
    # a default is judged on the fastest backend only (seen only on a slower backend, the
    # backend may be what is slow): judged on any, TPE without baselines on MiniLM at a drop
    # of 0.005 no longer reached the best within 36 trials (bench/search.py; 11 this way)
    on = min(best, key=best.__getitem__)[1]
    for r, backend in feasible:
        default = r.params.get("default")
        if backend == on and default is not None:
            key = ("default", str(default))
            best[key] = min(best.get(key, r.ratio), r.ratio)
    return broken | {c: ratio / fastest for c, ratio in best.items()
                     if ratio > RANK_OUT * fastest}


def _broken(records: Sequence[TrialRecord]) -> list[str]:
    """Backend kinds (``openvino`` for ``openvino`` and ``openvino-f32``: one converter) with
    :data:`BROKEN_AFTER` failed builds or more and none that built."""
    failed: dict[str, int] = {}
    built: set[str] = set()
    for r in records:
        backend = Recipe.from_dict(r.recipe).backend.kind
        if r.state == "failed":
            failed[backend] = failed.get(backend, 0) + 1
        else:
            built.add(backend)
    return [b for b, n in failed.items() if n >= BROKEN_AFTER and b not in built]


def slowdown(out: Mapping[Choice, float], params: Mapping[str, Any],
             recipe: Recipe) -> float | None:
    """How much slower than the fastest a ranked-out choice of this trial makes it (the
    worst of them), or None when no choice of it is ranked out."""
    hits = [out[c] for c in _choices_of(params, recipe) if c in out]
    return max(hits) if hits else None


def _choices_of(params: Mapping[str, Any], recipe: Recipe) -> list[Choice]:
    out: list[Choice] = [("backend", recipe.backend.label())]
    if params.get("default") is not None:
        out.append(("default", str(params["default"])))
    return out
