"""Hand-written CPU kernels called through the XLA FFI (issue 13, item 1).

One kernel today, ``rows_matmul.cc``: ``y = x @ W^T`` for a few rows of ``x`` (float32, W
stored (out, in) as the checkpoint has it, in float32 or bfloat16: a draft whose weights are
stored in bfloat16 streams half the bytes, ``--draft-dtype``). XLA:CPU's dot reads such a product at 1.5-2.2x
the cost of a one-row matvec (``experiments/results/matmul_forms_cpu.md``); the kernel reads
every weight once and contracts it with all rows while it is in registers
(``experiments/results/matmul_kernel_cpu.md``).

Built by the project itself: on first use the source is compiled with ``g++`` (``$CXX`` if
set; ``-O3 -march=native``, else ``-O3``) into ``~/.cache/ssd_jax/kernels/<hash>/`` (the hash
covers the source, the compiler, the flags, jax's version and the CPU), under a file lock,
written to a temporary name and renamed into place. ``make kernels`` builds it ahead of time.
Set ``SSD_JAX_KERNELS=off`` to never build or call it. When it is off, the compiler is
missing or the build fails, :func:`available` is False (with one warning line) and callers
use the einsum. The call is wrapped in :func:`jax.lax.platform_dependent`, so a program
lowered for another backend contains the einsum, never the custom call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

ENV = "SSD_JAX_KERNELS"
SOURCE = Path(__file__).with_name("rows_matmul.cc")
SYMBOL = "SsdJaxRowsMatmul"
TARGET = "ssd_jax_rows_matmul"
#: the same kernel with W in bfloat16 (x and y float32)
SYMBOL_BF16 = "SsdJaxRowsMatmulBF16"
TARGET_BF16 = "ssd_jax_rows_matmul_bf16"
#: flag sets tried in order (the first that compiles wins)
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
BASE_FLAGS = ("-std=c++17", "-fPIC", "-shared", "-w")
#: the kernel is called for 1 <= rows <= MAX_ROWS (the verify bucket, ``forms.BUCKETS[1]``;
#: measured faster than XLA's dot up to 16 rows, experiments/results/matmul_kernel_cpu.md)
MAX_ROWS = 16


def enabled() -> bool:
    """False when ``SSD_JAX_KERNELS`` is off/0/false/no."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ssd_jax" / "kernels"


def _cpu_tag() -> str:
    """The CPU's model and flags (``-march=native`` depends on them; a shared home may hold
    builds for several machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _key(cxx: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), _compiler_version(cxx).encode(), " ".join(flags).encode(),
                 jax.__version__.encode(), _cpu_tag().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, flags: tuple[str, ...], out: Path) -> str:
    """Compiles SOURCE to ``out`` (atomically); returns "" or the compiler's complaint."""
    cmd = [cxx, *flags, *BASE_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE)]
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode:
            said = (r.stderr or r.stdout or "").strip().splitlines()
            return said[-1] if said else f"exit status {r.returncode}"
        os.replace(tmp, out)
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(force: bool = False) -> Path:
    """The compiled library's path, building it if needed; raises RuntimeError on failure."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    errors = []
    for flags in FLAG_SETS:
        d = cache_root() / _key(cxx, flags)
        lib = d / "librows_matmul.so"
        if lib.exists() and not force:
            return lib
        d.mkdir(parents=True, exist_ok=True)
        with open(d / ".lock", "w") as lock:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
            except ImportError:
                pass
            if lib.exists() and not force:
                return lib
            err = _compile(cxx, flags, lib)
        if not err:
            return lib
        errors.append(f"{' '.join(flags)}: {err}")
    raise RuntimeError("; ".join(errors))


@functools.cache
def available() -> bool:
    """Whether the kernel can be called here (enabled, built, loaded, registered with XLA:CPU)."""
    if not enabled():
        return False
    try:
        lib = ctypes.CDLL(str(build()))
        for target, symbol in ((TARGET, SYMBOL), (TARGET_BF16, SYMBOL_BF16)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return True
    except Exception as e:  # any failure means: use the einsum
        warnings.warn(f"ssd_jax CPU matmul kernel unavailable, using XLA's dot ({e})", stacklevel=2)
        return False


def _one_device(a: jax.Array) -> bool:
    """Whether ``a`` (a value or a tracer) lives on at most one device, read from its type at
    trace time: GSPMD cannot split the custom call, so a sharded operand would be gathered."""
    try:
        mesh = jax.typeof(a).sharding.mesh
    except AttributeError:
        return False
    return mesh.size <= 1


def usable(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x @ w.T`` (x (..., K), w (N, K)) goes to the kernel: x float32, w float32 or
    bfloat16, 1..MAX_ROWS rows, both on one device, the kernel available."""
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return (
        x.dtype == jnp.float32 and w.dtype in (jnp.float32, jnp.bfloat16) and w.ndim == 2
        and 1 <= rows <= MAX_ROWS and _one_device(x) and _one_device(w) and available()
    )


def _ffi(x2: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    target = TARGET_BF16 if w.dtype == jnp.bfloat16 else TARGET
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, w)


def _einsum(x2: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("mi,oi->mo", x2, w, preferred_element_type=jnp.float32)


@jax.custom_jvp
def _rows(x2: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(x2, w, cpu=_ffi, default=_einsum)


@_rows.defjvp
def _rows_jvp(primals, tangents):  # differentiate as the einsum (linear in each argument)
    (x2, w), (dx, dw) = primals, tangents
    return _rows(x2, w), _einsum(dx, w) + _einsum(x2, dw)


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` through the kernel for x (..., K) float32 and w (N, K) float32 or bfloat16, in
    float32 (see :func:`usable`)."""
    lead = x.shape[:-1]
    y = _rows(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[0])
