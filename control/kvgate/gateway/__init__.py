"""The gateway's dynamic config from the Python side: the push client (:mod:`.dynamic`)."""
