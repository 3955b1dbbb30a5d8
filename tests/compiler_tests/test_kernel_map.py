"""Which layers each kernel of a compiled package computes (``compiler._kernel_map``), where
Inductor's own provenance is wrong: an int8 residual network, whose max-pool Inductor gives
the anchor of a convolution several kernels later, whose shortcut convolutions share the
anchor of the convolution fused with the residual add, and whose last linear it names after
no node at all. Before: 24% of an int8 ResNet-18's time went to ``(root)`` and the
max-pool's row held a convolution's layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compiler import Backend, CompileCache, Fusion, Layout, Quantization, Recipe, build
from compiler._kernel_map import ENV, ROOT, assign


class Block(nn.Module):
    """A basic residual block (as ``transformers``' ResNet writes it: ``h += shortcut``)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.shortcut(x)
        h = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        h += residual
        return self.act(h)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.block1 = Block(16, 16, 1)
        self.block2 = Block(16, 32, 2)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.avg(self.block2(self.block1(self.pool(self.stem(x)))))))


@pytest.fixture(scope="module")
def resnet_map(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[str]]]:
    torch.manual_seed(0)
    model = TinyResNet().eval()
    for m in model.modules():  # trained-looking statistics, so int8 has a range to keep
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}),
                    backend=Backend("inductor"), fusion=Fusion(conv_bn=True, conv_bn_relu=True),
                    layout=Layout("channels_last"))
    examples = [((torch.randn(1, 3, 32, 32),), {}) for _ in range(4)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1")  # packages with kernel events and their map
        v = build(model, recipe, calibration=examples,
                  cache=CompileCache(tmp_path_factory.mktemp("cache")))
    kmap = v.module.kernel_layers
    assert kmap is not None
    return kmap


def _calls(kmap: dict[str, list[list[str]]], part: str) -> list[list[str]]:
    return [layers for name, calls in kmap.items() if part in name for layers in calls]


def test_an_int8_resnets_library_calls_are_its_layers(resnet_map) -> None:
    assert _calls(resnet_map, "max_pool2d") == [["pool"]]
    assert [sorted(c) for c in _calls(resnet_map, "qlinear")] == [["fc", "flat"]]
    convs = _calls(resnet_map, "qconv")
    assert len(convs) == 6  # one int8 library call per convolution
    conv_layers = {"stem.0", "block1.conv1", "block1.conv2", "block2.conv1", "block2.conv2",
                   "block2.shortcut.0"}
    held = [layer for layers in convs for layer in layers if layer in conv_layers]
    assert sorted(held) == sorted(conv_layers), convs  # each in exactly one kernel
    assert all(len(conv_layers & set(layers)) == 1 for layers in convs), convs
    # a convolution fused with its block's residual add also carries the add and its ReLU
    for block in ("block1", "block2"):
        fused = [layers for layers in _calls(resnet_map, "binary") if block in layers]
        assert len(fused) == 1 and f"{block}.act" in fused[0], resnet_map
        assert all(x.startswith(block) for x in fused[0]), fused
    rooted = [name for name, calls in resnet_map.items() for layers in calls if ROOT in layers]
    assert all("quantize" in name for name in rooted), rooted  # the input's, only


def test_kernels_off_the_graphs_order_take_what_their_library_call_is_named_after() -> None:
    """The recorded shape of the provenance above, small: a max-pool given a later kernel's
    node and a linear given none."""
    layers_of = {"conv": ("stem",), "relu": ("stem.act",), "q1": None, "pool": ("pool",),
                 "q2": None, "conv2": ("block.conv",), "add": ("block",), "q3": None,
                 "flat": ("flat",), "linear": ("fc",)}
    graph = {"conv": ("aten.conv2d.default", []), "relu": ("aten.relu.default", ["conv"]),
             "q1": ("quantized_decomposed.quantize_per_tensor.default", ["relu"]),
             "pool": ("aten.max_pool2d.default", ["q1"]),
             "q2": ("quantized_decomposed.quantize_per_tensor.default", ["pool"]),
             "conv2": ("aten.conv2d.default", ["q2"]), "add": ("aten.add.Tensor", ["conv2"]),
             "q3": ("quantized_decomposed.quantize_per_tensor.default", ["add"]),
             "flat": ("aten.flatten.using_ints", ["q3"]), "linear": ("aten.linear.default",
                                                                    ["flat"])}
    kernels = [("aoti_torch_cpu__qconv_pointwise_tensor", ["q1"]),
               ("aoti_torch_cpu_max_pool2d", ["q3"]),  # Inductor's mistake: a later conv's
               ("cpp_fused_quantize_per_tensor_0", ["q2"]),
               ("aoti_torch_cpu__qconv2d_pointwise_binary_tensor", ["q3"]),
               ("aoti_torch_cpu__qlinear_pointwise_tensor", [])]
    got = assign(kernels, layers_of, graph)
    assert got == {"aoti_torch_cpu__qconv_pointwise_tensor": [["stem", "stem.act"]],
                   "aoti_torch_cpu_max_pool2d": [["pool"]],
                   "cpp_fused_quantize_per_tensor_0": [["(root)"]],
                   "aoti_torch_cpu__qconv2d_pointwise_binary_tensor": [["block.conv", "block"]],
                   "aoti_torch_cpu__qlinear_pointwise_tensor": [["fc", "flat"]]}


def test_kernels_named_after_no_node_at_all_are_not_given_every_layer() -> None:
    layers_of = {"a": ("x",), "b": ("y",)}
    graph = {"a": ("aten.relu.default", []), "b": ("aten.sigmoid.default", ["a"])}
    got = assign([("cpp_fused_relu_0", []), ("cpp_fused_sigmoid_1", [])], layers_of, graph)
    assert got == {"cpp_fused_relu_0": [[ROOT]], "cpp_fused_sigmoid_1": [[ROOT]]}
