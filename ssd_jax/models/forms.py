"""Matmul forms: how each weight matrix is stored and in which order it is contracted.

The same product ``y = x W^T`` (W the checkpoint's (out, in) matrix) can be written several
ways, and on XLA:CPU their cost at a few rows differs by up to 2x: at M = 5 rows (a K = 4
verification) ``x @ W.T`` with W stored (out, in) costs 2.1-3.7x a one-row matvec on Qwen
shapes, while other forms cost 0.9-1.8x (docs/reference.md §9, ``tools/matmul_forms.py``).
A :class:`Form` fixes, per matrix role:

* ``layout``: ``"oi"`` stores (out, in) (checkpoint layout), ``"io"`` stores (in, out);
  applied once at load (the loader transposes the tensor before placing it: one copy);
* ``orders``: per row bucket (decode M = 1, verify M <= 16, prefill M > 16) whether the
  activations (``"right"``: ``x @ W``) or the weight (``"left"``: ``(W @ x^T)^T``) come
  first in the dot, or (``"kernel"``, layout ``oi`` only) whether the project's own CPU kernel
  (``ssd_jax.models.kernels``, through the XLA FFI) computes it. The bucket is known at trace
  time (static shapes), so each compiled program has one dot per matrix. The kernel is used
  only where it can run (float32, at most ``kernels.MAX_ROWS`` rows, built and not disabled by
  ``SSD_JAX_KERNELS=off``, arrays on one device); anywhere else "kernel" means ``"right"``.

The default :class:`Forms` (everything ``oi``/``right``) is today's ``x @ W.T`` and is what
accelerators use; on CPU the loader picks forms from the table measured by
``tools/matmul_forms.py`` (``forms_cpu.json`` beside this file).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

LAYOUTS = ("oi", "io")
ORDERS = ("right", "left", "kernel")
#: upper bounds (inclusive) on the row count of the first two buckets: decode, verify; the rest is prefill
BUCKETS = (1, 16)
#: matrix roles; q/k/v/o/gate/up/down per layer, head = the output head (the embedding when tied)
ROLES = ("q", "k", "v", "o", "gate", "up", "down", "head")
#: roles of the measured table (tools/matmul_forms.py) -> the roles they decide
TABLE_ROLES = {
    "q/o": ("q", "o"),
    "k/v": ("k", "v"),
    "gate/up": ("gate", "up"),
    "down": ("down",),
    "lm_head": ("head",),
}
TABLE_FILE = Path(__file__).with_name("forms_cpu.json")


@dataclasses.dataclass(frozen=True)
class Form:
    """Storage layout of one matrix and the contraction order for each row bucket."""

    layout: str = "oi"
    orders: tuple[str, str, str] = ("right", "right", "right")

    def __post_init__(self):
        if self.layout not in LAYOUTS or len(self.orders) != 3 or any(o not in ORDERS for o in self.orders):
            raise ValueError(f"bad matmul form {self}")
        if self.layout != "oi" and "kernel" in self.orders:
            raise ValueError(f"the CPU kernel reads W stored (out, in): {self}")

    def order(self, rows: int) -> str:
        return self.orders[0 if rows <= BUCKETS[0] else 1 if rows <= BUCKETS[1] else 2]


@dataclasses.dataclass(frozen=True)
class Forms:
    """One :class:`Form` per matrix role (hashable: part of the static ModelConfig)."""

    q: Form = Form()
    k: Form = Form()
    v: Form = Form()
    o: Form = Form()
    gate: Form = Form()
    up: Form = Form()
    down: Form = Form()
    head: Form = Form()

    @property
    def canonical(self) -> bool:
        return self == Forms()

    def to_dict(self) -> dict[str, Any]:
        return {
            r: {"layout": getattr(self, r).layout, "orders": list(getattr(self, r).orders)} for r in ROLES
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Forms:
        if not d:
            return cls()
        return cls(**{r: Form(v["layout"], tuple(v["orders"])) for r, v in d.items() if r in ROLES})


CANONICAL = Forms()
CHECKPOINT_FORM = Form()


def contract(
    x: jnp.ndarray, w: jnp.ndarray, layout: str, order: str, preferred_element_type=None
) -> jnp.ndarray:
    """``x @ W^T`` for ``x`` (..., I) and W stored per ``layout`` (2-D), in the given order."""
    ws = "oi" if layout == "oi" else "io"
    narrow = w.dtype != x.dtype  # weights stored narrower than the activations (ModelConfig.weight_dtype)
    if order == "kernel" or narrow:
        from ssd_jax.models import kernels

        # XLA:CPU's dot of float32 rows with bfloat16 weights is 4.5-20x slower than the float32
        # one (experiments/results/draft_bf16_cpu.md): such weights go to the kernel at any order
        if preferred_element_type in (None, jnp.float32) and layout == "oi" and kernels.usable(x, w):
            return kernels.rows_matmul(x, w)
        order = "right" if order == "kernel" else order
    if narrow:  # no kernel here (prefill rows, another backend, a sharded operand): widen, then the dot
        w = w.astype(x.dtype)
    if order == "right":
        return jnp.einsum(f"...i,{ws}->...o", x, w, preferred_element_type=preferred_element_type)
    lead = x.shape[:-1]
    y = jnp.einsum(
        f"{ws},mi->om", w, x.reshape(-1, x.shape[-1]), preferred_element_type=preferred_element_type
    )
    return y.T.reshape(*lead, y.shape[0])


def apply(x: jnp.ndarray, w: jnp.ndarray, form: Form, preferred_element_type=None) -> jnp.ndarray:
    """``x @ W^T`` for a 2-D weight stored as ``form`` says, in the order of ``x``'s row bucket."""
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return contract(x, w, form.layout, form.order(rows), preferred_element_type)


# --- choosing forms per backend -------------------------------------------------------------
def _nearest(entries: list[dict[str, Any]], shape: tuple[int, int]) -> dict[str, Any]:
    size = shape[0] * shape[1]
    return min(entries, key=lambda e: abs(e["shape"][0] * e["shape"][1] - size) / size)


def from_table(table: dict[str, list[dict[str, Any]]], shapes: dict[str, tuple[int, int]]) -> Forms:
    """Forms for a model from a measured table: per table role, the entry of the nearest-sized shape.

    ``table``: table role -> entries ``{"shape": [out, in], "layout", "orders": {"1", "5", "64"}}``;
    ``shapes``: table role -> this model's (out, in).
    """
    picked = {}
    for trole, roles in TABLE_ROLES.items():
        entries = table.get(trole)
        if not entries:
            continue
        e = _nearest(entries, shapes[trole])
        form = Form(e["layout"], (e["orders"]["1"], e["orders"]["5"], e["orders"]["64"]))
        picked.update({r: form for r in roles})
    return Forms(**picked)


def load_table(path: Path = TABLE_FILE) -> dict[str, list[dict[str, Any]]]:
    try:
        return json.loads(path.read_text())["table"]
    except (OSError, ValueError, KeyError):
        return {}


def table_shapes(cfg) -> dict[str, tuple[int, int]]:
    """A ModelConfig's matrix shapes (out, in) under the table's role names."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    return {
        "q/o": (cfg.num_heads * cfg.head_dim, D),
        "k/v": (cfg.num_kv_heads * cfg.head_dim, D),
        "gate/up": (F, D),
        "down": (D, F),
        "lm_head": (V, D),
    }


def for_backend(cfg, backend: str) -> Forms:
    """The forms to use on ``backend``: the shipped CPU table on "cpu" (the loader refines it by this
    machine's own measurement: ``ssd_jax.models.form_timing.resolve``), the canonical forms elsewhere."""
    if backend != "cpu":
        return CANONICAL
    return from_table(load_table(), table_shapes(cfg))


def resolve(cfg, forms: str | Forms | None = None) -> Forms:
    """``forms``: a :class:`Forms`, "canonical", "auto" (per backend, default), "table" (the same here; the
    loader measures "auto" on CPU, not "table": ``form_timing.resolve``) or None (the ``SSD_JAX_FORMS``
    environment variable, else "auto")."""
    if isinstance(forms, Forms):
        return forms
    forms = forms or os.environ.get("SSD_JAX_FORMS") or "auto"
    if forms == "canonical":
        return CANONICAL
    if forms not in ("auto", "table"):
        raise ValueError(f"matmul forms must be 'auto', 'table' or 'canonical', not {forms!r}")
    import jax

    return for_backend(cfg, jax.default_backend())
