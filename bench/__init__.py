"""qcomm microbenchmarks: ``python -m bench {codec,collectives} --help``.

One module per benchmark (:mod:`bench.codec`, :mod:`bench.collectives`), shared timing,
run header and result files in :mod:`bench.common`, the shaped link and the rank
launcher in :mod:`bench.link`. Results go to ``bench/results/<machine>/`` (or ``--out``).
"""
