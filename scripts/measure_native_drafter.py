"""Usage: OMNIDRAFT_HOME=... .venv/bin/python scripts/measure_native_drafter.py

ms per one-token step of SmolLM2-135M on the native forward and on llama.cpp (the same GGUF), after
contexts of several lengths, without and with a rank-32 adapter on every Linear; median of 40 steps,
the backends measured in turn (interleaved) 3 times. Prints a markdown table for docs/performance.md."""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from omnidraft import models
from omnidraft.runtime import gguf_drafter, native_drafter
from omnidraft.train import lora

SPEC = "builtin:smollm2-135m"
CONTEXTS = (8, 100, 200, 400, 800)


def step_ms(lm, context: int, n: int = 40) -> float:
    ids = [1000 + (i * 7919) % 40000 for i in range(context)]
    lm.reset()
    lm.logits_for(ids)
    times = []
    for i in range(n):
        start = time.perf_counter()
        lm.step(2000 + i)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    home = os.environ.get("OMNIDRAFT_HOME")
    model, _ = models.load(SPEC, home=home, progress=False)
    peft = lora.attach(copy.deepcopy(model), lora.lora_config(rank=32, alpha=32))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.002)
    state = lora.lora_state(peft)
    native, _ = native_drafter(SPEC, home, quiet=True)
    llama, _ = gguf_drafter(SPEC, home, quiet=True)
    rows: dict[tuple[str, int], list[float]] = {}
    for _ in range(3):
        for label, lm in (("native", native), ("llama.cpp", llama)):
            for adapter in (None, state):
                lm.apply_adapter(adapter, 1.0)
                name = label + (" + rank-32 LoRA" if adapter is not None else "")
                for context in CONTEXTS:
                    rows.setdefault((name, context), []).append(step_ms(lm, context))
    names = dict.fromkeys(name for name, _ in rows)
    print("| drafter | " + " | ".join(f"context {c}" for c in CONTEXTS) + " |")
    print("|---|" + "---|" * len(CONTEXTS))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{statistics.median(rows[(name, c)]):.1f}" for c in CONTEXTS) + " |")


if __name__ == "__main__":
    main()
