"""pgc's Triton kernel (fused int8 weight-only linear) against a torch reference, on CPU under
``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before Triton is imported);
and the recipe choice that uses it, which on a CPU build must leave Triton alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from compiler import Kernels, Quantization, Recipe, build
from tests.compiler_tests.conftest import examples

pytest.importorskip("triton")

_INTERPRETED = (16, 32, 32, 1, 1)  # compiler._triton's one block choice under the interpreter

CHECK = textwrap.dedent(
    """
    import json, sys
    import torch
    from compiler._triton import TritonInt8Linear, int8_weight_only_linear, quantize_weight
    torch.manual_seed(0)
    rows = []
    for m, k, n in [(1, 40, 24), (17, 64, 50), (33, 96, 70)]:
        for act in ("none", "relu", "gelu"):
            for bias in (True, False):
                x, w = torch.randn(m, k), torch.randn(n, k)
                b = torch.randn(n) if bias else None
                q, s = quantize_weight(w)
                y = int8_weight_only_linear(x, q, s, b, act)
                ref = x @ (q.float() * s[:, None]).T + (b if bias else 0)
                ref = {"none": ref, "relu": torch.relu(ref), "gelu": torch.nn.functional.gelu(ref)}[act]
                rows.append({"shape": [m, k, n], "act": act, "bias": bias,
                             "err": float((y - ref).abs().max()), "dtype": str(y.dtype), "out": list(y.shape)})
    lin = torch.nn.Linear(48, 32)
    x = torch.randn(2, 5, 48)
    mod = TritonInt8Linear(lin, act="relu")
    with torch.no_grad():
        ref = torch.relu(lin(x))
        got = mod(x)
    rows.append({"module_rel_err": float((got - ref).norm() / ref.norm()), "out": list(got.shape)})
    print(json.dumps(rows))
    """
)


def _interpret(code: str) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_int8_weight_only_linear_matches_the_torch_reference() -> None:
    rows = _interpret(CHECK)
    kernel_rows = [r for r in rows if "err" in r]
    assert len(kernel_rows) == 18
    for r in kernel_rows:
        assert r["err"] < 1e-3, r
        assert r["out"] == [r["shape"][0], r["shape"][2]] and r["dtype"] == "torch.float32"
    module = rows[-1]
    assert module["out"] == [2, 5, 32] and module["module_rel_err"] < 0.02


def test_the_kernel_is_an_operator_that_compiled_graphs_keep() -> None:
    """``torch.ops.pgc.int8_weight_only_linear`` is a ``triton_op``: export traces a model that
    uses it without running the kernel (its fake output follows the body: shape and dtype),
    and keeps the operator in the graph, where Inductor launches the Triton kernel from its
    generated code (on a GPU: no Python launcher, CUDA graphs allowed). The block sizes are
    the autotuner's, pruned to one under the interpreter, so nothing is timed on CPU."""
    code = textwrap.dedent(
        """
        import json
        import torch
        from compiler import _triton
        from compiler._triton import TritonInt8Linear
        m = TritonInt8Linear(torch.nn.Linear(64, 50), act="relu")
        ep = torch.export.export(m, (torch.randn(3, 7, 64),))
        calls = [n for n in ep.graph.nodes if n.op == "call_function"]
        val = calls[0].meta["val"]
        rows = [c.kwargs["BLOCK_M"] for c in _triton._prune(
            _triton._int8_weight_only_linear.configs, {"M_BUCKET": 1})]
        print(json.dumps({"ops": [str(n.target) for n in calls], "shape": list(val.shape),
                          "dtype": str(val.dtype), "block_m": sorted(set(rows)),
                          "op": hasattr(torch.ops.pgc, "int8_weight_only_linear")}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items()
                                            if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["op"] and got["ops"] == ["pgc.int8_weight_only_linear.default"]
    assert got["shape"] == [3, 7, 50] and got["dtype"] == "torch.float32"
    assert got["block_m"] == [16]  # one row: blocks of at most 16 rows are timed
    pruned = _interpret(textwrap.dedent(
        """
        import json
        from compiler import _triton
        print(json.dumps([_triton._shape(c) for c in _triton._prune(
            _triton._int8_weight_only_linear.configs, {"M_BUCKET": 64})]))
        """))
    assert pruned == [list(_INTERPRETED)]


def test_a_model_with_a_dynamic_batch_exports_with_the_kernel_and_keeps_it_dynamic() -> None:
    """Export runs the autotuner's pruning on the operator's arguments while it traces. The
    pruning read the row count with ``int()``, which pinned a dynamic batch to the example's
    (a constraint violation: no build of a recipe with a dynamic axis could take the kernel).
    A symbolic row count keeps every candidate; a real launch still prunes by its rows."""
    code = textwrap.dedent(
        """
        import json
        import torch
        from compiler import _triton
        from compiler._triton import TritonInt8Linear
        m = TritonInt8Linear(torch.nn.Linear(64, 50), act="gelu")
        b = torch.export.Dim("b", min=1, max=1024)
        ep = torch.export.export(m, (torch.randn(3, 7, 64),), dynamic_shapes=({0: b},))
        calls = [n for n in ep.graph.nodes if n.op == "call_function"]
        configs = _triton._int8_weight_only_linear.configs
        print(json.dumps({"ops": [str(n.target) for n in calls],
                          "shape": [str(d) for d in calls[0].meta["val"].shape],
                          "ranges": [[int(r.lower), int(r.upper)]
                                     for r in ep.range_constraints.values()],
                          "one_row": len(_triton._prune(configs, {"M_BUCKET": 1})),
                          "configs": len(configs)}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items()
                                            if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ops"] == ["pgc.int8_weight_only_linear.default"]
    assert got["shape"][1:] == ["7", "50"] and not got["shape"][0].isdigit()  # symbolic
    assert got["ranges"] == [[1, 1024]]
    assert 1 <= got["one_row"] < got["configs"]  # real launches are still pruned


def test_kernel_rejects_what_it_cannot_run() -> None:
    code = textwrap.dedent(
        """
        import torch
        from compiler._triton import int8_weight_only_linear
        for bad in [dict(act="silu"), dict(weight=torch.ones(4, 4))]:
            try:
                int8_weight_only_linear(torch.ones(2, 4), bad.get("weight", torch.ones(4, 4, dtype=torch.int8)),
                                        torch.ones(4), act=bad.get("act", "none"))
            except ValueError:
                print("refused")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["refused", "refused"], out.stderr[-2000:]


def test_a_cpu_build_with_the_triton_choice_keeps_the_default_path_and_says_why(mlp_spec: dict[str, Any]) -> None:
    recipe = Recipe(kernels=Kernels("triton"), quantization=Quantization.of({"_default": "int8-weight_only-pc"}))
    built = build(mlp_spec["model"], recipe)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU test covers it")
    assert any("triton not used" in n for n in built.report.notes)
    assert all("torchao" in built.report.kernel_paths[n] for n in ("net.1", "net.3", "net.5"))
    code = textwrap.dedent(
        """
        import sys
        from pgc_daemon.examples import digits
        from compiler import Kernels, Quantization, Recipe, build
        spec = digits.mlp()
        build(spec["model"], Recipe(kernels=Kernels("triton"),
              quantization=Quantization.of({"_default": "int8-weight_only-pc"})))
        print("compiler._triton" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


@pytest.mark.gpu
def test_triton_kernel_replaces_weight_only_layers_on_a_gpu(mlp_spec: dict[str, Any]) -> None:
    model = mlp_spec["model"].to("cuda").half()
    recipe = Recipe(kernels=Kernels("triton"), quantization=Quantization.of({"_default": "int8-weight_only-pc"}))
    built = build(model, recipe)
    assert all("Triton" in built.report.kernel_paths[n] for n in ("net.1", "net.3", "net.5"))
    x = examples(mlp_spec, 1)[0][0][0].to("cuda").half()
    with torch.inference_mode():
        ref, out = model(x), built.module(x)
    assert (ref.argmax(-1) == out.argmax(-1)).float().mean() > 0.95
