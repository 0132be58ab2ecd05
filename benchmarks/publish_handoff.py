"""A publish handing its messages to the consumer waiting beside it, against that consumer looking itself.

    python benchmarks/publish_handoff.py [--rounds 3] [--seconds 10] [--rate 100] [--workers 1]

Starts a throwaway embedded PostgreSQL, then in alternating rounds a
`fastpubsub server` with FASTPUBSUB_PUBLISH_HANDOFF on and off, and runs the
end-to-end workload of `fastpubsub bench all` on each (wrk publishing one
message per request at a fixed rate, one long-polling consumer acking as it
receives; see worker_relay.py, whose round this is). With one worker (the
default) every publish lands in the process the consumer waits in; with N
workers about one publish in N does, and the others hand their messages to
the consumer's worker by datagram (a sibling hand-off), which off also stops.
Prints a line per round, the medians, and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio

from worker_relay import compare

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=float, default=100)
    parser.add_argument("--workers", type=int, default=1)
    options = parser.parse_args()
    asyncio.run(compare("FASTPUBSUB_PUBLISH_HANDOFF", ("handed_off", "looked"), options, options.workers))
