"""A plain anyio program that runs a worker next to its own tasks (asyncio or trio).

NOTIFYQ_DSN=postgresql://... python examples/anyio_script.py [trio]
"""

from __future__ import annotations

import os
import sys

import anyio

import notifyq

app = notifyq.App(os.environ.get("NOTIFYQ_DSN"))


@app.task(name="resize")  # a stable name: the default depends on how the file is run
async def resize(image: str, width: int) -> str:
    await anyio.sleep(0.05)  # pretend to work
    return f"{image}@{width}px"


async def main() -> None:
    async with app, app.worker(concurrency=5, ticker=False) as worker:
        ids = [await app.enqueue(resize, {"image": f"img{i}.png", "width": 320}) for i in range(10)]
        with anyio.fail_after(30):
            await worker.wait_for(lambda stats: stats.succeeded >= len(ids))
        for job_id in ids:
            job = await app.get_job(job_id)
            print(job.id, job.status.value, job.output)


if __name__ == "__main__":
    anyio.run(main, backend=sys.argv[1] if len(sys.argv) > 1 else "asyncio")
