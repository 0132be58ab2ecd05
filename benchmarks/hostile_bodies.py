"""How long one hostile request keeps a server worker from answering anyone else.

    python benchmarks/hostile_bodies.py [--rounds 3]

Starts a throwaway embedded PostgreSQL and `fastpubsub server` with ONE worker
and auth on (so every request below lands on the same event loop), then sends
each hostile request while another connection asks `/liveness` every 10 ms.
For each case it prints the hostile request's status and time, and the worst
`/liveness` latency seen meanwhile: that is how long the worker's event loop
was blocked. Figures are the medians of `--rounds` rounds.

Cases (each about 10 MB, the default request limit):

* `form bomb`: a form with a million fields to `POST /oauth/token`;
* `json without token`: a 10 MB envelope publish with no Authorization header;
* `seed publish, big ints`: a 10 MB `POST /topics/t/messages` whose messages
  hold integers beyond 64 bits (parsed by the json module to check sizes);
* `envelope publish`: a 10 MB `POST /topics/t/publish`, with a token;
* `deep publish`: `[` nested 100,000 deep to `POST /topics/t/messages`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx

from fastpubsub import migrate
from fastpubsub.auth import generate_signing_key
from fastpubsub.embedded import EmbeddedPostgres, free_port

TEN_MB = 10 * 1024 * 1024 - 4096


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    data_dir = Path(tempfile.mkdtemp(prefix="fastpubsub-hostile-"))
    embedded = EmbeddedPostgres(data_dir)
    try:
        url = embedded.start().url(driver="")
        migrate.upgrade(url)
        yield url
    finally:
        embedded.destroy()


@contextlib.asynccontextmanager
async def server(database_url: str, env: dict[str, str]) -> AsyncIterator[str]:
    port = free_port()
    executable = shutil.which("fastpubsub") or str(Path(sys.executable).parent / "fastpubsub")
    log = tempfile.NamedTemporaryFile(prefix="fastpubsub-hostile-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the child runs alongside
        [executable, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as probe:
            for _ in range(300):
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited; see {log.name}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"{url}/readiness")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
        yield url
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
        log.close()
        os.unlink(log.name)


def cases(token: str) -> dict[str, tuple[str, str, bytes, dict[str, str]]]:
    """name -> (method, path, body, headers)."""
    form = b"&".join(b"f%06d=v" % i for i in range(1_000_000))[:TEN_MB]
    json_type = {"content-type": "application/json"}
    authorized = {**json_type, "authorization": f"Bearer {token}"}
    envelope = b'{"payload": {"order_id": 12345, "status": "created", "data": "' + b"x" * 150 + b'"}}'
    envelopes = b'{"messages": [' + b",".join([envelope] * (TEN_MB // (len(envelope) + 1) - 1)) + b"]}"
    big = b'{"n": 18446744073709551616, "data": "' + b"x" * 150 + b'"}'
    bigs = b"[" + b",".join([big] * (TEN_MB // (len(big) + 1) - 1)) + b"]"
    deep = b"[" * 100_000 + b"]" * 100_000
    return {
        "form bomb": ("POST", "/oauth/token", form, {"content-type": "application/x-www-form-urlencoded"}),
        "json without token": ("POST", "/topics/t/publish", envelopes, json_type),
        "seed publish, big ints": ("POST", "/topics/t/messages", bigs, authorized),
        "envelope publish": ("POST", "/topics/t/publish", envelopes, authorized),
        "deep publish": ("POST", "/topics/t/messages", deep, authorized),
    }


async def one(
    url: str, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, float, float]:
    """The hostile request's status and seconds, and the worst /liveness latency meanwhile."""
    worst = 0.0
    done = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while not done.is_set():
                started = time.perf_counter()
                await http.get("/liveness")
                worst = max(worst, time.perf_counter() - started)
                await asyncio.sleep(0.01)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.1)
        started = time.perf_counter()
        response = await http.request(method, path, content=body, headers=headers)
        took = time.perf_counter() - started
        await asyncio.sleep(0.05)
        done.set()
        await prober
    return response.status_code, took, worst


async def main(rounds: int) -> None:
    key = generate_signing_key()
    with postgres() as database_url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
        env.update(
            FASTPUBSUB_DATABASE_URL=database_url,
            FASTPUBSUB_LOG_LEVEL="warning",
            FASTPUBSUB_AUTH_ENABLED="true",
            FASTPUBSUB_AUTH_SECRET_KEY=key,
        )
        created = await asyncio.to_thread(
            subprocess.run,
            [str(Path(sys.executable).parent / "fastpubsub"), "create-client", "bench", "*", "true"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        values = dict(line.split("=", 1) for line in created.stdout.split())
        async with server(database_url, env) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                token = (
                    await http.post(
                        "/oauth/token",
                        json={"client_id": values["client_id"], "client_secret": values["client_secret"]},
                    )
                ).json()["access_token"]
                headers = {"authorization": f"Bearer {token}"}
                await http.post("/topics", json={"id": "t"}, headers=headers)
                await http.post("/subscriptions", json={"id": "s", "topic_id": "t"}, headers=headers)
            print(f"{'case':<24} {'status':>6} {'request s':>10} {'worst /liveness ms':>19}")
            for name, (method, path, body, headers) in cases(token).items():
                results = [await one(url, method, path, body, headers) for _ in range(rounds)]
                status = results[-1][0]
                took = statistics.median(r[1] for r in results)
                worst = statistics.median(r[2] for r in results)
                print(f"{name:<24} {status:>6} {took:>10.2f} {worst * 1000:>19.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args().rounds))
