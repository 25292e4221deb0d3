"""The model's layers as this project runs them: ragged attention over the paged KV-cache
(``attention``, ``kv_cache``), GGUF-block Linears (``quantized``), the CPU's lean decoder layer
(``lean_decoder``), compiled layers (``compiled_layers``), the CPU kernels and their batch-invariant
settings (``cpu_kernels``), the Triton kernels of the deterministic mode on a GPU
(``invariant_kernels``: imported only where Triton is), and the model's shape (``shape``)."""
