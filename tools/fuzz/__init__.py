"""The project's grammar fuzzer: random MXNet graphs in every form the rules claim to match
(and near-variants they must refuse), checked against the project's first promise — a
rewrite never changes what a model computes.

* ``families/`` — the grammar, one module per rule family (productions in each docstring);
* ``draw.py`` — decisions recorded as a choice sequence (replay, shrinking);
* ``case.py``, ``generator.py`` — a case: graph, parameters, inputs at two shapes, flags;
* ``oracle.py`` — the checks (inference, second shape, unfuse, idempotence, training,
  MXNet's default bind) and their tolerances;
* ``shrink.py`` — delta debugging over the choice sequence;
* ``repro.py`` — standalone reproducer scripts;
* ``runner.py`` — worker processes (crash/timeout-safe), aggregation, the summary table.

Entry points: ``tools/fuzz_graphs.py`` (long runs) and ``tests/test_fuzz.py`` (CI-sized).
"""
