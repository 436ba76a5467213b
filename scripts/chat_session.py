"""Drive `omnidraft chat` through a scripted session and plot how it speeds up turn by turn.

A user chats in a domain new to the drafter; between turns they read the reply and type the next
message, which is when the background trainer updates the pair's adapter. This script plays that
user: after a warm-up message and `/reset`, it sends the messages of a prompt set one per turn, waits ``--pause`` seconds after each
reply (the reading and typing time the trainer gets), then `/stats`, `/save` and `/quit`. Run it
twice on the same messages, once with ``--drafter none`` (the target alone, the baseline) and
once with the drafter, then plot both transcripts:

    .venv/bin/python scripts/chat_session.py run --prompts ja --turns 20 --out /tmp/chat/target.json \\
        -- --engine torch --target builtin:qwen2.5-coder-0.5b --drafter none
    .venv/bin/python scripts/chat_session.py run --prompts ja --turns 20 --out /tmp/chat/omnidraft.json \\
        -- --engine torch --target builtin:qwen2.5-coder-0.5b
    .venv/bin/python scripts/chat_session.py plot /tmp/chat/target.json /tmp/chat/omnidraft.json \\
        --out docs/chat-ja-turns.png

Greedy replies are the target's own whatever drafts, so both runs see the same conversation and
the per-turn ratio compares like with like.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnidraft.data import load_prompts

PROMPT = ">>> "  # omnidraft.chat.session.PROMPT, read here as the end of a reply


class ChatProcess:
    """`omnidraft chat` on pipes: ``send`` writes a line and returns what was printed until the
    next prompt (the reply and its status line)."""

    def __init__(self, chat_args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "omnidraft", "chat", *chat_args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.buffer, self.ready = "", threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_prompt(timeout=900)  # models load, and a fresh home measures its costs once

    def _read(self) -> None:
        while ch := self.proc.stdout.read(1):
            self.buffer += ch
            if self.buffer.endswith(PROMPT):
                self.ready.set()
        self.ready.set()  # the process ended: wake a waiter instead of letting it time out

    def wait_prompt(self, timeout: float) -> str:
        if not self.ready.wait(timeout):
            raise TimeoutError(f"no prompt from chat after {timeout:.0f} s; it printed:\n{self.buffer[-2000:]}")
        if self.proc.poll() is not None and not self.buffer.endswith(PROMPT):
            raise RuntimeError(f"chat exited with {self.proc.returncode}; it printed:\n{self.buffer[-2000:]}")
        text, self.buffer = self.buffer, ""
        self.ready.clear()
        return text

    def send(self, line: str, timeout: float = 900) -> str:
        self.proc.stdin.write(line.replace("\n", " ") + "\n")
        self.proc.stdin.flush()
        return self.wait_prompt(timeout)

    def quit(self) -> None:
        self.proc.stdin.write("/quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=300)


def run(args: argparse.Namespace) -> None:
    messages = [r.text for r in load_prompts(args.prompts, n=args.turns, offset=args.offset)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    chat = ChatProcess(args.chat_args)
    try:
        if args.warmup:  # one-time costs (a fresh home measures the machine once) stay out of turn 1
            chat.send(args.warmup)
            chat.send("/reset")
        for i, message in enumerate(messages, 1):
            started = time.perf_counter()
            shown = chat.send(message)
            status = [line for line in shown.splitlines() if line.startswith("[")]
            print(f"turn {i}/{len(messages)} ({time.perf_counter() - started:.1f} s): "
                  f"{status[-1] if status else shown[-300:]}", flush=True)
            time.sleep(args.pause)
        print(chat.send("/stats"), flush=True)
        chat.send(f"/save {args.out}")
    finally:
        chat.quit()
    print(f"wrote {args.out}")


def per_turn(path: Path) -> list[dict]:
    return json.loads(path.read_text())["turns"]


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, ours = per_turn(args.baseline), per_turn(args.session)
    if [t["reply_tokens"] for t in base] != [t["reply_tokens"] for t in ours]:
        raise SystemExit("the two sessions' replies differ in length: not the same conversation")
    turns = range(1, len(ours) + 1)
    speedup = [o["stats"]["tokens_per_s"] / b["stats"]["tokens_per_s"] for o, b in zip(ours, base)]
    accept = [o["stats"]["acceptance_rate"] for o in ours]
    versions = [o["adapter_version"] or 0 for o in ours]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True)
    ax1.plot(turns, [o["stats"]["tokens_per_s"] for o in ours], marker="o", label="omnidraft chat")
    ax1.plot(turns, [b["stats"]["tokens_per_s"] for b in base], marker="s", label="the target alone")
    ax1.set_ylabel("tokens/s")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(turns, accept, marker="o", color="C2", label="acceptance per proposal")
    ax2.plot(turns, speedup, marker="^", color="C3", label="speedup vs the target alone")
    # where the accepted tokens came from: the drafter model, or prompt lookup (free, not the adapter)
    ax2.plot(turns, [o["stats"]["lookup_accepted"] / o["stats"]["new_tokens"] for o in ours], ls=":", color="C4",
             label="share of tokens drafted by lookup")
    ax2.plot(turns, [(o["stats"]["accepted_tokens"] - o["stats"]["lookup_accepted"]) / o["stats"]["new_tokens"]
                     for o in ours], ls=":", marker=".", color="C1", label="share of tokens drafted by the drafter")
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1]:
            ax2.axvline(turns[i], color="grey", alpha=0.3)
            ax2.text(turns[i], 0.02, f"v{versions[i]}", fontsize=7, color="grey")
    ax2.axhline(1.0, ls="--", color="grey", lw=0.8)
    ax2.set_xticks(list(turns))
    ax2.set_xlabel("turn (grey lines: a new adapter version)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    n = min(3, len(ours) // 2)
    from_drafter = sum(o["stats"]["accepted_tokens"] - o["stats"]["lookup_accepted"] for o in ours)
    print(f"tokens accepted from the drafter {from_drafter}, from lookup {sum(o['stats']['lookup_accepted'] for o in ours)}, "
          f"of {sum(o['stats']['new_tokens'] for o in ours)} new tokens")
    print(f"wrote {args.out}; speedup first {n} turns {sum(speedup[:n]) / n:.2f}x, last {n} {sum(speedup[-n:]) / n:.2f}x; "
          f"acceptance {sum(accept[:n]) / n:.2f} -> {sum(accept[-n:]) / n:.2f}; adapter v{versions[0]} -> v{versions[-1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="play a scripted session; arguments after -- go to `omnidraft chat`")
    r.add_argument("--prompts", required=True, help="prompt set whose messages are the user's turns")
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--turns", type=int, default=20)
    r.add_argument("--pause", type=float, default=20.0, help="seconds between a reply and the next message")
    r.add_argument("--out", type=Path, required=True, help="where /save writes the transcript")
    r.add_argument("--warmup", default="Hello!", help="a first message, then /reset: one-time costs stay out "
                                                       "of the turns ('' for none)")
    r.add_argument("chat_args", nargs=argparse.REMAINDER)
    q = sub.add_parser("plot", help="tokens/s, acceptance and speedup per turn, from two transcripts")
    q.add_argument("baseline", type=Path, help="the transcript of the target alone (--drafter none)")
    q.add_argument("session", type=Path, help="the transcript with the drafter")
    q.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.cmd == "run":
        args.chat_args = [a for a in args.chat_args if a != "--"]
        run(args)
    else:
        plot(args)


if __name__ == "__main__":
    main()
