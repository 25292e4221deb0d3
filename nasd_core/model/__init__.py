"""The model side: the runner (``model_runner``) that feeds a step's rows through the model in one
forward, the paged KV-cache (``kv_cache``), ragged attention over it (``attention``, with the C++
CPU kernels of ``cpu_kernels`` / ``native``) and fixed-shape steps replayed from CUDA graphs
(``step_graphs``)."""
