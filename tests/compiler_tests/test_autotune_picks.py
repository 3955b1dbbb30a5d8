"""A profiling twin keeps the GEMM kernels max-autotune kept for its variant.

Seen in a demo: a twin of an int8 static, bf16 max-autotune MiniLM, compiled again while
other processes kept 1.5 cores busy, timed oneDNN faster for 6 linears its variant ran as
AMX templates; it computed other numbers (cosine 0.9974) and was refused, so the variant
served without per-layer rows. Here a float MLP, where max-autotune weighs Inductor's C++
GEMM template against oneDNN's linear for each of its two GEMMs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import store as st
from compiler import (
    Backend,
    CompileCache,
    Recipe,
    build,
    build_profiling_twin,
    profiling_twin_digest,
)
from compiler import _autotune_picks as picks_mod
from compiler._autotune_picks import Pick, picks_from_json
from compiler._kernel_map import ENV
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.twin import build_twin

RECIPE = Recipe(backend=Backend("inductor", "max-autotune"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 1024)
        self.b = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(x)))


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory):
    """The MLP's max-autotune variant in a compile cache, with every GEMM's candidates (a spy
    on the recording hook) and the picks its manifest holds."""
    torch.manual_seed(0)
    model = MLP().eval()
    calibration = [((torch.randn(64, 256),), {}) for _ in range(2)]
    folder = tmp_path_factory.mktemp("cache")
    candidates: list[list[str]] = []
    real = picks_mod.Picking

    class Spy(real):
        def override_best_choice(self, best_choice, timings):
            candidates.append([picks_mod._name(c) for c in timings])
            return super().override_best_choice(best_choice, timings)

    picks_mod.Picking = Spy
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(ENV, raising=False)  # as served by default: no kernel events
            built = build(model, RECIPE, calibration=calibration, cache=CompileCache(folder))
    finally:
        picks_mod.Picking = real
    assert ENV not in _manifest(folder, built.artifact)["key"]["env"]
    if not candidates:
        pytest.skip("max-autotune offered one kernel per GEMM on this machine")
    manifest = _manifest(folder, built.artifact)
    return model, calibration, folder, built, candidates, picks_from_json(manifest["autotune"])


def _manifest(folder: Path, digest: str) -> dict:
    return json.loads((folder / "artifacts" / digest / "manifest.json").read_text())


def test_a_variant_records_the_kernel_each_gemm_kept(variant) -> None:
    _, _, _, built, candidates, recorded = variant
    assert list(recorded) == ["model0.pt2"]
    picks = recorded["model0.pt2"]
    assert len(picks) == len(candidates) == 2
    for pick, offered in zip(picks, candidates, strict=True):
        assert pick.candidates == len(offered) >= 2
        assert offered[pick.index] == pick.choice
    assert picks[0].gemm != picks[1].gemm  # 64x1024 from 64x256, then 64x256 from 64x1024
    assert not any("replayed" in n for n in built.report.notes)  # the variant times its own


def test_the_twin_replays_its_variants_picks_not_its_own_timings(
        variant, tmp_path, monkeypatch, store) -> None:
    """The variant's manifest is made to name the other candidate of each GEMM (what a
    twin timed under load would keep, or a variant rebuilt after its artifact was pruned):
    the twin must compile those, not load the twin stored for the old picks, and its kernel
    events show it: the library linear is called exactly where a pick names it. The worker
    that records twins on variants builds the new one too."""
    monkeypatch.delenv(ENV, raising=False)  # as the variant was built: its key, its picks
    model, calibration, folder, built, candidates, recorded = variant
    other = tmp_path / "cache"
    shutil.copytree(folder, other)
    search = SimpleNamespace(base=model, calibration=calibration, cache=CompileCache(other))
    chosen = TrialRecord(number=0, state="complete", params={}, recipe=RECIPE.to_dict(),
                         recipe_hash=RECIPE.hash, label=RECIPE.label())
    with store.session() as s:
        model_id = st.repo.upsert_model(s, "mlp").id
    old = build_twin(store, model_id, search, chosen)  # for the picks the variant kept
    assert old is not None and old == profiling_twin_digest(model, RECIPE, calibration,
                                                            search.cache)
    assert build_twin(store, model_id, search, chosen) is None  # stored: nothing to build
    flipped = [
        Pick(p.gemm, p.candidates, i, offered[i])
        for p, offered in zip(recorded["model0.pt2"], candidates, strict=True)
        for i in [next(i for i in range(len(offered)) if i != p.index)]
    ]
    path = other / "artifacts" / built.artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["autotune"] = {"model0.pt2": [p.to_json() for p in flipped]}
    path.write_text(json.dumps(manifest))

    new = profiling_twin_digest(model, RECIPE, calibration, CompileCache(other))
    assert new is not None and new != old
    twin = build_profiling_twin(model, RECIPE, calibration=calibration, cache=CompileCache(other))
    assert twin is not None and twin.kernel_layers is not None and twin.artifact == new
    assert "autotune: 2 of 2 GEMM kernel choices replayed from the variant's build" \
        in twin.report.notes
    assert picks_from_json(_manifest(other, twin.artifact)["autotune"]) == {"model0.pt2": flipped}
    # the MLP's only library calls are its linears (the GELU is fused into one or the other)
    externs = [p for p in flipped if p.choice.startswith("ExternKernelCaller:")]
    library_calls = sum(len(calls) for event, calls in twin.kernel_layers.items()
                        if event.startswith("aoti_torch_cpu_"))
    assert library_calls == len(externs), twin.kernel_layers
    assert build_twin(store, model_id, search, chosen) == new  # the stored twin was stale
    with store.session() as s:
        assert st.repo.get_or_create_variant(s, model_id, chosen.recipe_hash, chosen.recipe,
                                             chosen.label).profile_artifact == new


def test_the_twin_computes_what_its_variant_computes(variant, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    model, calibration, folder, built, _, recorded = variant
    twin = build_profiling_twin(model, RECIPE, calibration=calibration, cache=CompileCache(folder))
    assert twin is not None
    assert picks_from_json(_manifest(folder, twin.artifact)["autotune"]) == recorded
    x = torch.randn(64, 256)
    with torch.inference_mode():
        assert torch.equal(twin.module(x), built.module(x))


def test_an_artifact_without_picks_leaves_the_twin_its_own_timings() -> None:
    for malformed in (None, [], {"model0.pt2": [["gemm", "two", 0, "x"]]}, {"m": [[1, 2]]}):
        assert picks_from_json(malformed) is None
    assert picks_from_json({"m": [["g", 2, 1, "E:x"]]}) == {"m": [Pick("g", 2, 1, "E:x")]}
