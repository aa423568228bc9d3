"""ssd_jax: fast, exact LLM decoding by speculation (AR, SD and SSD/Saguaro) in JAX.

from ssd_jax import load_model, generate, SamplingParams, SpecConfig
model = load_model("qwen2.5-coder-1.5b-instruct")
res = generate(model, ["def fib(n):"], SamplingParams(max_new_tokens=32))
print(res.outputs[0]["text"], res.metrics["tokens_per_s"])
"""

from ssd_jax import xla_env  # noqa: F401  (first: XLA_FLAGS must be set before a backend starts)
from ssd_jax.decoding.batch import GenerationResult
from ssd_jax.decoding.spec import SpecConfig
from ssd_jax.engine import generate
from ssd_jax.errors import UserError
from ssd_jax.sampling.filters import SamplingParams

__all__ = ["GenerationResult", "SamplingParams", "SpecConfig", "UserError", "generate", "load_model"]
__version__ = "0.1.0"


def default_dtype() -> str:
    """float32 on CPU (bf16 matmuls are several times slower there), bfloat16 on accelerators."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_model(name_or_path, dtype: str | None = None, **kw):
    """Load a registry name, .gguf file, Hugging Face directory, converted cache directory or trained
    draft (one trained with a trimmed head comes with that head)."""
    from ssd_jax.drafters.vocab import load_with_head

    return load_with_head(name_or_path, dtype=dtype or default_dtype(), **kw)
