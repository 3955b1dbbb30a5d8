"""``pgc doctor``: what this machine offers pgc, and what pgc will therefore use.

torch and its CUDA build, the NVIDIA driver and whether the two are compatible, CUPTI and
Triton, perf counters, CPU features (from ``compiler.probe()``, the one shared hardware
probe), a C++ compiler for Inductor on CPU, and what the process's thread settings cost (a
small model called from a second thread against the first, the OpenMP effect behind pgc's
serving executor). Nothing here fails: a missing piece is reported with the reason and what
pgc does without it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ORDER = 90


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check torch, CUDA, CUPTI, Triton, perf counters and CPU features",
        description="Report what this machine offers pgc (versions, compatibility, features) "
        "and what pgc will therefore use.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _version(dist: str) -> str | None:
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cuda_version(encoded: int) -> str:
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _parse(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def driver_info() -> dict[str, Any]:
    """The NVIDIA driver: the CUDA version it supports (``cuDriverGetVersion`` through
    ctypes) and its release (nvidia-smi, when present)."""
    info: dict[str, Any] = {"present": False, "cuda": None, "release": None, "detail": None}
    lib = None
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        info["detail"] = "no NVIDIA driver library (libcuda.so.1) on this machine"
        return info
    version = ctypes.c_int(0)
    try:
        rc = lib.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:
        rc = -1
    if rc != 0:
        info["detail"] = f"cuDriverGetVersion failed (error {rc})"
        return info
    info.update(present=True, cuda=_cuda_version(version.value))
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False,
            )
            release = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
            info["release"] = release
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def compatibility(runtime: str | None, driver_cuda: str | None) -> tuple[bool | None, str]:
    """Whether a driver that supports CUDA ``driver_cuda`` runs a torch built for
    ``runtime``."""
    r, d = _parse(runtime), _parse(driver_cuda)
    if r is None:
        return None, "torch is a CPU-only build: no CUDA runtime to match"
    if d is None:
        return False, f"torch needs a driver for CUDA {runtime}; none was found"
    if d >= r:
        return True, f"the driver supports CUDA {driver_cuda} >= {runtime} (torch's build)"
    if d[0] == r[0]:
        return True, (f"minor-version compatibility: driver CUDA {driver_cuda} < {runtime}; "
                      "most kernels run, PTX JIT of newer code may fail")
    return False, f"the driver supports CUDA {driver_cuda} only; torch needs {runtime}"


#: The thread-cost probe: a small MLP (many short parallel ops, where OpenMP barriers weigh
#: most), called from this thread and from a second one, in interleaved rounds.
PROBE_WIDTH, PROBE_DEPTH, PROBE_BATCH, PROBE_ROUNDS, PROBE_ROUND_S = 256, 8, 16, 3, 0.12
PROBE_BUDGET_S = 2.0
#: A second thread this much slower than the first is worth the executor's hand-off.
COSTLY_RATIO = 1.15


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _probe_ms(model: Any, x: Any, calls: int) -> float:
    import torch  # noqa: PLC0415

    times = []
    with torch.inference_mode():
        for _ in range(calls):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def thread_cost() -> dict[str, Any]:
    """torch's thread settings, and what a call from a second thread costs against one from the
    first. libgomp keeps an OpenMP team for every thread that ran parallel torch work; with
    more such threads than cores its barriers sleep instead of spinning, and every call slows
    down. About a second."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from pgc_daemon.settings import Settings  # noqa: PLC0415

    intra, cores = torch.get_num_threads(), _usable_cores()
    info: dict[str, Any] = {
        "intra_op": intra, "inter_op": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "cores": cores, "cpu_count": os.cpu_count(),
        "backend": next((line.split(":", 1)[1].strip() for line in
                         torch.__config__.parallel_info().splitlines()
                         if line.startswith("ATen parallel backend")), None),
    }
    try:
        executor = Settings().executor
    except Exception:  # noqa: BLE001 - a bad PGC_* variable is for other checks to report
        executor = None
    info["executor_default"] = intra > 1 if executor is None else executor
    layers: list[nn.Module] = []
    for _ in range(PROBE_DEPTH):
        layers += [nn.Linear(PROBE_WIDTH, PROBE_WIDTH), nn.GELU()]
    model, x = nn.Sequential(*layers).eval(), torch.randn(PROBE_BATCH, PROBE_WIDTH)
    started = time.perf_counter()
    _probe_ms(model, x, 5)
    calls = max(5, min(500, int(PROBE_ROUND_S / max((time.perf_counter() - started) / 5, 1e-6))))
    first: list[float] = []
    second: list[float] = []
    for _ in range(PROBE_ROUNDS):
        if first and time.perf_counter() - started > PROBE_BUDGET_S:
            break
        first.append(_probe_ms(model, x, calls))
        t = threading.Thread(target=lambda: second.append(_probe_ms(model, x, calls)),
                             name="pgc-doctor-second")
        t.start()
        t.join()
    first_ms, second_ms = statistics.median(first), statistics.median(second)
    ratio = second_ms / first_ms
    info.update(first_thread_ms=first_ms, second_thread_ms=second_ms, second_thread_ratio=ratio)
    info["advice"] = _thread_advice(info)
    return info


def _thread_advice(t: dict[str, Any]) -> str:
    intra, cores, ratio = t["intra_op"], t["cores"], t["second_thread_ratio"]
    onoff = "on" if t["executor_default"] else "off"
    if intra > cores:
        return (f"torch runs {intra} intra-op threads on {cores} usable cores: set "
                f"OMP_NUM_THREADS={cores} (or torch.set_num_threads({cores})) before serving")
    if intra == 1:
        return (f"one intra-op thread: no OpenMP team to share, calls from any thread cost the "
                f"same ({ratio:.2f}x); pgc's executor is {onoff} by default")
    if ratio <= 1 / COSTLY_RATIO:
        return (f"the first thread ran the probe {1 / ratio:.2f}x slower than a second one: other "
                "processes take cores from this one's OpenMP team, whose barriers spin while it is "
                "alone; on a shared host start the server with OMP_WAIT_POLICY=PASSIVE (barriers "
                f"sleep), or measure again when it is quiet. pgc's executor is {onoff} by default")
    if ratio >= COSTLY_RATIO:
        return (f"a second thread ran the probe {ratio:.2f}x slower than the first: serve "
                f"through pgc's executor (one inference thread per model; {onoff} by default, "
                "attach(executor=True)) and keep torch work off other long-lived threads")
    return (f"a second thread ran the probe at {ratio:.2f}x the first's time: threads cost "
            f"little here; pgc's executor is {onoff} by default")


def collect() -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from compiler import FP8_CAPABILITY, probe  # noqa: PLC0415
    from profiler import availability  # noqa: PLC0415

    hw = probe()
    prof = availability()
    runtime = torch.version.cuda
    driver = driver_info()
    ok, why = compatibility(runtime, driver["cuda"])
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i),
                            "capability": f"{cap[0]}.{cap[1]}", "fp8": cap >= FP8_CAPABILITY})
    cupti_version = _version("cupti-python")
    cupti = dict(prof["cupti"], version=cupti_version, library=_version("nvidia-cuda-cupti"))
    cm, dm = _parse(cupti_version), _parse(driver["cuda"])
    if cupti["available"] and cm is not None and dm is not None and cm[0] > dm[0]:
        cupti["available"] = False
        cupti["detail"] = (f"cupti-python {cupti_version} needs a driver for CUDA {cm[0]}; "
                           f"this one supports {driver['cuda']}")
    rm = _parse(runtime)
    if cm is not None and rm is not None and cm[0] != rm[0]:
        cupti["note"] = (f"torch is built for CUDA {runtime} and cupti-python for {cm[0]}.x: two "
                         "CUPTI libraries in one process; keep torch.profiler off while pgc traces")
    triton_version = _version("triton")
    if triton_version is None:
        triton = {"available": False, "version": None, "detail": "not installed"}
    elif not devices:
        triton = {"available": False, "version": triton_version,
                  "detail": f"triton {triton_version} is installed; its kernels need a GPU"}
    else:
        triton = {"available": True, "version": triton_version, "detail": f"triton {triton_version}"}
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    feats = hw.features
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "pgc": _version("pgc"),
        "torch": {"version": torch.__version__, "cuda_build": runtime,
                  "cpu_capability": hw.torch_cpu_capability, "threads": torch.get_num_threads()},
        "cuda": {"runtime": runtime, "driver": driver, "compatible": ok, "detail": why,
                 "devices": devices},
        "cupti": cupti,
        "triton": triton,
        "perf_counters": prof["perf_counters"],
        "cuda_events": prof["cuda_events"],
        "host_stats": prof["host_stats"],
        "cpu": {"name": hw.cpu, "generation": hw.generation, "arch": hw.arch, "cores": hw.cores,
                "avx2": feats.get("avx2", False), "avx512": feats.get("avx512", False),
                "vnni": bool(feats.get("avx512_vnni") or feats.get("avx_vnni")),
                "amx": bool(feats.get("amx_int8") or feats.get("amx_bf16")),
                "bf16": bool(feats.get("avx512_bf16") or feats.get("amx_bf16")),
                "features": feats, "int8_fast": hw.int8_fast, "bf16_fast": hw.bf16_fast},
        "cxx_compiler": cxx,
        "threads": thread_cost(),
    }
    report["uses"] = uses(report)
    return report


def uses(r: dict[str, Any]) -> list[str]:
    """What pgc will use here, one line each."""
    out = []
    pc = r["perf_counters"]
    if pc["mode"] == "hardware":
        out.append(f"per-layer CPU counters: hardware ({', '.join(pc['events'])}), with IPC")
    elif pc["mode"] == "software":
        out.append(f"per-layer CPU counters: software only ({', '.join(pc['events'])}); "
                   f"hardware events off: {pc['reason']}")
    else:
        out.append(f"per-layer CPU counters: off ({pc['reason']}); wall time only")
    if r["cuda"]["devices"] and r["cuda"]["compatible"]:
        gpu = "GPU layers: CUDA events (resolved off the request path)"
        gpu += ", CUPTI kernel records" if r["cupti"]["available"] else f"; CUPTI off: {r['cupti']['detail']}"
        out.append(gpu)
        fp8 = [d["name"] for d in r["cuda"]["devices"] if d["fp8"]]
        out.append("GPU models: fp16, bf16, int8 weight-only (pgc's Triton kernel)"
                   + (f" and fp8 ({', '.join(fp8)})" if fp8 else
                      "; no fp8 (float8 tensor cores need compute capability 8.9)")
                   + " are searched, through Inductor")
    else:
        out.append(f"GPU profiling: off ({r['cuda_events']['detail']})")
    cpu = r["cpu"]
    if cpu["int8_fast"]:
        paths = [n for n, k in (("AMX-INT8", "amx_int8"), ("AVX512-VNNI", "avx512_vnni"),
                                ("AVX-VNNI", "avx_vnni")) if cpu["features"].get(k)]
        out.append(f"int8: fast path ({', '.join(paths)}); int8 variants are searched, compiled")
    else:
        out.append("int8: no VNNI/AMX, int8 variants rarely pay here (still measured)")
    out.append("bf16: fast path (AVX512-BF16/AMX-BF16)" if cpu["bf16_fast"]
               else "bf16: emulated on this CPU; slower than fp32")
    if cpu["features"].get("amx_bf16"):
        out.append("AMX: int8 kernels with bf16 between them are searched "
                   "(inductor+bf16, inductor-max+bf16)")
    if r["cxx_compiler"]:
        out.append(f"torch.compile (Inductor) on CPU: C++ compiler {r['cxx_compiler']}")
    else:
        out.append("torch.compile (Inductor) on CPU: off, no C++ compiler on PATH; eager only")
    out.append("Triton kernels: on" if r["triton"]["available"] else f"Triton kernels: off ({r['triton']['detail']})")
    out.append(f"host statistics: {r['host_stats']['detail']}" if r["host_stats"]["available"]
               else f"host statistics: off ({r['host_stats']['detail']})")
    if r["threads"]["executor_default"]:
        out.append("serving: one inference thread per attached model (the executor); request "
                   "threads hand their calls to it")
    else:
        out.append("serving: calls run in the request threads (executor off: one intra-op "
                   "thread, or PGC_EXECUTOR=0)")
    return out


def render(r: dict[str, Any]) -> None:
    from rich.console import Console  # noqa: PLC0415

    c = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 160)

    def line(ok: bool | None, label: str, text: str) -> None:
        mark = {True: "[green]✓[/green]", False: "[red]✗[/red]", None: "[yellow]–[/yellow]"}[ok]
        c.print(f" {mark} {label:<16} {text}")

    t = r["torch"]
    cuda = r["cuda"]
    drv = cuda["driver"]
    c.print("[bold]pgc doctor[/bold]")
    line(True, "python", r["python"] + (f", pgc {r['pgc']}" if r["pgc"] else ""))
    line(True, "torch", f"{t['version']} (CUDA build: {t['cuda_build'] or 'none'}; CPU kernels "
         f"{t['cpu_capability']}; {t['threads']} threads)")
    line(drv["present"] or None, "NVIDIA driver",
         f"CUDA {drv['cuda']}" + (f", release {drv['release']}" if drv["release"] else "")
         if drv["present"] else drv["detail"])
    line(cuda["compatible"], "compatibility", cuda["detail"])
    for d in cuda["devices"]:
        line(True, f"GPU {d['index']}", f"{d['name']} (sm {d['capability']})")
    cu = r["cupti"]
    gpu = bool(cuda["devices"])

    def gpu_mark(ok: bool) -> bool | None:
        return ok if gpu else (None if not ok else True)  # no GPU: "not applicable", not a fault

    line(gpu_mark(cu["available"]), "CUPTI", cu["detail"] + (f" — {cu['note']}" if cu.get("note") else ""))
    line(gpu_mark(r["cuda_events"]["available"]), "CUDA events", r["cuda_events"]["detail"])
    line(gpu_mark(r["triton"]["available"]), "Triton", r["triton"]["detail"])
    pc = r["perf_counters"]
    line(pc["mode"] != "off", "perf counters", pc["summary"] + f" (perf_event_paranoid={pc['paranoid']})")
    cpu = r["cpu"]
    flags = ", ".join(f"{k} {'yes' if cpu[k] else 'no'}" for k in ("avx2", "avx512", "vnni", "amx", "bf16"))
    name = f"{cpu['name']} ({cpu['generation']})" if cpu["generation"] else cpu["name"]
    line(True, "CPU", f"{name}, {cpu['cores']} cores: {flags}")
    line(bool(r["cxx_compiler"]), "C++ compiler", r["cxx_compiler"] or "none on PATH (Inductor on CPU needs one)")
    th = r["threads"]
    line(th["second_thread_ratio"] < COSTLY_RATIO and th["intra_op"] <= th["cores"] or None, "threads",
         f"torch {th['intra_op']} intra-op / {th['inter_op']} inter-op on {th['cores']} cores "
         f"(OMP_NUM_THREADS={th['omp_num_threads'] or 'unset'}, {th['backend'] or '?'}); a second "
         f"thread: {th['second_thread_ms']:.2f} ms vs {th['first_thread_ms']:.2f} ms "
         f"({th['second_thread_ratio']:.2f}x)")
    c.print(f"   {'':<16} {th['advice']}")
    c.print("[bold]pgc will use[/bold]")
    for u in r["uses"]:
        c.print(f"  • {u}")


def run(args: argparse.Namespace) -> int:
    report = collect()
    render(report)
    if args.json:
        print(json.dumps(report, default=str), flush=True)
    return 0
