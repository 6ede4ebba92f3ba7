"""The doors users come in by, besides ``fusion.fuse``.

* ``mxfuse`` — the ``mxfuse`` command: one model (``cli``) or several (``batch``, a process per
  model); ``argtypes`` and ``batch_options`` (what both parsers share), ``progress`` (stages on
  stderr), ``about`` (``--version``, ``--list-rules``, what a report records of the run).
* ``backend`` — Gluon's ``hybridize(backend="fusion")``.
* ``serving`` — loading a fused model (``fusion.load_model``).
* ``html_report`` — the report with drawings of both graphs.

May import: every layer below it (``fusion.ir``, ``fusion.precision``, ``fusion.engine``,
``fusion.files``, ``fusion.check``, ``fusion.api``, ``fusion.onnx``, ``fusion.native``,
``fusion.version``) and ``patterns`` (the rule table of ``--list-rules``).
"""
