"""Native kernels, compiled once per machine by the set-up step; everything works without them.

``linear_rows(x, w)``: a float32 Linear product for a few rows in one pass over the weights
(``skinny.cpp``, AVX2 + FMA). On CPUs where torch's MKL takes its AVX2 path, GEMMs of 2-8 rows are
compute-bound: two rows cost 1.5-1.8x one although the weights are read once either way, so a
verify of one proposal cost 1.3-1.9 plain steps on the torch target. This kernel reads each weight
row once for up to 8 input rows, and a row's result is bit-identical whatever the row count.
``fastlinear`` offers it as one more candidate and keeps it only where it times fastest.

``linear_rows_512(x, w)``: the same product with AVX-512 registers where the CPU has them
(``skinny512.cpp``, the same bits), up to 8 rows per pass over the weights; ``fastlinear`` times it too.

``qdraft()``: a llama-architecture drafter's whole forward on its GGUF blocks in one call
(``qdraft.cpp``; the ``native`` drafter backend, ``drafter/native_lm.py``).

Each is built by ``python -m omnidraft.kernels`` (``scripts/setup.sh`` runs it: ~1 min, needs a C++
compiler and ninja) into ``~/.cache/omnidraft/kernels/<tag>``, the tag naming the source, torch and
Python versions. A run never compiles: :func:`linear_rows` and :func:`qdraft` return None when no
build for this tag exists, the CPU lacks AVX2/FMA or ``OMNIDRAFT_NATIVE_KERNELS=0`` is set, and the
torch kernels (or another drafter backend) are used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import sys
from functools import cache
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).parent
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # OpenMP: at::parallel_for runs serially without it
# name -> (source, compiler flags); each is built and loaded on its own, so one failing leaves the others
EXTENSIONS = {"skinny": ("skinny.cpp", BASE_FLAGS), "qdraft": ("qdraft.cpp", [*BASE_FLAGS, "-mf16c"]),
              "skinny512": ("skinny512.cpp", [*BASE_FLAGS, "-mavx512f"])}
NEEDS_AVX512 = {"skinny512"}  # built and loaded only where torch reports AVX-512


def _source_bytes(source: str) -> bytes:
    """The source and the local headers it includes (``#include "x.h"``): what a build depends on."""
    text = (HERE / source).read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join((HERE / h.decode()).read_bytes() for h in headers)


def _tag(name: str = "skinny") -> str:
    source, flags = EXTENSIONS[name]
    digest = hashlib.sha256(_source_bytes(source) + " ".join(flags).encode()).hexdigest()[:12]
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return f"{name}_{digest}_torch{version}_py{sys.version_info.major}{sys.version_info.minor}"


def build_dir(name: str = "skinny") -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "omnidraft" / "kernels" / _tag(name)


def unsupported_reason(name: str = "skinny") -> str | None:
    """Why kernel ``name`` cannot run on this machine, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {capability})"
    if name in NEEDS_AVX512 and capability != "AVX512":
        return f"the CPU lacks AVX-512 (torch reports {capability})"
    return None


def build(name: str = "skinny", verbose: bool = False):
    """Compile one extension for this machine (the set-up step); returns the module."""
    from torch.utils.cpp_extension import load

    source, flags = EXTENSIONS[name]
    folder = build_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    return load(name=_tag(name), sources=[str(HERE / source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=verbose)


@cache
def _module(name: str = "skinny"):
    if os.environ.get("OMNIDRAFT_NATIVE_KERNELS") == "0" or unsupported_reason(name) is not None:
        return None
    library = build_dir(name) / f"{_tag(name)}.so"
    if not library.is_file():
        return None
    try:  # what torch's cpp_extension does to import a built extension, without ninja at run time
        spec = importlib.util.spec_from_file_location(_tag(name), library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):  # a build for another torch or a damaged file: run without it
        return None
    return module


def linear_rows() -> Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor] | None:
    """The built kernel (x [rows, in], w [out, in], tiled -> [rows, out]), or None. ``tiled`` picks
    the layout (tiles of weight rows by 4 input rows, or one weight row by 8); both give the same
    bits."""
    module = _module("skinny")
    return None if module is None else module.linear_rows


def linear_rows_512() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The AVX-512 build of the same product (``skinny512.cpp``: x [rows, in], w [out, in] -> [rows,
    out], the same bits as :func:`linear_rows`), or None where the CPU lacks AVX-512 or it is not built."""
    module = _module("skinny512")
    return None if module is None else module.linear_rows


def qdraft():
    """The native drafter forward (``qdraft.cpp``: ``Model`` and ``Cache``), or None where not built."""
    return _module("qdraft")


def main() -> int:
    reason = unsupported_reason()
    if reason is not None:
        print(f"omnidraft kernels: not built: {reason}")
        return 0
    for name in EXTENSIONS:
        if unsupported_reason(name) is not None:
            print(f"omnidraft kernels: {name} not built: {unsupported_reason(name)}")
            continue
        try:
            build(name)
        except Exception as exc:  # no compiler or ninja: the torch kernels and other backends serve
            first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
            print(f"omnidraft kernels: {name} not built ({exc.__class__.__name__}: {first}); running without it")
            continue
        _module.cache_clear()
        ok = _module(name) is not None
        print(f"omnidraft kernels: {name} {'built' if ok else 'built but not loadable'} in {build_dir(name)}")
    return 0
