"""Process, HTTP and accounting helpers of the fault campaign. Every process started here is
registered and killed (with its descendants) when the scenario ends, and again at exit."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TOKEN = "faults-harness-token"
MODEL = "digits"
#: calls slower than this count as a stall of serving
STALL_MS = 1000.0
OPEN_STATES = {"candidate", "building", "warming", "verifying", "canary"}
IN_FLIGHT = {"building", "warming", "verifying", "canary"}

_ALL: list[psutil.Process] = []


def _kill_tree(proc: psutil.Process) -> None:
    try:
        family = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        family = [proc]
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=5)


def kill_all() -> None:
    while _ALL:
        _kill_tree(_ALL.pop())


atexit.register(kill_all)


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_info() -> dict[str, Any]:
    from compiler.hardware import cpu_flags, probe

    hw, flags = probe(), cpu_flags()
    return {
        "model": hw.cpu,
        "generation": hw.generation,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "amx": bool(flags & {"amx_tile", "amx_bf16", "amx_int8"}),
    }


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 15.0,
) -> tuple[int, Any]:
    """(status, parsed JSON or text); status 0 with the error text when nothing answered."""
    data = raw
    hdrs = dict(headers or {})
    if body is not None and raw is None:
        data = json.dumps(body).encode()
        hdrs.setdefault("content-type", "application/json")
    if token:
        hdrs.setdefault("authorization", f"Bearer {token}")
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - connection refused, timeout, reset
        return 0, f"{type(e).__name__}: {e}"
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@dataclass
class Agent:
    proc: psutil.Process
    status_path: Path
    started: float

    def records(self) -> list[dict[str, Any]]:
        try:
            lines = self.status_path.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return [r for r in out if r.get("pid") == self.proc.pid]

    def last(self) -> dict[str, Any] | None:
        recs = self.records()
        return recs[-1] if recs else None


@dataclass
class Ctx:
    """One scenario's world: a temp dir, a store, the processes it started."""

    name: str
    model: str = "mlp"
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pgc-faults-")))
    store_url: str | None = None
    procs: list[psutil.Process] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)
    port: int | None = None
    serve_proc: psutil.Process | None = None
    mounts: list[Path] = field(default_factory=list)
    preexec: list[str] = field(default_factory=list)
    """a command prefix for the agent and pgc serve (e.g. setpriv dropping capabilities)"""

    def __post_init__(self) -> None:
        if self.store_url is None:
            self.store_url = f"sqlite:///{self.dir / 'store' / 'pgc.db'}"
            (self.dir / "store").mkdir(parents=True, exist_ok=True)
        (self.dir / "work").mkdir(exist_ok=True)
        os.chmod(self.dir / "work", 0o700)

    @property
    def db_path(self) -> Path:
        return self.dir / "store" / "pgc.db"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, argv: list[str], out: Path, env: dict[str, str]) -> psutil.Process:
        with open(out, "ab") as fh:
            p = subprocess.Popen(
                [*self.preexec, *argv], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )
        proc = psutil.Process(p.pid)
        proc._popen = p  # keep the Popen so the child is reaped  # noqa: SLF001
        self.procs.append(proc)
        _ALL.append(proc)
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PGC_STORE_URL=self.store_url or "",
            PGC_WORK_DIR=str(self.dir / "work"),
            PGC_API_TOKEN=TOKEN,
            PGC_POLL_S="0.5",
            PGC_MIN_PROFILE_CALLS="1000000000",  # no automatic search unless a scenario wants one
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        env.update(extra)
        return env

    def start_agent(self, *, clients: int = 2, rate: float = 60.0, malformed: float = 0.0,
                    duration: float = 300.0, wait: bool = True, **env: str) -> Agent:
        status = self.dir / f"agent-{len(self.agents)}.jsonl"
        argv = [
            PY, str(ROOT / "bench" / "_faults" / "agent.py"), "--store", self.store_url or "",
            "--work-dir", str(self.dir / "work"), "--name", MODEL, "--model", self.model,
            "--clients", str(clients), "--rate", str(rate), "--malformed", str(malformed),
            "--duration", str(duration), "--status", str(status),
        ]
        proc = self._spawn(argv, self.dir / f"agent-{len(self.agents)}.log", self.env(**env))
        agent = Agent(proc, status, time.time())
        self.agents.append(agent)
        if wait:
            self.wait_agent(agent)
        return agent

    def wait_agent(self, agent: Agent, timeout: float = 90.0) -> float:
        """Seconds until the agent served a call and registered its model."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            last = agent.last()
            if last and last["total"] > 0 and last.get("registered"):
                return time.time() - t0
            if not agent.proc.is_running() or agent.proc.status() == psutil.STATUS_ZOMBIE:
                raise RuntimeError(f"agent exited early: {self.tail('agent')}")
            time.sleep(0.3)
        raise RuntimeError(f"agent not serving after {timeout}s: {self.tail('agent')}")

    def start_serve(self, *, token: str | None = TOKEN, wait: bool = True, **env: str) -> psutil.Process:
        self.port = self.port or free_port()
        argv = [PY, "-m", "pgc_daemon.cli", "serve", "--store", self.store_url or "", "--port", str(self.port)]
        e = self.env(**env)
        if token is None:
            e.pop("PGC_API_TOKEN", None)
        else:
            e["PGC_API_TOKEN"] = token
        self.serve_proc = self._spawn(argv, self.dir / "serve.log", e)
        if wait:
            t0 = time.time()
            while time.time() - t0 < 60:
                status, _ = http("GET", self.base + "/healthz", timeout=3)
                if status:
                    break
                if not self.serve_proc.is_running() or self.serve_proc.status() == psutil.STATUS_ZOMBIE:
                    raise RuntimeError(f"pgc serve exited: {self.tail('serve')}")
                time.sleep(0.3)
            else:
                raise RuntimeError(f"pgc serve not answering: {self.tail('serve')}")
        return self.serve_proc

    def wait_model(self, timeout: float = 60.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            status, body = self.api("GET", f"/api/models/{MODEL}")
            if status == 200 and isinstance(body, dict) and body.get("active"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"model {MODEL} never registered with an active deployment")

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return http(method, self.base + path, body, **kw)

    def deployments(self) -> list[dict[str, Any]]:
        status, body = self.api("GET", f"/api/models/{MODEL}/deployments")
        return body if status == 200 and isinstance(body, list) else []

    def deployment(self, dep_id: int) -> dict[str, Any] | None:
        return next((d for d in self.deployments() if d["id"] == dep_id), None)

    def put_policy(self, **fields: Any) -> None:
        status, body = self.api("PUT", f"/api/models/{MODEL}/policy", fields)
        if status != 200:
            raise RuntimeError(f"PUT policy -> {status}: {str(body)[:300]}")

    def deploy(self, recipe: dict[str, Any]) -> tuple[int, Any]:
        return self.api("POST", f"/api/models/{MODEL}/deployments", {"recipe": recipe})

    def wait_state(self, dep_id: int, states: set[str], timeout: float) -> dict[str, Any] | None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            d = self.deployment(dep_id)
            if d is not None and d["state"] in states:
                return d
            time.sleep(0.2)
        return None

    def wait_closed(self, dep_id: int, timeout: float) -> dict[str, Any] | None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            d = self.deployment(dep_id)
            if d is not None and d["state"] not in OPEN_STATES:
                return d
            time.sleep(0.2)
        return None

    def tail(self, what: str, n: int = 6) -> str:
        texts = []
        for f in sorted(self.dir.glob(f"{what}*.log")):
            try:
                lines = f.read_text(errors="replace").strip().splitlines()
            except OSError:
                continue
            texts.append(" | ".join(lines[-n:]))
        return " || ".join(texts)[-1200:]

    def kill9(self, proc: psutil.Process, *, tree: bool = False) -> list[int]:
        """SIGKILL one process (and, with ``tree``, its descendants); returns the pids killed."""
        family = [proc]
        if tree:
            try:
                family += proc.children(recursive=True)
            except psutil.Error:
                pass
        for p in family:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=5)
        for p in family:
            pop = getattr(p, "_popen", None)
            if pop is not None:
                try:
                    pop.wait(timeout=1)
                except Exception:  # noqa: BLE001
                    pass
        return [p.pid for p in family]

    def close(self) -> None:
        for proc in self.procs:
            if proc in _ALL:
                _ALL.remove(proc)
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        deadline = time.time() + 8
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except (psutil.Error, psutil.TimeoutExpired):
                pass
            _kill_tree(proc)
            pop = getattr(proc, "_popen", None)
            if pop is not None:
                try:
                    pop.wait(timeout=1)
                except Exception:  # noqa: BLE001
                    pass
        for m in self.mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        if os.environ.get("PGC_FAULTS_KEEP") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)


def window_stats(agents: list[Agent], t0: float, t1: float) -> dict[str, Any]:
    """Requests, pgc-caused failures, own errors, max and p99 latency between two wall times
    (per-second records of every agent)."""
    recs = [r for a in agents for r in a.records() if t0 <= r["t"] <= t1 + 1.0]
    return {
        "requests": sum(r["n"] for r in recs),
        "failed": sum(r["fail"] for r in recs),
        "own_errors": sum(r["own"] for r in recs),
        "max_ms": max((r["max_ms"] for r in recs if r["max_ms"] is not None), default=None),
        "p99_ms": max((r["p99_ms"] for r in recs if r["p99_ms"] is not None), default=None),
        "idle_seconds": sum(1 for r in recs if r["n"] == 0),
        "seconds": len(recs),
        "errors": sorted({e for r in recs for e in r.get("errors", [])})[:3],
    }


def totals(agents: list[Agent]) -> dict[str, int]:
    req = fail = own = 0
    for a in agents:
        last = a.last()
        if last:
            req += last["total"]
            fail += last["fail_total"]
            own += last["own_total"]
    return {"requests": req, "failed": fail, "own_errors": own}
