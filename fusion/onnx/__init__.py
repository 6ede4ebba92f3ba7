"""ONNX in and out.

* ``importer`` — an ONNX file as the MXNet graph the rules match (``import_onnx``).
* ``export`` — a fused graph as ONNX, fused ops as ONNX Runtime's contrib ops or standard ops,
  checked in ONNX Runtime (``export_onnx``); ``passes`` — its clean-up passes over ``graph``, one
  view of an ONNX graph with small op-chain patterns.

Inside this package ``import onnx`` is the ``onnx`` distribution (absolute imports).

May import: ``fusion.ir``, ``fusion.precision``, ``fusion.engine``, ``fusion.check``, ``fusion.api``.
"""
