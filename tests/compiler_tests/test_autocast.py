"""Inductor under bf16 autocast (a backend's ``autocast``): int8 kernels with bf16 between
them. The recipe part round-trips and leaves older hashes alone; a real build runs the glue
in bf16 and still answers in float32, close to fp32; its kernels are attributed to the
model's own layer names; and the search offers it only where the CPU has AMX."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compiler import Backend, Hardware, Quantization, Recipe, RecipeError, build
from compiler._kernel_map import ENV
from pgc_daemon.optimizer.search.offers import AUTOCAST_BACKENDS, MAX_AUTOTUNE, backends_for
from pgc_daemon.optimizer.search.space import build_space

STATIC = Quantization.of({"_default": "int8-static-pc"})


class Net(nn.Module):
    """Two int8 linears with a layer norm and a matmul between them (what autocast moves to
    bf16), ending in a linear (whose bf16 output the wrapper hands back as float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(x))
        return self.fc2(h @ (h.transpose(0, 1) @ h) / h.shape[0])


def test_the_part_round_trips_and_leaves_older_recipes_hashes_alone() -> None:
    plain = Recipe(quantization=STATIC, backend=Backend("inductor"))
    assert plain.to_dict()["backend"] == {"kind": "inductor", "mode": "default"}  # as before
    mixed = Recipe(quantization=STATIC, backend=Backend("inductor", "max-autotune", "bf16"))
    assert mixed.to_dict()["backend"] == {"kind": "inductor", "mode": "max-autotune",
                                          "autocast": "bf16"}
    assert Recipe.from_json(mixed.to_json()) == mixed and mixed.hash != plain.hash
    assert mixed.backend.label() == "inductor-max+bf16" == AUTOCAST_BACKENDS[1]
    for label in ("inductor+bf16", "inductor-max+bf16", "inductor", "openvino-f32"):
        assert Backend.parse(label).label() == label
    with pytest.raises(RecipeError, match="inductor backend only"):
        Backend("onnxruntime", autocast="bf16")
    with pytest.raises(RecipeError, match="autocast must be one of"):
        Backend("inductor", autocast="fp16")
    with pytest.raises(RecipeError, match="not a backend label"):
        Backend.parse("inductor+")


def test_a_package_under_autocast_computes_the_glue_in_bf16_and_answers_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "1")  # kernel events: the package's map of kernels to layers
    torch.manual_seed(0)
    model = Net().eval()
    calibration = [((torch.randn(8, 64),), {}) for _ in range(8)]
    x = torch.randn(8, 64)
    v = build(model, Recipe(quantization=STATIC, backend=Backend("inductor", autocast="bf16")),
              calibration=calibration, example=calibration[0])
    with torch.inference_mode():
        want, got = model(x), v.module(x)
    assert got.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0)
    assert cos > 0.99
    assert any("autocast (bf16)" in n for n in v.report.notes)
    summary = v.report.kernel_paths["<compiled>"]
    assert "AOTInductor package" in summary and "oneDNN int8 linear" in summary
    assert "bf16 constants" in summary  # the float ops' constants were cast by autocast
    layers = {layer for kernels in (v.kernel_layers or {}).values() for group in kernels
              for layer in group}
    assert {"fc1", "fc2"} <= layers  # the model's names, not the wrapper's
    assert not any("autocast" in layer for layer in layers)


def _hardware(**features: bool) -> Hardware:
    return Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True, **features})


def test_the_search_offers_bf16_between_int8_kernels_only_where_the_cpu_has_amx(mlp_spec) -> None:
    """The probe's answer forced: on AVX2 alone and on AVX-512-BF16 without AMX (where it
    measured slower) nothing changes; with AMX both autocast backends are offered and all-int8
    static through max-autotune under autocast is a baseline."""
    for hw in (_hardware(), _hardware(avx512f=True, avx512_bf16=True)):
        assert not set(backends_for(hw)) & set(AUTOCAST_BACKENDS)
    amx = _hardware(avx512f=True, avx512_bf16=True, amx_bf16=True, amx_int8=True)
    offered = backends_for(amx)
    assert set(AUTOCAST_BACKENDS) <= set(offered) and MAX_AUTOTUNE in offered
    space = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], amx,
                        backends=offered)
    baselines = [space.recipe(p) for p in space.baselines()]
    assert Recipe(quantization=STATIC, backend=Backend.parse("inductor-max+bf16")) in baselines
    assert Recipe(backend=Backend.parse("inductor+bf16")) in baselines  # fp32 under autocast
    plain = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], amx,
                        backends=backends_for(_hardware()))
    assert not any(r.backend.autocast for r in map(plain.recipe, plain.baselines()))
