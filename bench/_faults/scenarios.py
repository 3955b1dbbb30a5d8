"""The fault scenarios. Each takes the campaign's options and returns one result dict:
``{name, requests, failed, recovered, recovery_s, passed, notes, ...}`` (``skipped: True``
when it could not run here). A scenario passes only when every one of its checks holds."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench._faults.harness import (
    IN_FLIGHT,
    MODEL,
    ROOT,
    STALL_MS,
    Ctx,
    log,
    totals,
    window_stats,
)

BF16 = {"version": 1, "quantization": {"_default": {"precision": "bf16"}}, "backend": {"kind": "eager", "mode": "default"}}
LAST_LAYER = {"mlp": "net.5", "cnn": "head.3", "minilm": "re:.*pooler.*"}
INDUCTOR = {"version": 1, "quantization": {}, "backend": {"kind": "inductor", "mode": "default"}}


def bf16_but_last(model: str) -> dict[str, Any]:
    return {
        "version": 1,
        "quantization": {"_default": {"precision": "bf16"}, LAST_LAYER[model]: {"precision": "fp32"}},
        "backend": {"kind": "eager", "mode": "default"},
    }


#: the canary must judge what a scenario looks at, not latency noise of a 2-core machine
CALM = {"canary_latency_tolerance": 10.0, "max_accuracy_drop": 0.05, "auto_deploy": False}


def result(name: str, **kw: Any) -> dict[str, Any]:
    out = {"name": name, "requests": 0, "failed": 0, "recovered": False, "recovery_s": None,
           "passed": False, "notes": ""}
    out.update(kw)
    return out


def skipped(name: str, why: str) -> dict[str, Any]:
    return result(name, skipped=True, notes=why)


def _restart_after_kill(name: str, opts: Any, target_state: set[str], recipe: dict[str, Any],
                        policy: dict[str, Any]) -> dict[str, Any]:
    ctx = Ctx(name, model=opts.model)
    notes: list[str] = []
    try:
        ctx.start_serve()
        a1 = ctx.start_agent()
        ctx.wait_model()
        ctx.put_policy(**policy)
        status, body = ctx.deploy(recipe)
        if status != 202:
            return result(name, notes=f"POST deployment -> {status}: {str(body)[:200]}")
        dep_id = body["id"]
        d = ctx.wait_state(dep_id, target_state, timeout=90)
        if d is None:
            d = ctx.deployment(dep_id)
            return result(name, notes=f"deployment never reached {sorted(target_state)} (is "
                          f"{d and d['state']}: {d and d['reason']})", **totals(ctx.agents))
        time.sleep(1.0)  # well inside the phase
        state_at_kill = (ctx.deployment(dep_id) or {}).get("state")
        ctx.kill9(a1.proc)
        killed_at = time.time()
        notes.append(f"agent killed -9 while deployment {dep_id} was {state_at_kill}")
        a2 = ctx.start_agent(wait=False)
        serve_s = ctx.wait_agent(a2, timeout=90)
        ended = ctx.wait_closed(dep_id, timeout=30)
        recovery_s = time.time() - killed_at
        time.sleep(3.0)
        deps = ctx.deployments()
        stuck = [d for d in deps if d["state"] in IN_FLIGHT and d["id"] <= dep_id]
        after = window_stats([a2], a2.started, time.time())
        final = ctx.deployment(dep_id)
        notes.append(f"restarted agent served after {serve_s:.1f}s; deployment {dep_id} is "
                     f"{final and final['state']} ({final and final['reason']})")
        t = totals(ctx.agents)
        ok = ended is not None and not stuck and after["requests"] > 0 and t["failed"] == 0
        return result(name, requests=t["requests"], failed=t["failed"], recovered=ended is not None,
                      recovery_s=round(recovery_s, 2) if ended else None, passed=ok,
                      stuck_deployments=len(stuck), notes="; ".join(notes))
    finally:
        ctx.close()


def agent_kill_build(opts: Any) -> dict[str, Any]:
    """1. kill -9 the agent while it builds (an Inductor variant: a build of many seconds)."""
    return _restart_after_kill("agent_kill_build", opts, {"building"}, INDUCTOR, {**CALM})


def agent_kill_canary(opts: Any) -> dict[str, Any]:
    """2. kill -9 the agent while a bf16 variant canaries (canary_s 60)."""
    return _restart_after_kill("agent_kill_canary", opts, {"canary"}, BF16, {**CALM, "canary_s": 60})


def _optuna_finished(storage: str, study: str) -> set[int]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        s = optuna.load_study(study_name=study, storage=storage)
    except Exception:  # noqa: BLE001
        return set()
    return {t.number for t in s.get_trials(deepcopy=False) if t.state.is_finished()}


def daemon_kill_search(opts: Any) -> dict[str, Any]:
    """3. kill -9 ``pgc serve`` (and its search worker: the host went away) after the search
    finished a trial, restart it: the finished trials must still be in the store and the Optuna
    study, and the study must resume."""
    name = "daemon_kill_search"
    ctx = Ctx(name, model=opts.model)
    notes: list[str] = []
    env = {"PGC_MIN_PROFILE_CALLS": "50"}
    try:
        ctx.start_agent()
        first = ctx.start_serve()  # no automatic search yet: the policy comes first
        ctx.wait_model()
        ctx.put_policy(**CALM, max_trials=6, time_budget_s=400)
        ctx.kill9(first)
        serve = ctx.start_serve(**env)
        t0 = time.time()
        run = None
        while time.time() - t0 < opts.search_wait_s:
            status, runs = ctx.api("GET", f"/api/models/{MODEL}/searches")
            if status == 200 and runs and runs[0]["trials_done"] >= 1 and runs[0]["state"] == "running":
                run = runs[0]
                break
            if status == 200 and runs and runs[0]["state"] not in ("queued", "running"):
                return result(name, notes=f"search ended before the kill: {runs[0]['state']} "
                              f"{runs[0]['message']}", **totals(ctx.agents))
            time.sleep(1.0)
        if run is None:
            return result(name, notes=f"inconclusive: no search trial finished within {opts.search_wait_s:.0f}s "
                          f"(nothing to lose yet); search log: {ctx.tail('work/search')}",
                          **totals(ctx.agents))
        storage = f"sqlite:///{ctx.dir / 'store' / 'pgc.optuna.db'}"
        _, trials = ctx.api("GET", f"/api/models/{MODEL}/trials")
        before_store = {t.get("number", t.get("id")) for t in trials} if isinstance(trials, list) else set()
        before_optuna = _optuna_finished(storage, run["study_name"])
        killed = ctx.kill9(serve, tree=True)
        killed_at = time.time()
        notes.append(f"killed -9 pgc serve and its worker ({len(killed)} processes) after "
                     f"{run['trials_done']} trials; {len(before_optuna)} finished in Optuna")
        ctx.start_serve(**env)
        resumed = None
        while time.time() - killed_at < 120:
            status, runs = ctx.api("GET", f"/api/models/{MODEL}/searches")
            if status == 200 and runs and runs[0]["run_id"] != run["run_id"]:
                resumed = runs[0]
                if resumed["trials_done"] > 0 or resumed["state"] not in ("queued", "running"):
                    break
            time.sleep(1.0)
        recovery_s = time.time() - killed_at
        _, trials = ctx.api("GET", f"/api/models/{MODEL}/trials")
        after_store = {t.get("number", t.get("id")) for t in trials} if isinstance(trials, list) else set()
        after_optuna = _optuna_finished(storage, run["study_name"])
        lost = len(before_optuna - after_optuna) + len(before_store - after_store)
        if resumed is None:
            notes.append("no search resumed within 120s")
        else:
            notes.append(f"run {resumed['run_id']} ({resumed['trigger']}) is {resumed['state']} with "
                         f"{resumed['trials_done']} trials; study {'same' if resumed['study_name'] == run['study_name'] else 'DIFFERENT'}")
        notes.append(f"trials lost: {lost} (store {len(before_store)}->{len(after_store)}, "
                     f"optuna {len(before_optuna)}->{len(after_optuna)})")
        t = totals(ctx.agents)
        ok = (resumed is not None and resumed["study_name"] == run["study_name"] and lost == 0
              and t["failed"] == 0)
        return result(name, requests=t["requests"], failed=t["failed"], recovered=resumed is not None,
                      recovery_s=round(recovery_s, 2) if resumed else None, passed=ok,
                      lost_trials=lost, notes="; ".join(notes))
    finally:
        ctx.close()


def _exports_after(ctx: Ctx, since: float, timeout: float) -> float | None:
    """Seconds until the store holds a request window that started after ``since``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            con = sqlite3.connect(f"file:{ctx.db_path}?mode=ro", uri=True, timeout=2)
            try:
                row = con.execute("SELECT max(window_start) FROM pgc_request_stats").fetchone()
            finally:
                con.close()
            if row and row[0] and row[0] > since:
                return time.time() - t0
        except sqlite3.Error:
            pass
        time.sleep(0.5)
    return None


def _store_rows(ctx: Ctx, t0: float, t1: float) -> int | None:
    try:
        con = sqlite3.connect(f"file:{ctx.db_path}?mode=ro", uri=True, timeout=2)
        try:
            return con.execute("SELECT count(*) FROM pgc_request_stats WHERE window_start >= ? AND "
                               "window_end <= ?", (t0, t1)).fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return None


def store_deleted(opts: Any) -> dict[str, Any]:
    """4. the SQLite file (and its -wal/-shm) deleted while serving."""
    name = "store_deleted"
    ctx = Ctx(name, model=opts.model)
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        time.sleep(2)
        t0 = time.time()
        for suffix in ("", "-wal", "-shm", "-journal"):
            p = Path(str(ctx.db_path) + suffix)
            if p.exists():
                p.unlink()
        time.sleep(10)
        status, body = ctx.api("GET", "/healthz")
        w = window_stats(ctx.agents, t0, time.time())
        unhealthy = status != 200 or not isinstance(body, dict) or body.get("status") != "ok"
        serving = w["requests"] > 0 and w["idle_seconds"] == 0
        notes = (f"/healthz -> {status} {str(body)[:160]}; {w['requests']} calls in the 10s after "
                 f"the delete, max {w['max_ms']} ms")
        t = totals(ctx.agents)
        ok = serving and t["failed"] == 0 and unhealthy
        return result(name, requests=t["requests"], failed=t["failed"], recovered=serving,
                      passed=ok, healthz_status=status, notes=notes)
    finally:
        ctx.close()


def store_readonly(opts: Any) -> dict[str, Any]:
    """5. the store file and its directory read-only for 10 s, then writable again."""
    name = "store_readonly"
    ctx = Ctx(name, model=opts.model)
    notes = []
    if os.geteuid() == 0:  # root writes through 0444: run pgc without the capabilities that allow it
        if shutil.which("setpriv") is None:
            ctx.close()
            return skipped(name, "running as root and setpriv is missing: chmod cannot stop root")
        ctx.preexec = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
        notes.append("agent and pgc serve run without CAP_DAC_OVERRIDE (harness is root)")
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        time.sleep(3)
        files = [p for p in ctx.db_path.parent.iterdir()]
        modes = {p: p.stat().st_mode & 0o777 for p in files}
        dmode = ctx.db_path.parent.stat().st_mode & 0o777
        t0 = time.time()
        try:
            for p in files:
                os.chmod(p, 0o444)
            os.chmod(ctx.db_path.parent, 0o555)
            time.sleep(10)
        finally:
            os.chmod(ctx.db_path.parent, dmode)
            for p, m in modes.items():
                if p.exists():
                    os.chmod(p, m)
        t1 = time.time()
        during = _store_rows(ctx, t0 + 1, t1 - 1)
        resumed = _exports_after(ctx, t1 + 0.5, timeout=30)
        w = window_stats(ctx.agents, t0, t1)
        t = totals(ctx.agents)
        serving = w["requests"] > 0 and w["idle_seconds"] == 0
        notes.append(f"{w['requests']} calls while read-only, max {w['max_ms']} ms; windows written "
                     f"while read-only: {during} (through descriptors opened before)")
        notes.append("exports resumed" if resumed is not None else "exports did NOT resume within 30s")
        ok = serving and t["failed"] == 0 and resumed is not None
        return result(name, requests=t["requests"], failed=t["failed"], recovered=resumed is not None,
                      recovery_s=round(resumed, 2) if resumed is not None else None, passed=ok,
                      max_latency_ms=w["max_ms"], notes="; ".join(notes))
    finally:
        ctx.close()


LOCKER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("COMMIT")
"""


def store_locked(opts: Any) -> dict[str, Any]:
    """6. another process holds BEGIN EXCLUSIVE on the SQLite file for 10 s."""
    name = "store_locked"
    ctx = Ctx(name, model=opts.model)
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        time.sleep(2)
        locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(ctx.db_path), "10"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            line = locker.stdout.readline() if locker.stdout else ""
            t0 = time.time()
            health_during = ctx.api("GET", "/healthz", timeout=20)[0]
            locker.wait(timeout=30)
        finally:
            if locker.poll() is None:
                locker.kill()
                locker.wait()
        t1 = time.time()
        resumed = _exports_after(ctx, t1 + 0.5, timeout=30)
        w = window_stats(ctx.agents, t0, t1)
        t = totals(ctx.agents)
        serving = w["requests"] > 0 and w["idle_seconds"] == 0
        stalled = w["max_ms"] is not None and w["max_ms"] > STALL_MS
        notes = (f"lock {'taken' if 'locked' in line else 'NOT taken'}; {w['requests']} calls while "
                 f"locked, max {w['max_ms']} ms, p99 {w['p99_ms']} ms; /healthz while locked -> "
                 f"{health_during}; exports {'resumed' if resumed is not None else 'did NOT resume within 30s'}")
        ok = "locked" in line and serving and not stalled and t["failed"] == 0 and resumed is not None
        return result(name, requests=t["requests"], failed=t["failed"], recovered=resumed is not None,
                      recovery_s=round(resumed, 2) if resumed is not None else None, passed=ok,
                      max_latency_ms=w["max_ms"], notes=notes)
    finally:
        ctx.close()


def postgres_restart(opts: Any) -> dict[str, Any]:
    """7. PostgreSQL stopped for 20 s, then started again."""
    name = "postgres_restart"
    url = opts.postgres_url or os.environ.get("PGC_TEST_POSTGRES_URL")
    pgdir = opts.postgres_dir or os.environ.get("PGC_TEST_POSTGRES_DIR")
    if not url:
        return skipped(name, "no PostgreSQL URL (--postgres-url or PGC_TEST_POSTGRES_URL)")
    if not pgdir or not (Path(pgdir) / "data").is_dir():
        return skipped(name, "a PostgreSQL URL but no --postgres-dir (the .ci/postgres.sh DIR) to stop and start it")
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    pg_ctl = str(bins[-1] / "pg_ctl") if bins else (shutil.which("pg_ctl") or "pg_ctl")
    from sqlalchemy.engine import make_url

    port = make_url(url).port or 5432

    def as_pg(cmd: str) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            return subprocess.run(["su", "postgres", "-s", "/bin/bash", "-c", cmd], capture_output=True, text=True, timeout=60)
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)

    ctx = Ctx(name, model=opts.model, store_url=url)
    stopped = False
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        time.sleep(2)
        r = as_pg(f"{pg_ctl} -D '{pgdir}/data' -m fast -w stop")
        if r.returncode != 0:
            return result(name, notes=f"pg_ctl stop failed: {r.stderr[-200:]}")
        stopped = True
        t0 = time.time()
        time.sleep(20)
        health_down = ctx.api("GET", "/healthz", timeout=10)[0]
        r = as_pg(f"{pg_ctl} -D '{pgdir}/data' -l '{pgdir}/server.log' -w -o \"-p {port} -k '{pgdir}' "
                  f"-c listen_addresses=127.0.0.1 -c max_connections=200\" start")
        stopped = r.returncode != 0
        t1 = time.time()
        w = window_stats(ctx.agents, t0, t1)
        recovered = None
        while time.time() - t1 < 40:
            status, body = ctx.api("GET", "/healthz", timeout=5)
            if status == 200:
                recovered = time.time() - t1
                break
            time.sleep(0.5)
        t = totals(ctx.agents)
        serving = w["requests"] > 0 and w["idle_seconds"] == 0
        ok = serving and t["failed"] == 0 and recovered is not None and health_down != 200
        return result(name, requests=t["requests"], failed=t["failed"], recovered=recovered is not None,
                      recovery_s=round(recovered, 2) if recovered is not None else None, passed=ok,
                      max_latency_ms=w["max_ms"],
                      notes=f"/healthz while down -> {health_down}; {w['requests']} calls while down, "
                            f"max {w['max_ms']} ms")
    finally:
        if stopped:
            as_pg(f"{pg_ctl} -D '{pgdir}/data' -l '{pgdir}/server.log' -w -o \"-p {port} -k '{pgdir}' "
                  f"-c listen_addresses=127.0.0.1 -c max_connections=200\" start")
        ctx.close()


def disk_full(opts: Any) -> dict[str, Any]:
    """8. store and work dir on an 8 MB tmpfs, filled to the last byte for 10 s, then freed."""
    name = "disk_full"
    ctx = Ctx(name, model=opts.model)
    store_dir = ctx.dir / "store"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(store_dir)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        ctx.close()
        return skipped(name, f"cannot mount a tmpfs here: {r.stderr.strip()[:160]}")
    ctx.mounts.append(store_dir)
    work = store_dir / "work"
    work.mkdir(mode=0o700)
    try:
        ctx.start_serve(PGC_WORK_DIR=str(work))
        ctx.start_agent(PGC_WORK_DIR=str(work))
        ctx.wait_model()
        time.sleep(2)
        filler = store_dir / "filler"
        t0 = time.time()
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        usage = shutil.disk_usage(store_dir)
        time.sleep(10)
        health_full = ctx.api("GET", "/healthz", timeout=10)[0]
        filler.unlink()
        t1 = time.time()
        resumed = _exports_after(ctx, t1 + 0.5, timeout=30)
        w = window_stats(ctx.agents, t0, t1)
        t = totals(ctx.agents)
        serving = w["requests"] > 0 and w["idle_seconds"] == 0
        ok = serving and t["failed"] == 0 and resumed is not None
        return result(name, requests=t["requests"], failed=t["failed"], recovered=resumed is not None,
                      recovery_s=round(resumed, 2) if resumed is not None else None, passed=ok,
                      max_latency_ms=w["max_ms"],
                      notes=f"free bytes when full: {usage.free}; /healthz while full -> {health_full}; "
                            f"{w['requests']} calls while full, max {w['max_ms']} ms; exports "
                            f"{'resumed' if resumed is not None else 'did NOT resume within 30s'}")
    finally:
        ctx.close()


def malformed_canary(opts: Any) -> dict[str, Any]:
    """9. 1% wrong-shape requests while a healthy bf16 variant canaries (latency tolerance
    lifted so only failures can decide): the callers get their own errors, no rollback."""
    name = "malformed_canary"
    ctx = Ctx(name, model=opts.model)
    try:
        ctx.start_serve()
        ctx.start_agent(malformed=0.01, rate=100)
        ctx.wait_model()
        ctx.put_policy(**CALM, canary_s=10)
        status, body = ctx.deploy(BF16)
        if status != 202:
            return result(name, notes=f"POST deployment -> {status}: {str(body)[:200]}")
        t0 = time.time()
        d = ctx.wait_closed(body["id"], timeout=90)
        w = window_stats(ctx.agents, t0, time.time())
        t = totals(ctx.agents)
        state = d and d["state"]
        notes = (f"deployment ended {state}: {d and d['reason']}; {w['own_errors']} malformed calls got "
                 f"their own error during the deployment")
        ok = state == "active" and t["failed"] == 0 and w["own_errors"] > 0
        return result(name, requests=t["requests"], failed=t["failed"], recovered=state == "active",
                      passed=ok, own_errors=t["own_errors"], notes=notes)
    finally:
        ctx.close()


def deploy_churn(opts: Any) -> dict[str, Any]:
    """10. 50 deployments (bf16 / bf16-but-the-last-layer alternating, canary_s 0.5) under 4
    clients: RSS of the agent after the 5th vs after the 50th."""
    name = "deploy_churn"
    n_total = opts.churn
    ctx = Ctx(name, model=opts.model)
    try:
        ctx.start_serve()
        agent = ctx.start_agent(clients=4, rate=100)
        ctx.wait_model()
        ctx.put_policy(**CALM, canary_s=0.5)
        recipes = [BF16, bf16_but_last(opts.model)]
        rss: dict[int, int] = {}
        ends: dict[str, int] = {}
        done = 0
        t0 = time.time()
        for i in range(n_total):
            if time.time() - t0 > opts.churn_budget_s:
                break
            status, body = ctx.deploy(recipes[i % 2])
            if status != 202:
                ends[f"post {status}"] = ends.get(f"post {status}", 0) + 1
                time.sleep(0.5)
                continue
            d = ctx.wait_closed(body["id"], timeout=60)
            state = d["state"] if d else "stuck"
            ends[state] = ends.get(state, 0) + 1
            done += 1
            time.sleep(1.2)  # one status record after the end
            last = agent.last()
            if last:
                rss[done] = last["rss"]
            if done in (1, 5, 10, 25) or done % 10 == 0:
                log(f"  {name}: {done} deployments, rss {rss.get(done, 0) / 2**20:.1f} MiB, {ends}")
        t = totals(ctx.agents)
        ratio = rss[n_total] / rss[5] if 5 in rss and n_total in rss else None
        notes = (f"{done} deployments in {time.time() - t0:.0f}s, outcomes {ends}; rss after #5 "
                 f"{rss.get(5, 0) / 2**20:.1f} MiB, after #{done} {rss.get(done, 0) / 2**20:.1f} MiB")
        if ratio is None and 5 in rss and done in rss:
            notes += f" (partial ratio {rss[done] / rss[5]:.3f}; fewer than {n_total} done)"
        ok = ratio is not None and ratio <= 1.05 and t["failed"] == 0 and "stuck" not in ends
        return result(name, requests=t["requests"], failed=t["failed"], recovered=True, passed=ok,
                      rss_growth_ratio=round(ratio, 4) if ratio else None,
                      stuck_deployments=ends.get("stuck", 0), notes=notes)
    finally:
        ctx.close()


#: How long serving is watched after the pathological keys are posted.
OBSERVE_AFTER_KEYS_S = 5.0


def regex_key(opts: Any) -> dict[str, Any]:
    """11. pathological ``re:`` layer keys: the API refuses them, or the agent matches them in
    bounded time; serving must not stall meanwhile."""
    name = "regex_key"
    ctx = Ctx(name, model=opts.model)
    keys = {
        "nested": "re:(.*)*(.*)*(.*)*(.*)*(.*)*x",
        # only tokens the API's key pattern allows (.*, names): polynomial backtracking
        "flat": "re:" + ".*" * 148 + "x",
    }
    notes: list[str] = []
    ok = True
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        ctx.put_policy(**CALM, canary_s=1)
        t0 = time.time()
        for label, key in keys.items():
            recipe = {"version": 1, "quantization": {key: {"precision": "bf16"}}, "backend": {"kind": "eager", "mode": "default"}}
            t_post = time.time()
            status, body = ctx.deploy(recipe)
            post_s = time.time() - t_post
            if 400 <= status < 500:
                notes.append(f"{label} key refused: {status} in {post_s:.2f}s")
                continue
            if status != 202:
                ok = False
                notes.append(f"{label} key: POST -> {status} after {post_s:.1f}s: {str(body)[:120]}")
                continue
            d = ctx.wait_closed(body["id"], timeout=30)
            if d is None:
                ok = False
                cur = ctx.deployment(body["id"])
                notes.append(f"{label} key accepted (202) and the agent had not finished matching it "
                             f"after 30s (deployment {cur and cur['state']})")
                break  # the agent is stuck in the regex: nothing else can be judged
            notes.append(f"{label} key accepted and ended {d['state']} in {time.time() - t_post:.1f}s")
        # judge serving over a span that holds calls, even when every key was refused at once
        time.sleep(max(0.0, t0 + OBSERVE_AFTER_KEYS_S - time.time()))
        w = window_stats(ctx.agents, t0, time.time())
        stalled = w["max_ms"] is None or w["max_ms"] > STALL_MS or w["idle_seconds"] > 0
        notes.append(f"max request latency {w['max_ms']} ms, p99 {w['p99_ms']} ms, "
                     f"{w['idle_seconds']} seconds without a served call")
        t = totals(ctx.agents)
        ok = ok and not stalled and t["failed"] == 0
        return result(name, requests=t["requests"], failed=t["failed"], recovered=not stalled, passed=ok,
                      max_latency_ms=w["max_ms"], notes="; ".join(notes))
    finally:
        ctx.close()


def concurrent_deploys(opts: Any) -> dict[str, Any]:
    """12. 16 concurrent POST /deployments: exactly one created, the others 409."""
    name = "concurrent_deploys"
    ctx = Ctx(name, model=opts.model)
    try:
        ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        ctx.put_policy(**CALM, canary_s=1)
        before = {d["id"] for d in ctx.deployments()}
        barrier = threading.Barrier(16)
        codes: list[int] = []
        lock = threading.Lock()

        def post() -> None:
            try:
                barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass
            status, _ = ctx.deploy(BF16)
            with lock:
                codes.append(status)

        threads = [threading.Thread(target=post) for _ in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        created = [d for d in ctx.deployments() if d["id"] not in before and d["source"] == "manual"]
        hist = {c: codes.count(c) for c in sorted(set(codes))}
        t = totals(ctx.agents)
        ok = hist.get(202) == 1 and hist.get(409) == 15 and len(created) == 1 and t["failed"] == 0
        return result(name, requests=t["requests"], failed=t["failed"], recovered=True, passed=ok,
                      notes=f"status codes {hist}; deployments created: {len(created)}")
    finally:
        ctx.close()


def hostile_api(opts: Any) -> dict[str, Any]:
    """13. hostile calls: none may change what serves. A server with a token refuses a wrong
    Host, a form body and a 10 MB body; a server started with default settings refuses a
    mutation without a token."""
    name = "hostile_api"
    ctx = Ctx(name, model=opts.model)
    checks: list[tuple[str, bool, str]] = []
    try:
        serve = ctx.start_serve()
        ctx.start_agent()
        ctx.wait_model()
        ctx.put_policy(**CALM, canary_s=1)

        def serving() -> tuple[Any, int]:
            _, m = ctx.api("GET", f"/api/models/{MODEL}")
            active = (m.get("active") or {}).get("deployment_id") if isinstance(m, dict) else None
            return active, len(ctx.deployments())

        path = f"/api/models/{MODEL}/deployments"
        base = serving()
        status, _ = ctx.api("POST", path, {"recipe": BF16}, headers={"Host": "evil.example"})
        checks.append(("wrong Host", 400 <= status < 500, f"{status}"))
        status, _ = ctx.api("POST", path, raw=b"recipe=x&variant_id=1",
                            headers={"content-type": "application/x-www-form-urlencoded"})
        checks.append(("form body", 400 <= status < 500, f"{status}"))
        big = b'{"recipe": {"version": 1, "quantization": {}}, "reason": "' + b"a" * (10 * 2**20) + b'"}'
        status, _ = ctx.api("POST", path, raw=big, headers={"content-type": "application/json"}, timeout=60)
        checks.append(("10 MB body", status == 413, f"{status}"))
        time.sleep(1.5)
        unchanged = serving() == base
        checks.append(("serving unchanged (token server)", unchanged, f"{base} -> {serving()}"))
        # a server with default settings: no token configured anywhere
        ctx.kill9(serve, tree=True)
        ctx.port = None
        ctx.start_serve(token=None)
        base = serving()
        status, body = ctx.api("POST", path, {"recipe": BF16}, token=None)
        checks.append(("mutation without token (default settings)", status == 401, f"{status}"))
        time.sleep(1.5)
        after = serving()
        checks.append(("serving unchanged (default server)", after == base, f"{base} -> {after}"))
        t = totals(ctx.agents)
        ok = all(c[1] for c in checks) and t["failed"] == 0
        notes = "; ".join(f"{n}: {'ok' if good else 'FAIL'} ({why})" for n, good, why in checks)
        return result(name, requests=t["requests"], failed=t["failed"], recovered=True, passed=ok, notes=notes)
    finally:
        ctx.close()


def tick_72h(opts: Any) -> dict[str, Any]:
    """CPU of one optimizer tick on a store with 72 h of 10 s windows for one model."""
    name = "tick_72h"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "_faults" / "tick72.py")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return result(name, notes=f"tick72 failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    import json

    data = json.loads(lines[-1])
    ms = data["tick_cpu_ms"]
    return result(name, recovered=True, passed=ms <= 20.0, tick_cpu_ms_at_72h=ms,
                  notes=f"steady tick {ms:.1f} ms CPU (median of {data['ticks']}), first tick "
                        f"{data['first_tick_cpu_ms']:.1f} ms (prunes), {data['windows']} request windows, "
                        f"{data['layer_rows']} layer rows; daemon {data['daemon']}")


SCENARIOS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "agent_kill_build": agent_kill_build,
    "agent_kill_canary": agent_kill_canary,
    "daemon_kill_search": daemon_kill_search,
    "store_deleted": store_deleted,
    "store_readonly": store_readonly,
    "store_locked": store_locked,
    "postgres_restart": postgres_restart,
    "disk_full": disk_full,
    "malformed_canary": malformed_canary,
    "deploy_churn": deploy_churn,
    "regex_key": regex_key,
    "concurrent_deploys": concurrent_deploys,
    "hostile_api": hostile_api,
    "tick_72h": tick_72h,
}
