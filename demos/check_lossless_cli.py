"""Check: `omnidraft generate --verify greedy` equals plain transformers greedy on unseen prompts, both targets (run after setup; state under $OMNIDRAFT_HOME or the cwd)."""
import json
import os
import subprocess
import sys

import torch

torch.set_num_threads(2)
from omnidraft import models
from omnidraft.runtime import encode_prompt

H = os.environ.get("OMNIDRAFT_HOME", os.getcwd())
prompts = [("Write a haiku about compilers.", True), ("import numpy as np\n\ndef moving_average(x, w):\n", False),
           ("Les trois plus grandes villes de France sont", False)]
for target in ["builtin:qwen2.5-coder-0.5b", "builtin:gemma3-270m"]:
    model, tok = models.load(target, home=H, progress=False)
    for text, chat in prompts:
        args = [sys.executable, "-m", "omnidraft", "--home", H, "generate", "--target", target, "--verify", "greedy",
                "--prompt", text, "--max-new-tokens", "64", "--json"] + (["--chat"] if chat else [])
        out = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
        ids = encode_prompt(tok, text, chat=chat)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        s = out["stats"]
        print(f"{target} | {text[:30]!r} | identical={out['token_ids'] == ref} | accept {s['acceptance_rate']:.2f} | tok/fwd {s['new_tokens']/s['target_forwards']:.2f} | {s['tokens_per_s']:.2f} tok/s", flush=True)
