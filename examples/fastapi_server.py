"""A small FastAPI model server with pgc attached: the usual Python serving layout.

Each worker process attaches the model once at start-up and serves it through pgc; every
worker is one *replica* of the same model in pgc's store, so ``pgc serve`` runs one search
for all of them, and every worker loads the variant a search worker built (no worker
compiles anything)::

    export PGC_STORE_URL=sqlite:///$PWD/pgc.db        # or postgresql+psycopg://... for hosts
    uvicorn examples.fastapi_server:app --workers 2 --port 8000 &
    pgc serve --store "$PGC_STORE_URL" &
    curl -s localhost:8000/predict -H 'content-type: application/json' \\
         -d "{\\"rows\\": $(python -c 'print([[0.0]*64]*64)')}"

The model is ``pgc_daemon.examples.digits:mlp`` (a 64-1024-1024-10 MLP trained on
scikit-learn's bundled digits, deterministic, so every worker has the same weights). Swap in
your own: attach it with a ``spec`` (``package.module:function``) that rebuilds it, and keep
``name`` the same in every worker. Settings come from ``PGC_*`` variables (``PGC_STORE_URL``,
``PGC_WORK_DIR``, ``PGC_ARTIFACT_DIR`` for a fleet on several hosts).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import pgc_daemon

MODEL_NAME = os.environ.get("PGC_EXAMPLE_MODEL", "digits-mlp")
SPEC = "pgc_daemon.examples.digits:mlp"
ROWS = 64  # the MLP is served in batches of 64 rows of 8x8 pixels


class Batch(BaseModel):
    rows: list[list[float]] = Field(..., min_length=ROWS, max_length=ROWS)


class Prediction(BaseModel):
    labels: list[int]
    serving: str


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    from pgc_daemon.examples import digits

    app.state.served = pgc_daemon.attach(digits.mlp()["model"], name=MODEL_NAME, spec=SPEC)
    try:
        yield
    finally:
        app.state.served.close()


app = FastAPI(title="digits with pgc", lifespan=lifespan)


@app.post("/predict", response_model=Prediction)
def predict(batch: Batch) -> Prediction:
    """A plain (sync) endpoint: FastAPI runs it in its thread pool, as most servers do."""
    if any(len(r) != 64 for r in batch.rows):
        raise HTTPException(422, "every row holds 64 pixels")
    served = app.state.served
    x = torch.tensor(batch.rows, dtype=torch.float32)
    out = served(x)
    return Prediction(labels=out.argmax(-1).tolist(), serving=served.slot.label)


@app.get("/healthz")
def healthz() -> dict[str, object]:
    served = app.state.served
    return {"pid": os.getpid(), **{k: served.status()[k] for k in ("serving", "calls", "registered")}}
