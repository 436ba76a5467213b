"""Usage: OMNIDRAFT_HOME=... .venv/bin/python scripts/rank_head_rows.py [--tokens 64000] [--drafter builtin:smollm2-135m]

Writes the starting set of head rows that ships for a drafter's vocabulary
(``omnidraft/drafter/head_rows/<vocab key>.bits``, read by ``native_lm.HeadVocab``).

Why: a native drafter step computes only the kept rows of its LM head (FR pruning, Algorithm 3 of the RDK
paper, after FR-Spec), and a fresh home keeps a base set plus what it reads. A base of the first third of the
ids (a BPE vocabulary's earliest merges) misses common whole words that were merged late (" merge" is id
16,905). FR-Spec ranks the vocabulary by token frequency in a corpus; none ships here, and the bench's prompt
sets must stay held out, so the frequency is counted from the drafter's own text: it samples at T = 1 from
short starts of code, prose, chat, JSON and a few other languages, and each position counts the token it
ranks first (its argmax, what a draft proposes). The base is the first third of the ids and every counted
token: a superset of the first third, so no text loses coverage, for a few percent more rows.

Deterministic for a given drafter file and kernel (one seed); ~5 ms a token on 2 cores."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from omnidraft import models
from tqdm.auto import tqdm

from omnidraft.drafter.native_lm import NativeDraftLM, head_rows_file, load_native_model
from omnidraft.fsutil import atomic_write

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# Written for this script, unlike any prompt set the bench reads: every kind of text a user may ask for.
STARTS = [
    "def ", "import numpy as np\n", "class ", "#include <stdio.h>\n\nint main(", "fn main() {\n", "SELECT ",
    "function ", "const express = require(", "#!/bin/bash\n", "public class ", "package main\n\nimport (",
    "<!DOCTYPE html>\n<html>\n", "{\n  \"name\": ", "---\ntitle: ", "diff --git a/", "$ git ",
    "The ", "In this article, we", "Once upon a time", "Dear ", "Abstract\n", "Chapter 1\n\n", "Q: ", "1. ",
    "According to the report,", "The study found that", "Ingredients:\n", "Here is a summary of",
    "Police said the", "The club's manager said", "Shares in the company", "The government has announced",
    "The 28-year-old striker", "A spokesman for the council said", "Scientists have discovered", "The court heard that",
    CHAT.format("Write a Python function that checks whether a string is a palindrome."),
    CHAT.format("Explain how vaccines work in simple terms."),
    CHAT.format("Give me three ideas for a birthday party."),
    CHAT.format("Fix the bug in this code:\nfor i in range(10)\n    print(i)"),
    CHAT.format("Return a JSON object with the fields name, age and city for a made-up person."),
    CHAT.format("Summarize the plot of a famous novel in one paragraph."),
    CHAT.format("What is the difference between a list and a tuple?"),
    CHAT.format("Write a short email asking for a meeting next week."),
    CHAT.format("How do I sort a dictionary by value in JavaScript?"),
    CHAT.format("Translate 'good morning, how are you?' into French, Spanish and German."),
    CHAT.format("Write a haiku about the sea."),
    CHAT.format("List the steps to set up a web server."),
    CHAT.format("请用中文介绍一下你自己。"), CHAT.format("日本の首都はどこですか?"),
    "Il était une fois", "Había una vez", "Es war einmal", "这是一个", "x = ", "Theorem 1.",
]


def sample_counts(lm: NativeDraftLM, starts: list[list[int]], tokens: int, stop: set[int], seed: int = 0) -> np.ndarray:
    """Per id, how often it was the drafter's top token at a position of its own sampled text."""
    counts = np.zeros(lm.vocab_size, dtype=np.int64)
    gen = torch.Generator().manual_seed(seed)
    per_start = max(1, tokens // len(starts))
    bar = tqdm(total=per_start * len(starts), desc="sampling", unit="tok")
    for ids in starts:
        lm.reset()
        logits = lm.logits_for(ids)
        for _ in range(per_start):
            counts[int(logits.argmax())] += 1
            token = int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen))
            bar.update(1)
            if token in stop or len(lm.cached_ids) + 1 >= lm.max_positions:
                lm.reset()
                logits = lm.logits_for(ids)  # the same start again: a fresh sample from it
                continue
            logits = lm.step(token)
    bar.close()
    return counts


def base_set(counts: np.ndarray) -> np.ndarray:
    """The first third of the ids and every id counted: a boolean mask over the vocabulary. (Ranking all of them
    into a set of the third's size instead dropped first-third ids the sample never reached, and lost more
    coverage on prose than it gained.)"""
    return (np.arange(len(counts)) < len(counts) // 3) | (counts > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--drafter", default="builtin:smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64_000)
    args = parser.parse_args()
    home = os.environ.get("OMNIDRAFT_HOME")
    gguf = models.gguf_of(args.drafter, home, progress=False)
    if gguf is None:
        sys.exit(f"{args.drafter} has no GGUF")
    weights = load_native_model(gguf)
    lm = NativeDraftLM(weights)
    lm.prune_head = False  # the whole head: the ranking must see every id
    tok = models.load_tokenizer(args.drafter, home, progress=False)
    starts = [tok.encode(s) or [tok.bos_token_id or 0] for s in STARTS]
    stop = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    began = time.time()
    counts = sample_counts(lm, starts, args.tokens, stop)
    kept = base_set(counts)
    out = head_rows_file(weights.vocab_key)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, np.packbits(kept).tobytes())
    late = int(kept[lm.vocab_size // 3:].sum())
    print(f"{counts.sum()} positions, {int((counts > 0).sum())} distinct top tokens, {late} past the first third, "
          f"{int(kept.sum())} rows kept; "
          f"{time.time() - began:.0f} s -> {out}")


if __name__ == "__main__":
    main()
