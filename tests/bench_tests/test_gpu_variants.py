"""``bench/gpu_variants.py`` as far as a CPU goes: without a GPU it says so in one line and
exits 2 (JSON last); its convnet is ResNet-50's shape; its candidates are the recipes pgc's
search tries first for a model on a GPU; fidelity is judged as the README says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gv():  # noqa: ANN201 - the bench script as a module
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_variants

        yield gpu_variants
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_variants.py"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("gpu_variants: no CUDA device here")
    assert json.loads(lines[-1]) == {"gpu": None, "ran": False}
    bad = subprocess.run([sys.executable, str(BENCH / "gpu_variants.py"), "--cases", "vgg"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cases takes" in bad.stderr


def test_the_convnet_is_resnet50_shaped(gv) -> None:  # noqa: ANN001
    model, inputs = gv.load("resnet50_b32", device="cpu")
    params = sum(p.numel() for p in model.parameters())
    assert 25.0e6 < params < 26.0e6  # ResNet-50: 25.6 M
    assert inputs[0][0].shape == (32, 3, 224, 224)
    with torch.inference_mode():
        out = model(inputs[0][0][:2])
    assert out.shape == (2, 1000) and out.dtype == torch.float32


def test_fidelity_is_judged_as_the_readme_says(gv) -> None:  # noqa: ANN001
    ref = [torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])]
    same = gv.fidelity("resnet50_b32", ref, [ref[0] * 2])
    assert same == {"top1": 1.0} and gv.faithful("resnet50_b32", same)
    half = gv.fidelity("resnet50_b32", ref, [torch.tensor([[1.0, 0, 0], [1.0, 0, 0]])])
    assert half["top1"] == 0.5 and not gv.faithful("resnet50_b32", half)
    near = gv.fidelity("minilm_b1", ref, [ref[0] + 0.05])
    assert 0.99 < near["cosine"] < 1.0 and gv.faithful("minilm_b1", near)
    assert not gv.faithful("minilm_b1", {"cosine": 0.98})


def test_the_candidates_are_what_the_search_tries_first_on_a_gpu(
        gv, mlp_spec: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from pgc_daemon.optimizer.search import space

    monkeypatch.setattr(space, "on_gpu", lambda _m: True)  # nothing here touches the device
    recipes = gv.candidates(mlp_spec["model"])
    labels = [r.label() for r in recipes]
    assert labels[0].startswith("fp32 · inductor")
    assert any(lbl.startswith("fp16 · inductor-max") for lbl in labels)
    assert any(r.kernels.linear == "triton" for r in recipes)  # int8 weight-only: pgc's kernel
    assert not any("int8-static" in lbl for lbl in labels)


@pytest.mark.slow
def test_a_case_runs_end_to_end_on_cpu(gv, mlp_spec: dict,  # noqa: ANN001
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing one GPU run depends on, on the digits MLP on CPU: the peer and pgc's
    candidates built and timed in shuffled rounds, fidelity per arm, pgc's best among the
    faithful candidates, and a build past the time budget named, not run. (The peer here is
    the fp16 model uncompiled: max-autotune on CPU takes minutes.)"""
    model = mlp_spec["model"].eval()
    inputs = [tuple(ex) for ex in mlp_spec["example_inputs"][:4]]
    monkeypatch.setattr(gv, "load", lambda case, device="cuda": (model, inputs))

    def peer(m):  # noqa: ANN001, ANN202
        half = __import__("copy").deepcopy(m).half()
        return lambda *a: half(*(x.half() for x in a)).float()

    monkeypatch.setattr(gv, "peer", peer)
    built = []
    real_candidates = gv.candidates
    monkeypatch.setattr(gv, "candidates", lambda m: real_candidates(m)[:2])
    import compiler

    real_build = compiler.build

    def build_once(*a, **k):  # noqa: ANN002, ANN003, ANN202
        built.append(a[1].label())
        return real_build(*a, **k)

    monkeypatch.setattr(compiler, "build", build_once)
    out = gv.run_case("minilm_b1", deadline=__import__("time").monotonic() + 600, rounds=3)
    arms = out["arms"]
    assert {"fp32", "compiled fp16"} <= set(arms) and len(built) == 2
    assert set(built) <= set(arms) | set(out["skipped"])
    assert arms["fp32"]["cosine"] == pytest.approx(1.0) and all(a["ms"] > 0 for a in arms.values())
    assert out["pgc_best"] in built and out["over_compiled_fp16"] > 0
    late = gv.run_case("minilm_b1", deadline=0.0, rounds=1)  # no time left: nothing built
    assert set(late["arms"]) == {"fp32", "compiled fp16"} and late["pgc_best"] is None
    assert all(why == "out of the time budget" for why in late["skipped"].values())
