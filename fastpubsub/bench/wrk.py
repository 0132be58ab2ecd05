"""Load from wrk, a compiled HTTP load generator: the server's speed, not the generator's.

A Python client spends a millisecond or so of CPU per request; on a small
machine that caps it at a few hundred requests a second and takes the CPU from
the server being measured. wrk (`apt-get install wrk`) keeps many connections
busy from two threads for a fraction of that. Each run here reports its
requests, latency percentiles, errors and the share of one CPU wrk itself used,
through a Lua `done` hook that prints one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass

import orjson

# Appended to every script: one JSON line with what wrk measured.
_REPORT = """
done = function(summary, latency, requests)
  local e = summary.errors
  local extra = 0
  for _, thread in ipairs(threads or {}) do
    extra = extra + (thread:get("settled") or 0)
  end
  io.write(string.format(
    '\\n@@wrk {"requests": %d, "duration_us": %d, "errors": %d, "non_2xx": %d, '
    .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "settled": %d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), extra))
end
"""


def publish_script(path: str, body: bytes) -> str:
    """POST the same JSON body to `path` on every request."""
    return (
        f'wrk.method = "POST"\nwrk.path = {_lua(path)}\n'
        f'wrk.headers["Content-Type"] = "application/json"\nwrk.body = {_lua(body.decode())}\n'
    )


# The headers of a request with a JSON body: wrk's own (those given with -H,
# the access token among them) and the content type. A request formatted with
# headers of its own gets those alone.
_JSON_HEADERS = (
    "local json = {}\n"
    "for name, value in pairs(wrk.headers) do json[name] = value end\n"
    'json["Content-Type"] = "application/json"'
)


def consume_ack_script(subscription: str, consumer: str) -> str:
    """Lease one message, then ack it by id: two requests per message, on any of the connections.

    Each wrk thread keeps the ids its consume requests received and sends an
    ack for one of them before its next consume; `settled` counts the acks.
    """
    base = f"/subscriptions/{subscription}"
    return f"""
threads = {{}}
setup = function(thread) table.insert(threads, thread) end
local queue = {{}}
local consume = wrk.format("GET", {_lua(base + "/messages?batch_size=1&consumer_id=" + consumer)})
local ack_path = {_lua(base + "/acks")}
{_JSON_HEADERS}
settled = 0
request = function()
  local id = table.remove(queue)
  if id then
    settled = settled + 1
    return wrk.format("POST", ack_path, json, '["' .. id .. '"]')
  end
  return consume
end
response = function(status, headers, body)
  local id = string.match(body, '"id"%s*:%s*"([0-9a-f%-]+)"')
  if id then table.insert(queue, id) end
end
"""


def paced_publish_script(
    path: str, *, rate: float, total: int, start: float, threads: int, fields: str
) -> str:
    """POST message 0..total-1 to `path`, one per request, message n due at start + n / rate.

    `start` is on CLOCK_MONOTONIC, the clock of Python's time.perf_counter()
    on Linux; each message is {"order_id": n, "sent": <that clock when the
    request was made>, <fields>} (fields: JSON members without braces), so a
    consumer in another process can tell how long each message took. Thread t
    of `threads` sends messages t, t + threads, ...: wrk asks `delay` before
    each request, which books the thread's next message for the connection
    and waits until it is due (LuaJIT's ffi reads the clock); a connection
    whose message is late goes at once. Once every message is booked the
    connections wait, until wrk is stopped (SIGINT: it reports as usual).
    """
    return f"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} fastpubsub_timespec;
int clock_gettime(int clock_id, fastpubsub_timespec *tp);
]]
local clock = ffi.new("fastpubsub_timespec")
local function now()
  ffi.C.clock_gettime(1, clock)  -- CLOCK_MONOTONIC
  return tonumber(clock.tv_sec) + tonumber(clock.tv_nsec) / 1e9
end
local RATE, START, TOTAL, STEP = {float(rate)!r}, {float(start)!r}, {int(total)}, {int(threads)}
local PATH, FIELDS = {_lua(path)}, {_lua(fields)}
{_JSON_HEADERS}
local set_up = 0
setup = function(thread)
  thread:set("first", set_up)
  set_up = set_up + 1
end
local booked, due = nil, {{}}
delay = function()
  booked = booked or first
  if booked >= TOTAL then
    return 3600000
  end
  table.insert(due, booked)
  local wait = (START + booked / RATE - now()) * 1000
  booked = booked + STEP
  return wait > 0 and math.floor(wait) or 0
end
request = function()
  -- wrk also makes one request when it checks the script, and does not send it
  local n = table.remove(due, 1) or booked or first or 0
  return wrk.format("POST", PATH, json,
    '[{{"order_id":' .. n .. ',"sent":' .. string.format("%.6f", now()) .. ',' .. FIELDS .. '}}]')
end
"""


def _lua(text: str) -> str:
    """A Lua string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: int
    non_2xx: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    settled: int  # consume+ack: acks sent
    cpu_share: float  # CPU time wrk used over the run's duration (1.0: one full core)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


class WrkMissing(RuntimeError):
    """wrk is not installed."""


def find_wrk() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise WrkMissing("wrk is not installed: the HTTP load needs it (apt-get install wrk)")
    return found


async def run(
    url: str,
    path: str,
    *,
    connections: int,
    seconds: float,
    script: str = "",
    threads: int = 2,
    token: str | None = None,
    stop: asyncio.Event | None = None,
) -> WrkResult:
    """Run wrk against url+path; `script` sets the requests (default: GET path).

    It runs for `seconds`, or until `stop` is set: then it gets SIGINT, which
    wrk takes as its time being up (it reports what it did so far).
    """
    binary = find_wrk()
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="fastpubsub-wrk-", delete=False) as lua:
        lua.write(script + _REPORT)
    args = [
        binary,
        f"-t{min(threads, connections)}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "30s",
        "-s",
        lua.name,
    ]
    if token:
        args += ["-H", f"Authorization: Bearer {token}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            *args, url.rstrip("/") + path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        finishing = asyncio.ensure_future(process.communicate())
        try:
            if stop is not None:
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait({finishing, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not finishing.done():
                    process.send_signal(signal.SIGINT)
            out, err = await finishing
        finally:
            if process.returncode is None:  # cancelled: no wrk left behind
                finishing.cancel()
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
    finally:
        os.unlink(lua.name)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = next((line for line in out.decode().splitlines() if line.startswith("@@wrk ")), None)
    if process.returncode != 0 or report is None:
        raise RuntimeError(f"wrk failed ({process.returncode}): {err.decode().strip()[-500:]}")
    figures = orjson.loads(report.removeprefix("@@wrk "))
    return WrkResult(
        requests=figures["requests"],
        seconds=figures["duration_us"] / 1e6,
        errors=figures["errors"],
        non_2xx=figures["non_2xx"],
        p50_ms=figures["p50_us"] / 1000,
        p90_ms=figures["p90_us"] / 1000,
        p99_ms=figures["p99_us"] / 1000,
        settled=figures["settled"],
        cpu_share=cpu / wall if wall else 0.0,
    )
