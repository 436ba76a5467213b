"""Which kernels a static-engine forward spends its time in, per row class (a one-off diagnosis)."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM
from omnidraft.target import static
sys.path.insert(0, "scripts")
from gpu_probe import CONFIGS  # noqa: E402

config = Qwen2Config(**CONFIGS[sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"], max_position_embeddings=32768, tie_word_embeddings=False)
with torch.device("cuda"):
    model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
lm = static.StaticLM(static.extract(model, "cuda", torch.bfloat16), graphs=False)
lm.logits_for(list(range(1, 513)), 1)
for rows in (1, 16):
    r = lm._runner(rows)
    r.run(list(range(5, 5 + rows)), 512)
    for _ in range(3):
        r._call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            r._call()
        torch.cuda.synchronize()
    print(f"== rows {rows}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
