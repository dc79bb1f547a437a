"""Test-only stand-in (tests/sglang_cpu_support/README.md): NOT vLLM. Holds one torch function,
``_custom_ops.rotary_embedding``, that SGLang 0.5.23's CPU path imports."""
