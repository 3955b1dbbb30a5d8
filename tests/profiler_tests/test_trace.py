"""Kineto has one activity profiler per process: two ``torch.profiler`` traces that overlap
end the process. Every trace pgc takes goes one at a time, and an application's own trace
can join the queue (``pgc_daemon.exclusive_trace``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, threading, time
    import torch
    from torch import nn
    import pgc_daemon
    from profiler import Profiler, ProfilerConfig

    # two attached models, each sampled on every call (a compiled variant's kernel timer),
    # and the application tracing a model of its own, all at once
    models = [nn.Sequential(nn.Linear(64, 64)) for _ in range(2)]
    profs = [Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
             for _ in models]
    for prof, m in zip(profs, models):
        prof.watch(m, kernels={"aten::linear": [["0"]]})
    x, stop, sampled, traced = torch.randn(8, 64), time.monotonic() + 3.0, [0, 0], [0]

    def serve(i):
        with torch.inference_mode():
            while time.monotonic() < stop:
                token = profs[i].begin(models[i])
                t = time.perf_counter_ns()
                models[i](x)
                profs[i].end(token, 1, (x,), {}, time.perf_counter_ns() - t)
                sampled[i] += token is not None
                time.sleep(0.0005)

    def own_traces():
        from torch.profiler import ProfilerActivity, profile
        while time.monotonic() < stop:
            with pgc_daemon.exclusive_trace(), profile(activities=[ProfilerActivity.CPU]):
                torch.mm(x, x.T)
            traced[0] += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=own_traces))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [[r.layer for r in p.close_window().layers] for p in profs]
    print(json.dumps({"sampled": sampled, "traced": traced[0], "rows": rows}))
""")


def test_traces_from_two_models_and_the_application_never_overlap() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "KINETO_LOG_LEVEL": "10"})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # was -11 (SIGSEGV)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # each model's calls were sampled and timed, and the application's traces all ran
    assert min(out["sampled"]) > 20, out
    assert out["traced"] > 20, out
    assert all("0" in layers for layers in out["rows"]), out
