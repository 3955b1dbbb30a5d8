"""Search worker process: ``python -m pgc_daemon.optimizer.search.worker --run-id N``.

Runs one search run outside the API and serving processes (its own GIL and threads), reads
settings from ``PGC_*`` like every pgc process, and leaves its outcome in the store.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback

import store as st
from pgc_daemon.errors import describe
from pgc_daemon.optimizer.search.runner import run_live_search
from pgc_daemon.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pgc-search-worker")
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--store", default=None, help="store URL (default: PGC_STORE_URL)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    if args.store:
        settings = settings.model_copy(update={"store_url": args.store})
    try:
        result = run_live_search(settings, args.run_id)
        print(result.message, flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - record why, then exit non-zero
        traceback.print_exc()
        try:
            store = st.open_store(settings.store_url)
            with store.session() as s:
                st.repo.update_search_run(
                    s, args.run_id, state="failed", message=describe(exc), finished_at=time.time()
                )
                run = st.repo.get_search_run(s, args.run_id)
                st.repo.add_event(s, run.model_id, "search_failed", describe(exc), level="error")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
