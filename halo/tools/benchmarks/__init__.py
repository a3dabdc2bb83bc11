"""The benchmarks ``halo bench`` runs, shipped with the package so that the command works from an installed wheel.

One module per ``--only`` name (:data:`halo.tools.bench.BENCHMARKS`); each has ``run(opts)`` (what ``halo bench``
calls) and ``main(argv)`` (its script form: ``benchmarks/<name>.py`` in the repository runs it). The repository's
other benchmarks (GPU check, long run, attention, modes) stay in ``benchmarks/``: they need the repository's tests
or a GPU and are not part of ``halo bench``.
"""
