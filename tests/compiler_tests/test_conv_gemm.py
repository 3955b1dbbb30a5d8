"""Convolutions as one GEMM each (``compiler._conv_gemm``): the GEMM form computes what the
convolution does for every geometry it takes, only plain convolutions are replaced, and on the
digits CNN the quantizer makes each of them an int8 linear whose kernels the profile names
after the convolution."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from compiler import Backend, CompileCache, Fusion, Quantization, Recipe, build, compare
from compiler._conv_gemm import MAX_ROWS, GemmConv, convs_as_gemm, has_eligible_convs
from compiler._registry import BuildContext, BuildReport

GEMMS = Fusion(conv_bn=True, conv_gemm=True)
INT8 = Quantization.of({"_default": "int8-static-pc"})
CONVS = ("features.0", "features.3", "features.7")


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (dict(in_channels=3, out_channels=8, kernel_size=3, padding=1), (2, 3, 9, 7)),
        (dict(in_channels=4, out_channels=6, kernel_size=(3, 5), stride=2, padding=(1, 2),
              bias=False), (1, 4, 11, 10)),
        (dict(in_channels=5, out_channels=7, kernel_size=1), (2, 5, 6, 6)),
        (dict(in_channels=3, out_channels=4, kernel_size=3, padding="valid", dilation=2),
         (1, 3, 12, 12)),
        (dict(in_channels=2, out_channels=3, kernel_size=2, stride=(2, 1), padding=(0, 1)),
         (3, 2, 7, 5)),
    ],
)
def test_a_convolution_as_one_gemm_computes_what_the_convolution_does(
    conv: dict[str, Any], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    original = nn.Conv2d(**conv).eval()
    gemm = GemmConv(original)
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = original(x), gemm(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.is_contiguous()  # NCHW in, NCHW out: a later ``view`` works as before
        last = x.to(memory_format=torch.channels_last)
        torch.testing.assert_close(gemm(last), original(last), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gemm(x[0]), original(x[0]), atol=1e-5, rtol=1e-5)
    assert isinstance(gemm, nn.Linear) and "as one GEMM" in repr(gemm)


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (dict(in_channels=8, out_channels=16, kernel_size=3, padding=1), (2, 8, 9)),
        (dict(in_channels=4, out_channels=6, kernel_size=5, stride=2, dilation=2, bias=False),
         (1, 4, 23)),
        (dict(in_channels=6, out_channels=3, kernel_size=1, padding="valid"), (3, 6, 5)),
    ],
)
def test_a_1d_convolution_is_the_case_of_one_row(conv: dict[str, Any],
                                                 shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    original = nn.Conv1d(**conv).eval()
    gemm = GemmConv(original)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(gemm(x), original(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gemm(x[0]), original(x[0]), atol=1e-5, rtol=1e-5)
    assert gemm(x).is_contiguous() and "1d, " in repr(gemm)


def test_only_plain_convolutions_without_groups_are_replaced() -> None:
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),  # depthwise: no one GEMM
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(8, 8, 3, padding="same"),
        nn.Sequential(nn.Conv2d(8, 4, 1)),
    ).eval()
    assert has_eligible_convs(model) and not has_eligible_convs(model[1])
    want = model(x := torch.randn(1, 4, 6, 6))
    ctx = BuildContext(calibration=[], example=None, report=BuildReport(),
                       recipe=Recipe(fusion=GEMMS, backend=Backend("inductor")))
    convs_as_gemm(model, ctx)
    assert [type(m).__name__ for m in (model[0], model[1], model[2], model[3], model[4][0])] == [
        "GemmConv", "Conv2d", "Conv2d", "Conv2d", "GemmConv"]
    assert set(ctx.report.applied) == {"0", "4.0"}  # names kept: rules and rows still match
    assert ctx.report.notes[-1] == "fusion: 2 convolution(s) run as one GEMM each"
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)

    other = nn.Sequential(nn.Conv2d(4, 8, 3))
    ort = BuildContext(calibration=[], example=None, report=BuildReport(),
                       recipe=Recipe(fusion=GEMMS, backend=Backend("onnxruntime")))
    assert type(convs_as_gemm(other, ort)[0]) is nn.Conv2d  # no Inductor to fuse the copies
    assert "left as they are" in ort.report.notes[-1]


def test_a_convolution_over_a_large_map_stays_a_convolution() -> None:
    """As GEMMs the digits CNN lost at batch 16 and 256 (1 024 and 16 384 rows), won at 1."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(4),
                          nn.Conv2d(4, 4, 3, padding=1)).eval()
    x = torch.randn(1, 3, 72, 72)  # 5 184 rows, then 324 after the pooling
    ctx = BuildContext(calibration=[], example=((x,), {}), report=BuildReport(),
                       recipe=Recipe(fusion=GEMMS, backend=Backend("inductor")))
    want = model(x)
    convs_as_gemm(model, ctx)
    assert [type(m).__name__ for m in (model[0], model[2])] == ["Conv2d", "GemmConv"]
    assert ctx.report.notes[-1] == ("fusion: 1 convolution(s) run as one GEMM each; "
                                    f"1 over {MAX_ROWS} rows left as convolutions")
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_the_recipe_part_is_written_only_when_on() -> None:
    assert "conv_gemm" not in Fusion(conv_bn=True).to_dict()  # older recipes keep their hashes
    recipe = Recipe(fusion=GEMMS, backend=Backend("inductor"))
    assert recipe.label() == "fp32 · inductor · fuse:conv_bn+conv_gemm"
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    assert recipe.hash != Recipe(fusion=Fusion(conv_bn=True), backend=Backend("inductor")).hash


def test_the_digits_cnn_as_gemms_quantizes_every_convolution_and_names_its_kernels(
    cnn_spec: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``as_linears`` the quantizer found no linear in a GemmConv (non-strict
    export names its module, not ``nn.Linear``) and left the three convolutions float."""
    monkeypatch.setenv("PGC_KERNEL_PROFILE", "1")  # a kernel map to read
    model = cnn_spec["model"]
    examples = [(x[:1],) for x, in cnn_spec["example_inputs"][:8]]  # served one at a time
    cal = [(tuple(a), {}) for a in examples]
    built = build(copy.deepcopy(model), Recipe(fusion=GEMMS, quantization=INT8,
                                               backend=Backend("inductor")),
                  calibration=cal, example=cal[0], cache=CompileCache(tmp_path))
    assert {n: built.report.applied.get(n) for n in CONVS} == dict.fromkeys(CONVS,
                                                                           "int8-static-pc")
    assert "fusion: 3 convolution(s) run as one GEMM each" in built.report.notes
    mapped = {layer for calls in built.kernel_layers.values() for layers in calls
              for layer in layers}
    assert set(CONVS) <= mapped  # the profile's rows name the convolutions
    with torch.inference_mode():
        for args in examples:
            assert compare(model(*args), built.module(*args))["cosine"] > 0.99
