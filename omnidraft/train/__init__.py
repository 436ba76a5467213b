"""Online cross-vocabulary distillation (OmniDraft §3.2, Algorithm 2): records -> loss -> LoRA.

config.py       the options (TrainConfig), importable without torch
records.py      what each request teaches (target's sparse p at every emitted token) + alignment
loss.py         eq. (3)/(4): reverse KL at direct-mapping tokens + λ·NLL at n-gram sub-tokens
lora.py         peft LoRA for training
distill.py      one update over the buffer Q (AdamW, batches, micro-batches with yield points),
                then the acceptance head on Q's positions (Algorithm 3)
accept_head.py  the head's loss (§3.3); the head itself is in omnidraft.adapter.head
background.py   the trainer process beside decoding; worker.py its main loop
publish.py      atomic publishing of adapter versions
online.py       wiring into a pipeline: record, train, publish between steps

Decoding never imports this package: what it needs of an adapter is in omnidraft.adapter.
"""
