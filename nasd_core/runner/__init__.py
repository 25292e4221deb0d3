"""The model runner: a step's rows through the model in one forward (``model_runner``),
fixed-shape steps replayed from CUDA graphs (``step_graphs``), and the device memory planned at
start (``memory_plan``)."""
