"""Server capacity: N devices drafting against one ``omnidraft serve``, with and without drafting.

Each client is a thread with a session of its own (its own ``grpc://`` client, its own copy of the
drafter): what N devices do to one server. The aggregate is the server's throughput: tokens all
clients received per second of wall time. The server's cost comes from its own counters (``Info``):
forwards per emitted token (a batching server serves several sessions per forward; a draft that is
accepted emits several tokens per forward) and busy seconds per emitted token. On one 2-core
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
    round_trips: int  # server forwards each client took part in, summed over clients
    identical: bool  # every client's outputs equal one client's alone (same drafting), prompt for prompt
    server_forwards: int = 0  # forwards the server ran (a shared one counts once)
    server_busy_s: float = 0.0

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


def run_capacity(pipe, connect, prompts: Sequence[list[int]], clients: Sequence[int], config: DecodeConfig,
                 drafting_modes: Sequence[bool] = (False, True)) -> list[CapacityRow]:
    """For each client count and each of ``drafting_modes``: every client decodes all ``prompts``."""
    rows: list[CapacityRow] = []
    alone: dict[bool, list[list[int]]] = {}  # drafting -> the outputs of a single client
    for n in clients:
        for drafting in drafting_modes:
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
            before = decoders[0].target.server_info()
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            after = decoders[0].target.server_info()
            reference = alone.setdefault(drafting, outputs[0])
            rows.append(CapacityRow(n, drafting, sum(len(o) for out in outputs for o in out), wall, sum(trips),
                                    all(out == reference for out in outputs), after.forwards - before.forwards,
                                    after.busy_s - before.busy_s))
            for d in decoders:
                d.target.close()
    return rows


def markdown(rows: list[CapacityRow], meta: str) -> str:
    lines = [f"# omnidraft experiment capacity\n\n{meta}\n",
             "| clients | drafting | tokens | wall s | aggregate tok/s | vs 1 client, same drafting | tokens per client forward "
             "| server forwards per token | server busy ms per token | outputs as one client's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b.tokens_per_s for b in rows if b.drafting == r.drafting), 0.0)
        ratio = f"{r.tokens_per_s / base:.2f}×" if base else "–"
        tokens = max(r.tokens, 1)
        lines.append(f"| {r.clients} | {'yes' if r.drafting else 'no'} | {r.tokens} | {r.wall_s:.1f} | {r.tokens_per_s:.2f} | "
                     f"{ratio} | {r.tokens / max(r.round_trips, 1):.2f} | {r.server_forwards / tokens:.3f} | "
                     f"{r.server_busy_s * 1000 / tokens:.2f} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines) + "\n"
