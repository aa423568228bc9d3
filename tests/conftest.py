"""Shared fixtures: 8 fake CPU devices, tiny random Llama / Qwen2 checkpoints saved by transformers."""

import os


def _xla_knows(flag: str) -> bool:
    """Whether the installed XLA defines ``flag`` (it aborts on an unknown one), as ssd_jax.xla_env
    checks it: importing ssd_jax here would start JAX before XLA_FLAGS is set."""
    import mmap
    from pathlib import Path

    import jaxlib

    libs = sorted(Path(jaxlib.__file__).parent.glob("*.so"), key=lambda p: p.stat().st_size, reverse=True)
    for lib in libs[:2]:
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(flag.encode()) >= 0:
                return True
    return False


# Compiled for speed of compilation: XLA:CPU's LLVM code generation at its lowest level, and its older
# loop emitters for fusions instead of the MLIR fusion pipeline (which builds an MLIR context per fusion),
# and each program's LLVM module compiled whole on the compiling thread, not split over a thread pool (both
# cores are busy with a worker each: the split only adds work; compile time -12% on test_engine's paged
# tests, docs/testing.md).
# XLA's compile time of the suite's programs falls by about two thirds and the tiny test models hardly
# run slower. The computations are the same (fusion boundaries may differ); results agree with the
# default flags' to float rounding, not bit for bit, and every comparison in the suite is between
# programs compiled alike (subprocesses get the flags through SSD_JAX_TEST_XLA_FLAGS, tests/helpers.py).
# SSD_JAX_TEST_XLA_OPT=1 runs the suite with XLA's default flags, as users compile.
TEST_XLA_FLAGS = ""
if os.environ.get("SSD_JAX_TEST_XLA_OPT", "0") != "1":
    TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _xla_knows("xla_cpu_use_fusion_emitters"):
        TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
    if _xla_knows("xla_cpu_parallel_codegen_split_count"):
        TEST_XLA_FLAGS += " --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("SSD_JAX_TEST_XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}".strip())
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The shipped forms table, not the machine's measurement (ssd_jax.models.form_timing), for every model the
# suite loads: the measurement times products for seconds per model and is keyed by XLA_FLAGS and the cache
# folder, which differ between the suite's processes and tests, so it ran again and again (109 measurements
# in one run), and under the suite's compile-speed XLA flags it would measure nothing a user runs. Its
# choice and cache are tested with timing doubles (test_forms.py); the benchmarks measure it for real.
os.environ.setdefault("SSD_JAX_FORMS", "table")
# One persistent compilation cache for the test runs: both xdist workers and every subprocess the
# tests start (CLI, launcher, server, GPU-script smoke run) compile many of the same tiny programs, and
# an engine built again in the same process compiles its programs again (each has jits of its own):
# every program is cached, however small or quick to compile. The cache outlives the run (in the user
# cache, a folder per jax version, CPU and test XLA flags): a later run, in a fresh clone too, loads every
# program no change touched instead of compiling it, which is most of a run's work. The first run on a
# machine fills it; SSD_JAX_TEST_FRESH_CACHE=1 gives a run an empty cache of its own (as CI's fresh machine
# has). The oldest entries go when it passes TEST_CACHE_MAX_BYTES.
TEST_CACHE_MAX_BYTES = 1 << 30


def _test_cache_dir() -> str:
    import hashlib
    import platform
    import tempfile
    from importlib.metadata import version
    from pathlib import Path

    if os.environ.get("SSD_JAX_TEST_FRESH_CACHE", "0") == "1":
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
        return os.path.join(tempfile.gettempdir(), f"ssd_jax-test-jit-cache-{run}")
    try:
        cpu = sorted(
            {
                ln
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith(("model name", "flags", "Features"))
            }
        )
    except OSError:
        cpu = []
    ident = "\0".join([version("jax"), version("jaxlib"), platform.machine(), *cpu, os.environ["XLA_FLAGS"]])
    root = Path(os.environ.get("SSD_JAX_CACHE") or Path.home() / ".cache" / "ssd_jax").expanduser()
    return str(root / "jit-tests" / f"jax-{version('jax')}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}")


def _trim_test_cache(folder: str, limit: int = TEST_CACHE_MAX_BYTES) -> None:
    """Delete the oldest-written entries until the folder holds at most half of ``limit`` (once over it)."""
    from pathlib import Path

    files = [(f.stat().st_mtime, f.stat().st_size, f) for f in Path(folder).rglob("*") if f.is_file()]
    total = sum(size for _, size, _ in files)
    if total <= limit:
        return
    for _, size, f in sorted(files, key=lambda x: x[0]):
        if total <= limit // 2:
            break
        f.unlink(missing_ok=True)
        total -= size


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_test_cache_dir())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")  # -1: no minimum size

import pytest  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)


def _save_tiny(kind: str, path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed({"llama": 0, "llama3": 1, "qwen2": 2}[kind])
    if kind == "qwen2":
        hf = Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=1)
        model = Qwen2ForCausalLM(hf)
    else:
        extra = dict(tie_word_embeddings=True, eos_token_id=1)
        if kind == "llama3":
            extra["rope_parameters"] = dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        hf = LlamaConfig(**TINY, **extra)
        model = LlamaForCausalLM(hf)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # larger than the default init so logits are far from uniform
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", autouse=True)
def _programs_per_module():
    """Each module's compiled programs go when it ends (unless an engine still holds them): a worker runs
    many modules, and XLA:CPU maps every executable separately, so keeping them all took a worker past
    Linux's 65,530 mappings a process (ssd_jax.compile.ProgramCache)."""
    yield
    from ssd_jax.compile import programs

    programs().drop_unheld()


@pytest.fixture(scope="session", autouse=True)
def kauto_cache(tmp_path_factory):
    """k="auto" measurements of the session go to a temporary folder (subprocesses inherit it), never
    to the user's ~/.cache/ssd_jax/kauto; one calibration per (target, draft, batch) per session."""
    path = str(tmp_path_factory.mktemp("kauto"))
    old = os.environ.get("SSD_JAX_KAUTO_CACHE")
    os.environ["SSD_JAX_KAUTO_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("SSD_JAX_KAUTO_CACHE", None)
    else:
        os.environ["SSD_JAX_KAUTO_CACHE"] = old


@pytest.fixture(scope="session", params=["llama", "llama3", "qwen2"])
def tiny_hf(request, tmp_path_factory):
    """(kind, path, torch model) for a tiny random checkpoint of each supported family."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = _save_tiny(request.param, path)
    return request.param, str(path), model


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-main")
    _save_tiny("llama", path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_draft_path(tmp_path_factory, tiny_llama_path):
    """A different tiny Llama with the same vocabulary: a draft that partly disagrees with the target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(
        LlamaConfig(**{**TINY, "num_hidden_layers": 1}, tie_word_embeddings=True, eos_token_id=1)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("tiny-llama-draft")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


# --- tiny random target / draft pairs shared by the SD and SSD tests (built in numpy, no torch)


@pytest.fixture(scope="module")
def pair():
    from test_sd import tiny_model

    return tiny_model(0), tiny_model(1, layers=1)


@pytest.fixture(scope="module")
def ar_ref(pair):
    """Greedy AR token ids of the target of ``pair`` on test_sd.PROMPTS (20 tokens each)."""
    from test_sd import PROMPTS, _ids

    from ssd_jax import SamplingParams, generate

    return _ids(generate(pair[0], PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True)))


@pytest.fixture
def speculating(monkeypatch):
    """K auto speculates whatever its prediction, for the tests of a speculating run's plan: offline, a plan
    runs AR rounds where nothing is predicted to beat AR by more than the planner's error, and SSD on the
    tiny pair (a random draft, a round's fixed cost several decode steps) is priced far below AR."""
    import importlib

    configure = importlib.import_module("ssd_jax.planning.configure")
    monkeypatch.setattr(configure, "beats_ar", lambda speedup, margin=0.0: True)


@pytest.fixture(scope="module")
def small_pair():
    """Vocabulary-16 pair for the statistical tests: a peaky target and a flatter draft with the same
    weight directions, so they agree often but not always (acceptance well inside (0, 1))."""
    from test_sd import V_SMALL, tiny_model

    return tiny_model(3, vocab=V_SMALL, scale=0.3, layers=1), tiny_model(
        3, vocab=V_SMALL, scale=0.2, layers=1
    )


# Every test phase's seconds, appended as it ends (the controller's view under xdist), when
# SSD_JAX_TEST_DURATIONS names a file: a run that dies still leaves what it measured.
# `python tools/test_durations.py FILE` sums it per file (docs/testing.md's tables).
_DURATIONS = os.environ.get("SSD_JAX_TEST_DURATIONS")


# A fifth column: the seconds of that phase this process spent in XLA compilations (loads from the
# persistent cache included; a subprocess's own compilations are not seen).
_COMPILES = {"counter": None, "seen": 0.0}


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(os.environ["JAX_COMPILATION_CACHE_DIR"]):
        _trim_test_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if _DURATIONS:  # (after the XLA flags above are set)
        from ssd_jax.compile import XlaCompiles

        _COMPILES["counter"] = XlaCompiles().start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _COMPILES["counter"] is None:
        return
    now = _COMPILES["counter"].seconds
    outcome.get_result().user_properties.append(("xla_compile_s", now - _COMPILES["seen"]))
    _COMPILES["seen"] = now


def pytest_runtest_logreport(report):
    if _DURATIONS and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller's copy only
        compile_s = dict(report.user_properties).get("xla_compile_s", 0.0)
        with open(_DURATIONS, "a") as f:
            f.write(
                f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\t{compile_s:.3f}\n"
            )
