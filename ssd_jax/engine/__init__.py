"""The one engine behind ``generate()`` and the server: slots, admission by chunked prefill, one round
driver (:mod:`.core`), the methods' round programs and state (:mod:`.methods`), and ``generate()``
(:mod:`.generate`)."""

from ssd_jax.engine.generate import generate

__all__ = ["generate"]
