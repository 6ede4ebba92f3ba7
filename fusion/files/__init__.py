"""A model's files: reading and checking them, and writing outputs all at once or not at all.

* ``modelio`` — symbol and params files read with one-line errors, parameters checked against
  the graph (names, shapes, dtypes, finite values), ``--shape`` parsed, output paths.
* ``publish`` — every output file of a run written beside its target and renamed into place
  together, with signals held and other runs locked out.

May import: ``fusion.ir``, ``fusion.precision``.
"""
