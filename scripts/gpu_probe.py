"""Step costs of the GPU engine (omnidraft/target/static.py) and a bit-for-bit check of its batch
invariance, on randomly initialised Qwen2.5-shaped models: step costs do not depend on the weights'
values, so the sizes we cannot carry to a GPU machine can still be timed. docs/remote.md reports it.

    python scripts/gpu_probe.py --models qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from omnidraft.kv import cache_keyword
from omnidraft.target import static

CONFIGS = {  # the published Qwen2.5 shapes (config.json of each size)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),  # a dry run of this script on a CPU
}
CONTEXT = 512  # tokens in the cache while timing


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn, n: int) -> float:
    """Mean of ``n`` calls after one untimed call, in ms, with the GPU drained before and after."""
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t0) / n * 1e3


def probe(name: str, n: int, device: str) -> dict:
    config = Qwen2Config(**CONFIGS[name], max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    t0 = time.perf_counter()
    lm = static.StaticLM(static.extract(model, device, torch.bfloat16))
    lm.warm_up(16)
    capture_s = time.perf_counter() - t0
    ids = torch.randint(0, config.vocab_size, (CONTEXT + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    lm.logits_for(ids[:CONTEXT], 1)
    out: dict = {"model": name, "capture_s": round(capture_s, 2)}

    # graph replays alone, per class (and a 1-row graph: what an unpadded plain step would cost)
    for rows in (1, static.DECODE_ROWS, static.PREFILL_ROWS):
        runner = lm.pool.runner(lm.slot, 1, rows)
        runner.run(ids[CONTEXT:CONTEXT + min(rows, 8)], CONTEXT)
        replay = runner.graph.replay if runner.graph is not None else runner._call
        out[f"graph_{rows}_ms"] = round(_ms(replay, n), 3)

    # what the server pays per forward: inputs up, replay, the kept logit rows down as float32
    def verify(k: int):
        def run():
            lm.crop(CONTEXT)
            lm.logits_for(ids[:CONTEXT + 1 + k], k + 1)
        return run
    for k in (0, 1, 4, 8, 15):
        out[f"V{k}_ms"] = round(_ms(verify(k), n), 3)

    # batch invariance: 9 rows of one verify against 9 plain steps, bit for bit
    lm.crop(CONTEXT)
    together = lm.logits_for(ids[:CONTEXT + 9], 9)
    lm.crop(CONTEXT)
    alone = torch.cat([lm.logits_for(ids[:CONTEXT + i + 1], 1) for i in range(9)])
    out["verify_rows_equal_plain_steps"] = bool(torch.equal(together, alone))
    out["max_abs_diff"] = float((together - alone).abs().max())

    # the eager transformers step the engine replaces (DynamicCache, no graphs)
    cache, kw = DynamicCache(), cache_keyword(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:CONTEXT]], device=device), use_cache=True, **{kw: cache})
        token = torch.tensor([[ids[CONTEXT]]], device=device)

        def eager():
            model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache})
            cache.crop(-1)
        out["eager_step_ms"] = round(_ms(eager, max(5, n // 10)), 3)
    del model, lm
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--n", type=int, default=100, help="timed calls per figure")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(device_name, torch.__version__, flush=True)
    rows = []
    for name in args.models.split(","):
        row = probe(name, args.n, args.device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
