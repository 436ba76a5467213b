"""``omnidraft serve``: run a target behind gRPC for devices that draft (``--target grpc://HOST:PORT``)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from omnidraft.cli.options import COUNT, integer, text
from omnidraft.config import DEVICES, ENGINES
from omnidraft.console import notice
from omnidraft.errors import OmnidraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a target over gRPC; devices draft and send only token ids",
                       description="Serve a target over gRPC (omnidraft/rpc/target.proto). Clients use "
                                   "--target grpc://HOST:PORT; verification runs here, only token ids cross the wire.")
    p.add_argument("--target", type=text, default="builtin:qwen2.5-coder-0.5b", help="the model to serve")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="what runs it (as for generate)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="precision on the torch engine (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the torch engine runs: cuda (bfloat16, a static KV cache per session and CUDA "
                        "graphs), cpu, or auto: the GPU when torch sees one")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=integer(0, 65535), default=50551, help="port (0: any free one; default 50551)")
    p.add_argument("--max-sessions", type=COUNT, default=8, help="sessions (KV caches) kept, least recently used go first")
    p.add_argument("--batch", action="store_true",
                   help="every forward serves all sessions that have work (up to --max-sessions), on the torch engine: "
                        "more tokens per second in all, each client's output still exactly its own")
    p.add_argument("--max-context", type=COUNT, default=None, help="tokens a session may hold (default: the engine's)")
    p.add_argument("--max-draft", type=integer(1, 256), default=32, help="proposals per call (default 32)")
    p.add_argument("--token-file", default=None, help="clients must send this token (default: $OMNIDRAFT_TOKEN; none: no auth)")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (with --tls-key: serve TLS, grpcs://)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback address without a token or TLS")
    p.set_defaults(func=run)


def _tls(args: argparse.Namespace) -> tuple[bytes, bytes] | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise OmnidraftError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    try:
        return args.tls_cert.read_bytes(), args.tls_key.read_bytes()
    except OSError as exc:
        raise OmnidraftError(f"cannot read the TLS files: {exc.strerror}: {exc.filename}") from None


def run(args: argparse.Namespace) -> int:
    from omnidraft import models
    from omnidraft.sources.lookup import LOOKUP_MAX
    from omnidraft.rpc import read_token
    from omnidraft.rpc.server import log_start, serve
    from omnidraft.runtime import load_target, loading_heap

    if args.target.startswith(("grpc://", "grpcs://")):
        raise OmnidraftError("serve runs a model here: give a builtin, a folder or a .gguf file, not another server")
    token, tls = read_token(args.token_file), _tls(args)
    models.check_spec(args.target)
    batch = args.max_sessions if args.batch else 1
    engine = "torch" if args.batch and args.engine == "auto" else args.engine  # the engine that batches
    with loading_heap():
        target, _, engine = load_target(args.target, engine, dtype=args.dtype, device=args.device,
                                        context=args.max_context, batch=batch)
        if hasattr(target, "warm_up"):  # torch: kernels chosen by timing (CPU) or captured (GPU) before clients come
            notice(f"preparing the verify kernels once (draft lengths 0-{min(args.max_draft, LOOKUP_MAX)}) …")
            target.warm_up(min(args.max_draft, LOOKUP_MAX))
    builtin = models.builtin(args.target)
    served = serve(target, args.target, engine, host=args.host, port=args.port, token=token, tls=tls,
                   insecure=args.insecure, max_sessions=args.max_sessions, max_context=args.max_context,
                   max_draft=args.max_draft, model_sha256=builtin.sha256 if builtin else "")
    log_start(served, args.host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    served.drain()
    print(f"omnidraft: drained after {served.service.verifies} verify calls", flush=True)
    return 0
