"""``kvgate analyze``: what kvgate would save on a workload, before it is deployed.

:mod:`.workload` reads a Mooncake trace or a JSONL of chat requests; :mod:`.stats` measures
what repeats (block level, unbounded); :mod:`.predict` models N engines' LRU prefix caches
under each balancer; :mod:`.lint` finds stable content placed after variable content;
:mod:`.verdict` turns the figures into the seed's verdict; :mod:`.report` prints them (rich
table, JSON, PNG); :mod:`.cli` is the command. Docs: docs/analyze.md.
"""
