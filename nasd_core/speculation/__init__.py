"""Speculation: the draft sources (``ngram``, ``suffix``, layered by ``drafter``), how far to
draft (``policy`` for packed steps, ``graph_plan`` for fixed shapes, ``calibration`` for the
measured step costs they price with) and lossless verification (``verify``)."""
