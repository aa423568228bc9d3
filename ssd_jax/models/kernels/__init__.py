"""Hand-written CPU kernels called through the XLA FFI (issue 13, item 1).

``rows_matmul.cc``: ``y = x @ W^T`` for a few rows of ``x`` (float32, W stored (out, in) as the
checkpoint has it, in float32 or bfloat16: a draft whose weights are stored in bfloat16 streams
half the bytes, ``--draft-dtype``). XLA:CPU's dot reads such a product at 1.5-2.2x the cost of a
one-row matvec (``experiments/results/matmul_forms_cpu.md``); the kernel reads every weight once
and contracts it with all rows while it is in registers (``experiments/results/matmul_kernel_cpu.md``).

``attention.cc``: grouped-query attention of up to ``ATTENTION_MAX_T`` new tokens over the KV
cache (decode, verify, SSD tree steps), float32: every cached key / value read once for all the
query rows of its group, slots no query may see skipped (``experiments/results/attention_cpu.md``).

Built by the project itself: on first use the sources are compiled together with ``g++`` (``$CXX`` if
set) into ``~/.cache/ssd_jax/kernels/<hash>/`` (the hash covers the source, the compiler, the
flags, jax's version and the CPU), under a file lock, written to a temporary name and renamed
into place. ``make kernels`` builds it ahead of time. ``SSD_JAX_KERNEL_ISA`` picks the build
(:data:`ISAS`): ``native`` (default: ``-O3 -march=native``, else ``-O3``), ``avx2`` (``-march=haswell``:
AVX2 and FMA without AVX-512, which reproduces such a machine on an AVX-512 one) or ``portable``
(``-O3`` alone: SSE2 on x86-64, NEON on ARM). The sources read the instruction set from the
compiler's own macros and size their register blocking to it (``cpu.h``); a named build whose
flags did not enable its instruction set fails to compile, and :func:`isa` reports what the
loaded library targets. Set ``SSD_JAX_KERNELS=off`` to never build or call it. When it is off, the compiler is
missing or the build fails, :func:`available` is False (with one warning line) and callers
use the einsum. The call is wrapped in :func:`jax.lax.platform_dependent`, so a program
lowered for another backend contains the einsum, never the custom call.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
import numpy as np

from ssd_jax.compile import cpu_tag

ENV = "SSD_JAX_KERNELS"
#: which build to load (see ISAS)
ISA_ENV = "SSD_JAX_KERNEL_ISA"
#: extra compiler flags for every build (e.g. ``-DSSD_JAX_ROWS_R=2 -DSSD_JAX_ROWS_MB=5`` to try another
#: register blocking; part of the build key)
FLAGS_ENV = "SSD_JAX_KERNEL_FLAGS"
HERE = Path(__file__).parent
#: compiled together into one library; HEADERS are hashed into the build key too
SOURCES = (HERE / "rows_matmul.cc", HERE / "attention.cc")
HEADERS = (HERE / "cpu.h",)
SYMBOL = "SsdJaxRowsMatmul"
TARGET = "ssd_jax_rows_matmul"
#: the same kernel with W in bfloat16 (x and y float32)
SYMBOL_BF16 = "SsdJaxRowsMatmulBF16"
TARGET_BF16 = "ssd_jax_rows_matmul_bf16"
#: attention of a few query tokens over the KV cache (attention.cc)
SYMBOL_ATTENTION = "SsdJaxAttention"
TARGET_ATTENTION = "ssd_jax_attention"
#: the same over a paged cache (a pool of blocks and each row's block table)
SYMBOL_PAGED_ATTENTION = "SsdJaxPagedAttention"
TARGET_PAGED_ATTENTION = "ssd_jax_paged_attention"
#: the attention kernel serves 1 <= T <= ATTENTION_MAX_T new tokens per row (decode, verify, SSD
#: tree steps); longer blocks (prefill, training) keep the einsum
ATTENTION_MAX_T = 64
#: per build, the flag sets tried in order (the first that compiles wins); ``-DSSD_JAX_WANT_*`` makes
#: cpu.h refuse flags that did not enable the instruction set the build is named for
ISAS = {
    "native": (("-O3", "-march=native"), ("-O3",)),
    "avx2": (("-O3", "-march=haswell", "-mtune=generic", "-DSSD_JAX_WANT_AVX2"),),
    "portable": (("-O3",),),
}
BASE_FLAGS = ("-std=c++17", "-fPIC", "-shared", "-w")
#: the kernel is called for 1 <= rows <= MAX_ROWS (the verify bucket, ``forms.BUCKETS[1]``;
#: measured faster than XLA's dot up to 16 rows, experiments/results/matmul_kernel_cpu.md)
MAX_ROWS = 16


def enabled() -> bool:
    """False when ``SSD_JAX_KERNELS`` is off/0/false/no."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def isa_wanted() -> str:
    """The build ``SSD_JAX_KERNEL_ISA`` names (default ``native``); ValueError for an unknown one."""
    name = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={name!r}: want one of {', '.join(ISAS)}")
    return name


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ssd_jax" / "kernels"


@functools.cache  # once per process: build_id() is asked on every generate() with K auto
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _key(cxx: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in (*SOURCES, *HEADERS)),
        _compiler_version(cxx).encode(),
        " ".join(flags).encode(),
        jax.__version__.encode(),
        cpu_tag().encode(),  # -march=native depends on it; a shared home may hold several machines' builds
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, flags: tuple[str, ...], out: Path) -> str:
    """Compiles SOURCES to ``out`` (atomically); returns "" or the compiler's complaint."""
    cmd = [cxx, *flags, *BASE_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}", *map(str, SOURCES)]
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


def build(force: bool = False, isa: str | None = None) -> Path:
    """The compiled library's path for build ``isa`` (default :func:`isa_wanted`), building it if
    needed; raises RuntimeError on failure."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    isa = isa or isa_wanted()
    if isa not in ISAS:
        raise ValueError(f"unknown kernel build {isa!r}: want one of {', '.join(ISAS)}")
    errors = []
    extra = tuple(os.environ.get(FLAGS_ENV, "").split())
    for flags in ISAS[isa]:
        flags = (*flags, *extra)
        d = cache_root() / _key(cxx, flags)
        lib = d / "libssd_jax_kernels.so"
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


_LOADED: list[Path] = []  # the library available() loaded (its directory names the build)
_ISA: list[str] = []  # what it targets, as it says itself


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def library_isa(lib: ctypes.CDLL) -> str:
    """What a loaded build targets, e.g. ``"avx2 lanes=8 regs=16 rows=4x2"`` (its vector ISA, floats per
    register, registers planned for, and the matmul's block: weight rows x activation rows)."""
    fn = lib.ssd_jax_kernels_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _check_isa(name: str, said: str) -> None:
    """A native build on a CPU with AVX-512 (or AVX2) that targets less was built with flags that did
    not reach the compiler: refuse it rather than run a blocking planned for the wrong registers."""
    if name == "avx2" and not said.startswith("avx2"):
        raise RuntimeError(f"the avx2 build targets {said!r}")
    if name == "native":
        have = cpu_flags()
        want = "avx512" if "avx512f" in have else "avx2" if {"avx2", "fma"} <= have else None
        if want and not said.startswith(want):
            raise RuntimeError(f"the native build targets {said!r} on a CPU with {want}")


def _load(isa: str, suffix: str = "") -> tuple[Path, str]:
    """Build ``isa``, load it, check what it targets and register its FFI targets (named ``<target><suffix>``);
    (its path, what it says it targets)."""
    path = build(isa=isa)
    lib = ctypes.CDLL(str(path))
    said = library_isa(lib)
    _check_isa(isa, said)
    for target, symbol in (
        (TARGET, SYMBOL),
        (TARGET_BF16, SYMBOL_BF16),
        (TARGET_ATTENTION, SYMBOL_ATTENTION),
        (TARGET_PAGED_ATTENTION, SYMBOL_PAGED_ATTENTION),
    ):
        jax.ffi.register_ffi_target(target + suffix, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return path, said


@functools.cache
def available() -> bool:
    """Whether the kernel can be called here (enabled, built, loaded, registered with XLA:CPU)."""
    _LOADED.clear()
    _ISA.clear()
    if not enabled():
        return False
    try:
        name = isa_wanted()
        if name == "avx2" and cpu_flags() and not {"avx2", "fma"} <= cpu_flags():
            raise RuntimeError("this CPU has no AVX2 and FMA for the avx2 build")
        path, said = _load(name)
        _LOADED.append(path)
        _ISA.append(f"{name}: {said}")
        return True
    except Exception as e:  # any failure means: use the einsum
        warnings.warn(f"ssd_jax CPU kernels unavailable, using XLA's dot and einsums ({e})", stacklevel=2)
        return False


def runnable_isas() -> tuple[str, ...]:
    """The builds this machine can run: native and portable everywhere, avx2 where the CPU has AVX2 and
    FMA (on an AVX-512 machine it reproduces one without)."""
    have = cpu_flags()
    return ("native", *(("avx2",) if {"avx2", "fma"} <= have else ()), "portable")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build loaded beside the active one, its FFI targets registered under ``<target>_<isa>``, for
    the benchmark and the tests that compare builds in one process."""

    isa: str
    said: str  # what it targets (:func:`library_isa`)
    path: Path

    def rows_matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x @ w.T`` (x (M, K) float32, w (N, K) float32 or bfloat16) by this build's kernel."""
        target = (TARGET_BF16 if w.dtype == jnp.bfloat16 else TARGET) + "_" + self.isa
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)

    def attention(self, q, k, v, mask, scale: float) -> jax.Array:
        """:func:`attention` by this build's kernel (q (B, T, KVH, G, hd), k / v (Bc, Sc, KVH, hd))."""
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return jax.ffi.ffi_call(f"{TARGET_ATTENTION}_{self.isa}", out, vmap_method="sequential")(
            q, k, v, mask.astype(jnp.bool_), scale=np.float32(scale)
        )


@functools.cache
def variant(isa: str) -> Variant:
    """Build ``isa`` (see :data:`ISAS`), load it and register its targets under their ``_<isa>`` names;
    RuntimeError where it cannot build or run here."""
    if isa not in runnable_isas():
        raise RuntimeError(f"this CPU cannot run the {isa} build")
    path, said = _load(isa, suffix=f"_{isa}")
    return Variant(isa, said, path)


def build_id() -> str:
    """The loaded kernels' build key (a hash of their sources, compiler, flags, jax and CPU), or
    "off": measurements that depend on the kernels' speed (``--k auto``) are keyed by it."""
    return _LOADED[0].parent.name if available() and _LOADED else "off"


def isa() -> str:
    """The loaded build and what it targets, e.g. ``"avx2: avx2 lanes=8 regs=16 rows=4x2"``, or "off"."""
    return _ISA[0] if available() and _ISA else "off"


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
        x.dtype == jnp.float32
        and w.dtype in (jnp.float32, jnp.bfloat16)
        and w.ndim == 2
        and 1 <= rows <= MAX_ROWS
        and _one_device(x)
        and _one_device(w)
        and available()
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


def attention_usable(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether :func:`attention` runs the kernel: float32 queries and cache, 1..ATTENTION_MAX_T new
    tokens, everything on one device, the kernel available."""
    return (
        q.ndim == 5
        and 1 <= q.shape[1] <= ATTENTION_MAX_T
        and all(a.dtype == jnp.float32 for a in (q, k, v))
        and all(_one_device(a) for a in (q, k, v))
        and available()
    )


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention with XLA's einsums: q (B, T, KVH, G, hd), k / v (B, S, KVH, hd),
    mask (B, T, S) -> (B, T, KVH, G, hd) in v's dtype (a row that sees nothing gets the mean value)."""
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v)


def _sliced_reference(q, k, v, mask, *, scale):
    B, S = q.shape[0], mask.shape[-1]
    return attention_reference(q, k[:B, :S], v[:B, :S], mask, scale)


def _attention_ffi(q, k, v, mask, *, scale):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_ATTENTION, out, vmap_method="sequential")(
        q, k, v, mask, scale=np.float32(scale)
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, scale):
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        mask,
        cpu=functools.partial(_attention_ffi, scale=scale),
        default=functools.partial(_sliced_reference, scale=scale),
    )


@_attention.defjvp
def _attention_jvp(scale, primals, tangents):  # differentiate as the reference
    q, k, v, mask = primals
    dq, dk, dv, _ = tangents
    _, t = jax.jvp(lambda a, b, c: _sliced_reference(a, b, c, mask, scale=scale), (q, k, v), (dq, dk, dv))
    return _attention(q, k, v, mask, scale), t


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention of a few new tokens over the first ``B`` rows and ``S`` slots of a KV
    cache (q (B, T, KVH, G, hd), mask (B, T, S), k / v (Bc >= B, Sc >= S, KVH, hd)): the CPU kernel
    where :func:`attention_usable`, reading the cache buffers whole and in place, else the reference
    over the slice. A slice taken here in JAX would be fused by XLA with the step's cache write and
    cost a copy of every layer's whole cache (a batch bucket or an attention window)."""
    B, S = q.shape[0], mask.shape[-1]
    if not attention_usable(q, k, v):
        return attention_reference(q, k[:B, :S], v[:B, :S], mask, scale)
    return _attention(q, k, v, mask.astype(jnp.bool_), float(scale))


def paged_read(pool: jax.Array, pages: jax.Array, n_slots: int) -> jax.Array:
    """The first ``n_slots`` slots of each row of a paged cache (pool (N, bs, KVH, hd), block table
    pages (B, P)) as a contiguous ``(B, n_slots, KVH, hd)``: XLA's gather. An empty entry reads the last
    block, as any slot past a row's length reads something: the mask hides it."""
    bs = pool.shape[1]
    nb = -(-n_slots // bs)
    x = pool[jnp.minimum(pages[:, :nb], pool.shape[0] - 1)]  # (B, nb, bs, KVH, hd)
    return x.reshape(x.shape[0], nb * bs, *x.shape[3:])[:, :n_slots]


def _paged_reference(q, k, v, pages, mask, *, scale):
    S = mask.shape[-1]
    return attention_reference(q, paged_read(k, pages, S), paged_read(v, pages, S), mask, scale)


def _paged_ffi(q, k, v, pages, mask, *, scale):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_PAGED_ATTENTION, out, vmap_method="sequential")(
        q, k, v, pages, mask, scale=np.float32(scale)
    )


def paged_attention(q, k, v, pages, mask, scale: float) -> jax.Array:
    """:func:`attention` over a paged cache: k / v pools (N, bs, KVH, hd), ``pages`` (B, P) int32 each
    row's block table, mask (B, T, S). The CPU kernel reads each slot through the table in place (no
    gathered copy); elsewhere (another backend, a sharded pool, bfloat16) XLA gathers the blocks."""
    pages = pages.astype(jnp.int32)
    if not attention_usable(q, k, v):
        return _paged_reference(q, k, v, pages, mask, scale=scale)
    return jax.lax.platform_dependent(
        q, k, v, pages, mask.astype(jnp.bool_),
        cpu=functools.partial(_paged_ffi, scale=float(scale)),
        default=functools.partial(_paged_reference, scale=float(scale)),
    )  # fmt: skip
