"""The profiling twin of a search's choice, built by the worker once the search is done.

A compiled variant fuses its layers into kernels that hooks cannot see; kernel events can
(``compiler._kernel_map``), but they cost every call of a package that carries them (3% of
MiniLM's). So the variant that serves is built without them, and the worker builds its twin
with them: the same recipe, from the quantized graph its trial saved
(``compiler.build_profiling_twin``). The twin is recorded on the variant
(``profile_artifact``); serving processes load it beside the variant and run it on sampled
calls only (:mod:`pgc_daemon.agent.twins`). It is built after the baselines for the one of
them deployed while searching (the sensitivity pass and later trials wait for it; a search
on an AVX2-only VM ran 8+ minutes past such a deployment, which had no rows meanwhile), and
after the search for its choice. It takes about as long as the variant's own build (15-25 s
for MiniLM on 2 cores; 60 s for int8 on an AVX2-only VM).
"""

from __future__ import annotations

import logging
import time

import store as st
from compiler import CompileCache, Recipe, build_profiling_twin, profiling_twin_digest
from pgc_daemon.errors import describe
from pgc_daemon.optimizer.search.study import Search, TrialRecord

log = logging.getLogger("pgc.search")


def build_twin(
    store: st.Store, model_id: int, search: Search, chosen: TrialRecord | None
) -> str | None:
    """Build and record the profiling twin of ``chosen`` (a trial deployed); returns
    its artifact digest, or None where there is nothing to build (no choice, not a compiled
    variant, a twin already stored for the variant's kernels as its artifact now records
    them) or the build failed (said in an event; the variant
    serves all the same, its per-layer rows are only missing)."""
    cache: CompileCache | None = search.cache
    if chosen is None or cache is None or cache.artifacts is None:
        return None
    recipe = Recipe.from_dict(chosen.recipe)
    with store.session() as s:
        variant = st.repo.get_or_create_variant(
            s, model_id, chosen.recipe_hash, chosen.recipe, chosen.label
        )
        variant_id, have = variant.id, variant.profile_artifact
    if have is not None and cache.has_artifact(have) and have == profiling_twin_digest(
            search.base, recipe, search.calibration, cache):
        return None  # a twin stored for the kernels the variant's artifact kept
    started = time.monotonic()
    try:
        twin = build_profiling_twin(search.base, recipe, calibration=search.calibration,
                                    example=search.calibration[0] if search.calibration else None,
                                    cache=cache)
    except Exception as exc:  # noqa: BLE001 - the twin is for profiling: say why, go on
        log.warning("profiling twin of %s not built: %s", chosen.label, describe(exc))
        with store.session() as s:
            st.repo.add_event(
                s, model_id, "profile_twin",
                f"no per-layer rows for {chosen.label}: building its profiling twin failed "
                f"({describe(exc)})", level="warning", data={"variant_id": variant_id},
            )
        return None
    if twin is None:
        return None
    took = time.monotonic() - started
    replayed = next((n for n in twin.report.notes if n.startswith("autotune: ")), None)
    with store.session() as s:
        st.repo.set_variant_profile_artifact(s, variant_id, twin.artifact)
        st.repo.add_event(
            s, model_id, "profile_twin",
            f"built a profiling twin of {chosen.label} in {took:.0f}s: serving processes run it "
            "on sampled calls, which are split over the layers its kernels compute"
            + (f" ({replayed.removeprefix('autotune: ')})" if replayed else ""),
            data={"variant_id": variant_id, "artifact": twin.artifact, "build_s": round(took, 1)},
        )
    log.info("profiling twin of %s built in %.1fs", chosen.label, took)
    return twin.artifact
