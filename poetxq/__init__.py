"""poetxq: memory-efficient quantized LLM pretraining with POET-XQ."""

import logging

# bitsandbytes' CPU backend warns at import, on CPUs with AVX512-BF16, that it cannot load an
# optional 4-bit CPU GEMM from the `kernels` package. poetxq never calls that GEMM (its 4-bit
# layers run their own kernels or the torch reference), so the warning would only alarm users.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
