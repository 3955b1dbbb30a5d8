"""The dashboard ships inside the package: a wheel built from the source tree holds the page,
its script and the charting library, and ``pgc serve``'s app serves them from the wheel alone
(no CDN, no source tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "artifacts", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".pgc-cache", ".pgc", "*.db", "*.db-*", "tests",
)
SHIPPED = [
    "dashboards/static/index.html",
    "dashboards/static/app.js",
    "dashboards/static/style.css",
    "dashboards/static/vendor/echarts/echarts.min.js",
    "dashboards/static/vendor/echarts/LICENSE",
    "dashboards/grafana/pgc.json",
]


def test_the_wheel_ships_and_serves_the_dashboard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    wheel = next((tmp_path / "dist").glob("pgc-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(SHIPPED) <= names, sorted(set(SHIPPED) - names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    check = textwrap.dedent(
        """
        import dashboards, sys
        from pathlib import Path
        assert Path(dashboards.__file__).parent == Path(sys.argv[1]) / "dashboards", dashboards.__file__
        from fastapi.testclient import TestClient
        from pgc_daemon.api import create_app
        from pgc_daemon.settings import Settings
        c = TestClient(create_app(Settings(store_url="sqlite:///" + sys.argv[2])), base_url="http://127.0.0.1")
        r = c.get("/", follow_redirects=False)
        assert r.status_code in (302, 307) and r.headers["location"] == "/ui/", r.headers
        page = c.get("/ui/")
        assert page.status_code == 200 and "vendor/echarts/echarts.min.js" in page.text
        js = c.get("/ui/vendor/echarts/echarts.min.js")
        assert js.status_code == 200 and len(js.content) > 500_000
        assert c.get("/ui/app.js").status_code == 200
        print("served from the wheel")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", check, str(site), str(tmp_path / "pgc.db")],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0 and "served from the wheel" in run.stdout, run.stdout + run.stderr
