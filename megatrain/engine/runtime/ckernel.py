"""Small C kernels compiled on first use with the system's C compiler, cached, and called through ctypes.

Their sources are the `.c` files in `kernels/` beside this module (shipped as package data); `LazyKernel` is the
one loader: it builds a kernel once per process, on first use, under a lock, and keeps it only where the
kernel's own self-check against torch passes.

ctypes releases the GIL for the call, so a kernel runs beside Python threads. The shared object is cached under
`$MEGATRAIN_CACHE/kernels` (default `~/.cache/megatrain`), keyed by the source, the compiler and its version and
the machine, and built once per key; a concurrent build by another process writes the same bytes and renames
over it atomically. Where there is no compiler (or the build fails) `build` returns None and the caller takes
its pure-torch path, which every kernel here has and is tested against for the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch

from ...files import env

log = logging.getLogger(__name__)
T = TypeVar("T")
SOURCES = Path(__file__).resolve().parent / "kernels"

PRELUDE = "#include <stdint.h>\n"
# -ffp-contract=off: a*b + c stays two roundings unless the source asks for fmaf (bit-exact formulas);
# -fno-math-errno: sqrtf needs no errno check, so loops over it vectorize (the values are the same).
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-math-errno"]


def arch_flags() -> list[list[str]]:
    """Vector ISA flags to try, best first, for the CPU torch itself dispatches to: where torch runs its AVX-512
    kernels the CPU has AVX-512 (measured on an AVX-512 EPYC: the AdamW loop took 0.66 ns/element against 0.92
    built for AVX2), where it runs its AVX2 ones AVX2 and FMA; elsewhere the compiler's baseline. Each set is in
    the cache key; a set the compiler refuses falls back to the next."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [[]]
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = ["-mavx2", "-mfma"]
    if capability.startswith("AVX512"):
        return [[*avx2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"], avx2, []]
    return [avx2, []] if capability != "DEFAULT" else [[]]


def cache_dir() -> Path:
    return env.cache_dir("kernels")


def compiler() -> str | None:
    """The C compiler to build with ($CC, else cc or gcc on PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(name: str, source: str, declare: Callable[[ctypes.CDLL], None], disable_env: str) -> ctypes.CDLL | None:
    """`source` (PRELUDE prepended) compiled and loaded, its functions typed by `declare`; None where there is
    no compiler, the build fails, or the environment variable `disable_env` is "torch"."""
    cc = compiler()
    if env.kernel_off(disable_env) or not cc:
        return None
    try:
        lib = ctypes.CDLL(str(_compile(name, PRELUDE + source, cc)))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("%s: no compiled kernel (%s); using torch ops", name, e)
        return None
    declare(lib)
    return lib


def _compile(name: str, source: str, cc: str) -> Path:
    """The cached shared object of `source`, built with the first of arch_flags() the compiler accepts."""
    cmd = shlex.split(cc)  # $CC may carry flags
    version = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=30).stdout
    *better, last = arch_flags()
    for arch in better:
        try:
            return _compile_with(name, source, cmd, version, [*FLAGS, *arch])
        except subprocess.CalledProcessError as e:
            log.info("%s: %s refused %s (%s); trying the next flags", name, cc, arch, e.stderr[-200:])
    return _compile_with(name, source, cmd, version, [*FLAGS, *last])


def _compile_with(name: str, source: str, cmd: list[str], version: str, flags: list[str]) -> Path:
    key = hashlib.sha256("\0".join([source, " ".join(cmd), version, platform.machine(), *flags]).encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, so = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            subprocess.run([*cmd, *flags, "-o", str(so), str(src), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(so, target)
    return target


def source(name: str, defines: dict[str, object] | None = None) -> str:
    """The C source of kernel `name` (kernels/<name>.c), with `defines` as #define lines before it."""
    head = "".join(f"#define {k} {v}\n" for k, v in (defines or {}).items())
    return head + (SOURCES / f"{name}.c").read_text()


class LazyKernel(Generic[T]):
    """Kernel `name`, built on first `get()` and kept for the process: `accept(lib)` turns the loaded library into
    what callers use (its self-check against torch's bits; None refuses it, and callers take the torch path).
    `state` is False until tried, then the kernel or None."""

    def __init__(self, name: str, declare: Callable[[ctypes.CDLL], None], disable_env: str,
                 accept: Callable[[ctypes.CDLL], T | None] = lambda lib: lib,
                 defines: dict[str, object] | None = None) -> None:
        self.name, self.declare, self.disable_env, self.accept, self.defines = name, declare, disable_env, accept, defines
        self._lock = threading.Lock()
        self.state: T | None | bool = False

    def get(self) -> T | None:
        if self.state is False:
            with self._lock:
                if self.state is False:
                    lib = build(self.name, source(self.name, self.defines), self.declare, self.disable_env)
                    self.state = None if lib is None else self.accept(lib)
        return self.state  # type: ignore[return-value]
