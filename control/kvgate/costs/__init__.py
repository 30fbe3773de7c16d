"""Usage rollups and cost reports (issue 13): the control plane's consumer of the request log
(:mod:`.rollup`), the online round-robin baseline of the affinity saving (:mod:`.baseline`) and
the report of ``GET /api/v1/costs`` and ``kvgate costs`` (:mod:`.report`). docs/costs.md."""
