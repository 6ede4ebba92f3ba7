"""The rewriting engine: rules applied to a graph, each rewrite checked.

* ``rule`` — ``Rule``, the base of every rule; ``rewrite`` — ``Context`` (what rules may read),
  ``Builder`` (what they build with), ``run_rules`` (passes to a fixpoint).
* ``facts`` — shapes and dtypes from MXNet's inference, at the user's shapes and at probe shapes.
* ``selfcheck`` — each rewrite run against what it replaces; ``inputs`` — what each input means to
  the ops that read it (a length, a mask, an index) and values drawn in that domain.
* ``report`` — what fused and why the rest did not; ``workarounds`` — guards against MXNet 1.9.1's
  oneDNN miscomputations.

May import: ``fusion.ir``, ``fusion.precision``, ``fusion.native``, ``fusion.version``.
Never the rule library (``patterns/``), which imports this package.
"""
