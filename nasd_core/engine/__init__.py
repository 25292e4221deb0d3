"""The engine and its parts: a step is schedule (``scheduler``), draft (``speculator``), run (the
model runner, ``nasd_core.runner``) and commit (``engine``); ``sequence`` is one request's state,
``stopping`` its stop conditions, ``async_engine`` the engine on a thread of its own."""
