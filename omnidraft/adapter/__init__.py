"""What decoding needs from a trained adapter: reading and checking it (``store``), merging it
into the drafter (``merge``), swapping versions between steps (``slot``) and running its
acceptance head (``head``). Training lives in ``omnidraft.train``; nothing here imports it."""
