# kvgate — the README's two commands: `make demo` (the main job) and `make test` (the tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
KVGATE := $(VENV)/bin/kvgate
TRACE ?= ../shared/traces/mooncake_conversation_trace.jsonl
DEMO_POLICY ?= policies/demo.yaml
DEMO_SCALE ?= 1
DEMO_SPEEDUP ?= 10
REPLAY_REQUESTS ?= 2000

.PHONY: setup demo replay scaleout test screenshots test-unit test-integration up down status clean
.DEFAULT_GOAL := help

help:
	@echo "make setup  install Debian packages and the Python venv (idempotent)"
	@echo "make demo   start the demo stack and show the bill: one mixed workload, plain baseline against kvgate"
	@echo "make scaleout  the multi-turn workload on 1, 2 and 4 engines, round robin against kvgate (on the demo stack)"
	@echo "make replay the trace alone, once per balancer (round robin, chash, chash_bounded)"
	@echo "make test   run the test suite"
	@echo "make down   stop the demo stack"
	@echo "make screenshots  retake the admin page's screenshots in docs/images"

# scripts/setup installs the Debian packages (the list is there) and the venv; the Dockerfile
# runs the same script. It only checks when everything is in place.
setup:
	@PYTHON='$(PYTHON)' bash scripts/setup --venv '$(VENV)'

demo: setup
	@[ -f "$(TRACE)" ] || { echo "error: trace not found at $(TRACE) (set TRACE=...)" >&2; exit 2; }
	@start=$$(date +%s); \
	$(KVGATE) up $(DEMO_POLICY) && \
	$(KVGATE) bench bill --trace "$(TRACE)" --scale $(DEMO_SCALE) --speedup $(DEMO_SPEEDUP) \
	  --json demo-report.json --chart demo-bill.png && \
	echo && $(KVGATE) status && \
	echo "make demo took $$(( $$(date +%s) - start )) s after make setup; the stack keeps running (stop it with 'make down')" && \
	echo "admin page: http://$$($(VENV)/bin/python -c 'import sys; from kvgate.policy import load_policy; \
	  from kvgate.addr import connect_address; print(connect_address(load_policy(sys.argv[1]).control.listen))' \
	  '$(DEMO_POLICY)')/admin/  (sign in with the token '$(KVGATE) token' prints)"

# the scale-out experiment (issue 16): on the running demo stack (make demo or make up first)
scaleout: setup
	$(KVGATE) bench scaleout --json scaleout-report.json --plot scaleout.png

# the trace alone through each balancer (the demo before the bill)
replay: setup
	@[ -f "$(TRACE)" ] || { echo "error: trace not found at $(TRACE) (set TRACE=...)" >&2; exit 2; }
	$(KVGATE) up $(DEMO_POLICY) && \
	$(KVGATE) replay "$(TRACE)" --requests $(REPLAY_REQUESTS) --speedup $(DEMO_SPEEDUP) \
	  --policies round_robin,chash,chash_bounded --json replay-report.json

test: setup
	bash scripts/run-tests

# the admin page's screenshots in docs/images/ (the browser test takes them)
screenshots: setup
	KVGATE_SCREENSHOTS='$(CURDIR)/docs/images' bash scripts/run-tests tests/integration/test_admin_browser.py -k operator_flow

up: setup
	$(KVGATE) up $(DEMO_POLICY)

down:
	@[ -x $(KVGATE) ] && $(KVGATE) down || true

status:
	$(KVGATE) status

clean: down
	rm -rf .kvgate demo-report.json demo-bill.png scaleout-report.json scaleout.png replay-report.json .pytest_cache
