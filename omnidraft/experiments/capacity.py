"""Server capacity: N devices drafting against one ``omnidraft serve``, with and without drafting.

Each client is a thread with a session of its own (its own ``grpc://`` client, its own copy of the
drafter): what N devices do to one server. The aggregate is the server's throughput: tokens all
clients received per second of wall time. Without drafting every token is one ``Verify``; with it,
a round trip carries ~2-3 tokens and the server's forwards serve more tokens each. On one 2-core
machine the clients' drafters share the cores with the server, which a real deployment would not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Drafter


@dataclass
class CapacityRow:
    clients: int
    drafting: bool
    tokens: int
    wall_s: float
    round_trips: int
    identical: bool  # every client's outputs equal one client's alone (same drafting), prompt for prompt

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def _client(pipe, connect, drafting: bool):
    """A fresh session (and drafter copy) on the pipeline's server."""
    target = connect()
    if not drafting:
        return SpeculativeDecoder(target)
    drafter = pipe.decoder.drafter
    return SpeculativeDecoder(target, Drafter(drafter.lm.fork(), drafter.stop_ids), pipe.decoder.bridge)


def run_capacity(pipe, connect, prompts: Sequence[list[int]], clients: Sequence[int], config: DecodeConfig) -> list[CapacityRow]:
    """For each client count, both without and with drafting: every client decodes all ``prompts``."""
    rows: list[CapacityRow] = []
    alone: dict[bool, list[list[int]]] = {}  # drafting -> the outputs of a single client
    for n in clients:
        for drafting in (False, True):
            decoders = [_client(pipe, connect, drafting) for _ in range(n)]
            for d in decoders:  # warm-up (and, with drafting, the cost policy's measurement)
                d.generate(prompts[0][:16], DecodeConfig(max_new_tokens=4))
            outputs: list[list[list[int]]] = [[] for _ in range(n)]
            trips = [0] * n

            def work(i: int) -> None:
                for ids in prompts:
                    result = decoders[i].generate(ids, config)
                    outputs[i].append(result.token_ids)
                    trips[i] += result.stats.target_forwards

            threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            reference = alone.setdefault(drafting, outputs[0])
            rows.append(CapacityRow(n, drafting, sum(len(o) for out in outputs for o in out), wall, sum(trips),
                                    all(out == reference for out in outputs)))
            for d in decoders:
                d.target.close()
    return rows


def markdown(rows: list[CapacityRow], meta: str) -> str:
    lines = [f"# omnidraft experiment capacity\n\n{meta}\n",
             "| clients | drafting | tokens | wall s | aggregate tok/s | tokens per round trip | vs 1 client, no drafting | outputs as one client's |",
             "|---|---|---|---|---|---|---|---|"]
    base = next((r.tokens_per_s for r in rows if r.clients == rows[0].clients and not r.drafting), 0.0)
    for r in rows:
        ratio = f"{r.tokens_per_s / base:.2f}×" if base else "–"
        lines.append(f"| {r.clients} | {'yes' if r.drafting else 'no'} | {r.tokens} | {r.wall_s:.1f} | {r.tokens_per_s:.2f} | "
                     f"{r.tokens / max(r.round_trips, 1):.2f} | {ratio} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines) + "\n"
