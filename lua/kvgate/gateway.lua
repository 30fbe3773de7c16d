-- Compatibility shim: the phase entry points moved to kvgate.phase (issue 10). A config
-- rendered before that (or a hand-written one) that still calls require("kvgate.gateway")
-- keeps working; new configs call kvgate.phase.
return require "kvgate.phase"
