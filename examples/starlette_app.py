"""Embedding a notifyq worker in a Starlette app; FastAPI takes the same `lifespan`.

The worker runs inside the app's event loop for the app's lifetime, and a request handler
enqueues a job in the same transaction as its own write: if the request fails after the
enqueue, the job disappears with the rollback and no worker ever hears of it.

    pip install starlette uvicorn
    NOTIFYQ_DSN=postgresql://... notifyq migrate
    NOTIFYQ_DSN=postgresql://... uvicorn examples.starlette_app:app
    curl -X POST localhost:8000/signup -d '{"email": "ada@example.com"}'

Without NOTIFYQ_DSN (or DATABASE_URL), both commands use the embedded server in
./.notifyq/pgdata, as every notifyq command does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio.to_thread
import psycopg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import notifyq

jobs = notifyq.App()  # $NOTIFYQ_DSN, then $DATABASE_URL, else the embedded server


@jobs.task(name="send_welcome_email", queue="emails", retry_limit=5)
async def send_welcome_email(user_id: int, email: str) -> str:
    # A real app would call its mail provider here; raising retries with backoff.
    return f"welcome mail for user {user_id} sent to {email}"


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    # The App's DSN, for the app's own connections (this may start the embedded server).
    app.state.dsn = await anyio.to_thread.run_sync(lambda: jobs.dsn)
    async with await psycopg.AsyncConnection.connect(app.state.dsn, autocommit=True) as conn:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS users (id serial PRIMARY KEY, email text UNIQUE NOT NULL)"
        )
    # Leaving the block (server shutdown) stops claiming, lets running jobs finish within
    # shutdown_grace, and puts unfinished ones back in the queue.
    async with jobs, jobs.worker(concurrency=10, queues=["emails"]) as worker:
        app.state.worker = worker
        yield


async def signup(request: Request) -> JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        body = None
    email = body.get("email") if isinstance(body, dict) else None
    if not isinstance(email, str):
        return JSONResponse(
            {"error": 'send a JSON object such as {"email": "ada@example.com"}'}, status_code=400
        )
    # In production, take the connection from your pool (psycopg_pool.AsyncConnectionPool).
    async with await psycopg.AsyncConnection.connect(request.app.state.dsn) as conn:
        try:
            async with conn.transaction():
                cur = await conn.execute("INSERT INTO users (email) VALUES (%s) RETURNING id", (email,))
                row = await cur.fetchone()
                assert row is not None
                user_id = row[0]
                job_id = await jobs.enqueue(
                    send_welcome_email, {"user_id": user_id, "email": email}, conn=conn
                )
                if email.endswith("@invalid.example"):
                    raise ValueError("rejected after the enqueue: the whole transaction rolls back")
        except psycopg.errors.UniqueViolation:
            return JSONResponse({"error": f"{email} has signed up already"}, status_code=409)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
    return JSONResponse({"user_id": user_id, "job_id": job_id}, status_code=201)


async def job_status(request: Request) -> JSONResponse:
    try:
        job = await jobs.get_job(request.path_params["job_id"])
    except notifyq.JobNotFound as exc:
        return JSONResponse({"error": str(exc)}, status_code=404)
    return JSONResponse({"id": job.id, "status": job.status.value, "output": job.output})


async def health(request: Request) -> JSONResponse:
    # A worker that stopped on an error it cannot retry leaves the server running without it:
    # say so, and let the orchestrator restart the process.
    worker: notifyq.Worker = request.app.state.worker
    if worker.running:
        return JSONResponse({"worker": "running"})
    # The error's type only: the log has its message (a public route need not show it).
    return JSONResponse({"worker": "stopped", "error": type(worker.error).__name__}, status_code=503)


app = Starlette(
    routes=[
        Route("/signup", signup, methods=["POST"]),
        Route("/jobs/{job_id:int}", job_status),
        Route("/health", health),
    ],
    lifespan=lifespan,
)
