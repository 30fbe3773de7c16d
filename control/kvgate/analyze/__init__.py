"""``kvgate analyze``: what kvgate would save on a workload, before it is deployed.

:mod:`.workload` reads a Mooncake trace, a JSONL of chat requests or the gateway's request
log (:mod:`.logexport`: ``kvgate log export`` and the live ``kvgate:log`` reader); :mod:`.stats` measures
what repeats (block level, unbounded); :mod:`.predict` models N engines' LRU prefix caches
under each balancer; :mod:`.lint` finds stable content placed after variable content;
:mod:`.verdict` turns the figures into the seed's verdict; :mod:`.savings` prices each lever
at the policy's prices; :mod:`.report` prints them (rich
table, JSON, PNG); :mod:`.cli` is the command. Docs: docs/analyze.md.
"""
