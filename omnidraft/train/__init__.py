"""Online cross-vocabulary distillation (OmniDraft §3.2, Algorithm 2): records -> loss -> LoRA.

records.py   what each request teaches (target's sparse p at every emitted token) + alignment
loss.py      eq. (3)/(4): reverse KL at direct-mapping tokens + λ·NLL at n-gram sub-tokens
lora.py      peft LoRA for training; merged weights for inference
distill.py   one update over the buffer Q (AdamW, batches, micro-batches with yield points),
             then the acceptance head on Q's positions (Algorithm 3)
accept_head.py  §3.3: the head that predicts acceptance and stops drafts, eq. (5)-(7)
background.py  the trainer process beside decoding; adapter_store.py  adapters on disk
online.py    wiring into a pipeline: record, train, publish between steps
"""
