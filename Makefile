# megatron-mecefo: the two README commands (make demo, make test) and friends.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCHRUN := $(VENV)/bin/torchrun
DATA := data/stdlib_text_document
TFT := .venv-tft
NPROC ?= 8
export OMP_NUM_THREADS := 1
export PYTHONUNBUFFERED := 1

.PHONY: venv data demo demo-simulated demo-snapshot demo-abft test test-unit test-integration test-all test-slow test-errors test-slurm test-goodput test-control-campaign etcd bench bench-convergence bench-goodput bench-long lint clean

# torch 2.13.0 first and pinned, from TORCH_INDEX: PyTorch's CPU index by default, because a
# plain `pip install torch==2.13.0` on Linux pulls the CUDA build from PyPI (its CUDA libraries
# are gigabytes). TORCH_INDEX= (empty) uses pip's own configured index instead; a CUDA index
# (e.g. https://download.pytorch.org/whl/cu130) gives a GPU build. A venv that has torch
# 2.13.0 already keeps it (a change to setup.py reinstalls the package only). Then the
# package, constrained to that torch.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# --index-url TORCH_INDEX when it answers; on a machine that cannot reach it (an offline mirror,
# wheels in a find-links folder) pip's own configuration, said in one line, rather than a retry
# per package against an unreachable host.
TORCH_INDEX_ARG = [ -n "$(TORCH_INDEX)" ] && { $(PY) -c "import urllib.request as u; \
	u.urlopen('$(TORCH_INDEX)/', timeout=10)" 2> /dev/null && echo --index-url $(TORCH_INDEX) \
	|| echo "make venv: $(TORCH_INDEX) does not answer: torch from pip's configured index" >&2; }
$(VENV)/.installed: setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" \
	    2> /dev/null || $(PIP) install -q torch==2.13.0 $$($(TORCH_INDEX_ARG))
	$(PIP) install -q -c constraints.txt -e .[test]
	touch $@

venv: $(VENV)/.installed

$(DATA).bin: $(VENV)/.installed
	$(PY) examples/pretrain_gpt/prepare_data.py --output-prefix $(DATA)

data: $(DATA).bin

# PP2 x DP4 on 8 CPU ranks over gloo, under the recovery supervisor: rank 3 is SIGKILLed in
# its backward at iteration 40 and stays down (its replica is taken over, its live sibling
# waits as a spare); rank 5 is SIGKILLed at the gradient sync of iteration 80 and replaced 5 s
# later by a warm standby, which rejoins and is healed from a peer. The summary ends with the
# recovery timeline. NPROC: an even number >= 6 (ranks 3 and 5 sit in different replicas);
# the global batch is 2 micro-batches x 2 x DP. The simulated-failure demo is
# `make demo-simulated`.
DEMO_DP = $(shell expr $(NPROC) / 2)
# The model, data and schedule both demos train (PP2 x DP=NPROC/2).
DEMO_RUN = --pipeline-model-parallel-size 2 --data-path $(DATA) --split 98,2,0 \
	--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
	--micro-batch-size 2 --global-batch-size $(shell expr 4 \* $(DEMO_DP)) \
	--train-iters 150 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 \
	--log-interval 10 --eval-interval 50 --eval-iters 4 \
	--check-weight-hash-across-dp-replicas-interval 50
demo: data
	@if [ $$(( $(NPROC) % 2 )) -ne 0 ] || [ $(NPROC) -lt 6 ]; then \
	    echo "make demo: NPROC=$(NPROC): use an even number >= 6 (PP2 x DP>=3; ranks 3 and 5 are killed)"; exit 2; fi
	$(PY) -m megatron_mecefo.recovery.supervisor --nproc-per-node=$(NPROC) \
	    --replace after:5 --replace-ranks 5 --standby 1 --records results/demo/recovery.jsonl \
	    -- examples/pretrain_gpt/pretrain_gpt.py \
	    $(DEMO_RUN) \
	    --mecefo --mecefo-rank 32 \
	    --mecefo-kill 3:40:backward --mecefo-kill 5:80:grad-sync \
	    --metrics-file results/demo/metrics.jsonl

# The distributed-optimizer takeover (README "Snapshots"): the demo's model and layout with
# --use-distributed-optimizer, a snapshot after every step with XOR parity across each
# data-parallel group (m = 1); rank 3 is SIGKILLed in its backward at iteration 40. The
# survivors roll back to the newest snapshot with parity, rebuild the dead replica's optimizer
# shards from their peers and parity, re-shard the optimizer over DP-1 replicas and go on
# with the takeover plan; the summary names the recovery path (peers+parity).
demo-snapshot: data
	@if [ $$(( $(NPROC) % 2 )) -ne 0 ] || [ $(NPROC) -lt 6 ]; then \
	    echo "make demo-snapshot: NPROC=$(NPROC): use an even number >= 6 (PP2 x DP>=3)"; exit 2; fi
	$(PY) -m megatron_mecefo.recovery.supervisor --nproc-per-node=$(NPROC) \
	    --records results/demo-snapshot/recovery.jsonl \
	    -- examples/pretrain_gpt/pretrain_gpt.py \
	    $(DEMO_RUN) \
	    --mecefo --mecefo-rank 32 --use-distributed-optimizer \
	    --mecefo-snapshot-interval 1 --mecefo-snapshot-redundancy 1 \
	    --mecefo-kill 3:40:backward \
	    --metrics-file results/demo-snapshot/metrics.jsonl

# PP2 x DP4 on 8 CPU ranks over gloo, training through three simulated replica failures
# (MeCeFO's neighbor policy; iterations 50-59 have two replicas down at once). The failures
# follow NPROC (an even number >= 4; DP = NPROC/2): replica 1 always, replica 2 from DP3,
# replica 3 from DP4; the global batch is 2 micro-batches x 2 x DP.
DEMO_FAILS = --mecefo-fail 1:30:70 $(if $(filter-out 2,$(DEMO_DP)),--mecefo-fail 2:100:120) \
	$(if $(filter-out 2 3,$(DEMO_DP)),--mecefo-fail 3:50:60)
demo-simulated: data
	@if [ $$(( $(NPROC) % 2 )) -ne 0 ] || [ $(NPROC) -lt 4 ]; then \
	    echo "make demo-simulated: NPROC=$(NPROC): use an even number >= 4 (PP2 x DP>=2)"; exit 2; fi
	$(TORCHRUN) --nproc_per_node=$(NPROC) --master_port=29533 examples/pretrain_gpt/pretrain_gpt.py \
	    $(DEMO_RUN) \
	    --mecefo --mecefo-rank 32 --mecefo-grad-error-interval 10 \
	    $(DEMO_FAILS) \
	    --metrics-file results/demo/metrics.jsonl

# Attention checksums (README "Attention checksums"): TP2 + SP on 2 ranks, 100 iterations with
# a fault every 10, run clean, with --mecefo-abft and without it; prints the counts and losses.
demo-abft: data
	$(PY) examples/pretrain_gpt/abft_demo.py

# tests/unit: one process, seconds each; tests/integration: real processes (torchrun, the
# recovery supervisor, spawned ranks, subprocesses). make test runs both, without the slow ones.
test: venv
	$(PY) -m pytest -q -m "not slow" --timeout=900 --durations=15 tests

# The fast loop: the unit tests only (about a minute).
test-unit: venv
	$(PY) -m pytest -q -m "not slow" tests/unit

test-integration: venv
	$(PY) -m pytest -q -m "not slow" --timeout=900 --durations=15 tests/integration

# docs/errors.md: one row per user mistake, each ending in one line (the start-up rows are in
# make test; this runs the slow ones too: training, signals, about 3 minutes more).
test-errors: venv
	$(PY) -m pytest -q --timeout=1800 tests/unit/examples/test_user_errors_table.py \
	    tests/integration/examples/test_user_errors.py

test-all: venv
	$(PY) -m pytest -q --timeout=1800 tests

# The tests marked slow, without the goodput benchmark's (make test-goodput): the second of
# each pair of integration twins (make test keeps one of each kind), the Megatron-LM real-death
# runs, the per-phase and multi-failure real-death tests, the multi-process user-error rows.
# Over an hour on 2 cores, so not in .ci/run (45 minutes); make test-all runs these and the rest.
test-slow: venv
	$(PY) -m pytest -q -m slow --timeout=1800 --durations=15 --ignore=tests/integration/benchmarks tests

# The randomized control-plane campaign on real processes (docs/real-failures.md): four
# supervisors (PP2 x DP2, vote groups of 2) in network namespaces, a 3-member etcd, one seeded
# fault per run (SIGKILL, SIGSTOP, a cut link; held or released; any node, group heads and the
# leader included); MECEFO_CAMPAIGN_RUNS runs (default 24, about 30 minutes on 2 cores; needs
# root for ip netns, and make etcd). Writes results/control_campaign.json; make test runs two.
test-control-campaign: venv etcd
	$(PY) -m pytest -q -s -m slow --timeout=7200 \
	    tests/integration/recovery/test_control_campaign.py::test_campaign

# The Slurm scripts (examples/slurm/) under a real slurmctld + slurmd on this host (README
# "Running on a cluster"): installs slurm-wlm, munge and shellcheck with apt when missing
# (root), a node lost and brought back during the example trainer's run, the Megatron-LM
# script fully only with MEGATRON_LM_DIR set. Every daemon is stopped on exit.
test-slurm: venv
	tests/integration/slurm/run_slurm_test.sh

# etcd (Debian's etcd-server and etcdctl) for the etcd control plane's tests and
# benchmarks/etcd_client.py (scripts/etcd_cluster.sh starts a private 3-member cluster): installs
# them with apt when `etcd` is missing (needs root, as test-slurm's packages).
etcd:
	@if command -v etcd > /dev/null; then etcd --version | head -1; \
	elif [ "$$(id -u)" -eq 0 ] && command -v apt-get > /dev/null; then \
	    echo "make etcd: installing etcd-server etcd-client with apt-get"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        etcd-server etcd-client > /dev/null && etcd --version | head -1; \
	else echo "make etcd: no etcd, and installing it needs root and apt-get" \
	    "(Debian/Ubuntu: apt-get install etcd-server etcd-client)" >&2; exit 1; fi

# The goodput benchmark's --quick mode end to end (CI runs it): checkpoint-restart, torchft from
# .venv-tft and MeCeFO auto on a schedule of real kills, under the device clock; and the device
# clock's check (failure-free step time at 4 and at 3 ranks within 2%, the phases fit).
test-goodput: venv data $(TFT)/.installed
	$(PY) -m pytest -q -m slow --timeout=900 tests/integration/benchmarks/test_device_clock_agreement.py \
	    tests/integration/benchmarks/test_goodput_quick.py

# The CPU evidence suite (README "Results"), about 90 minutes on 2 cores (about 60 of them the goodput comparison; the n = 32 study is make bench-convergence): costs, ABFT overhead, degraded
# throughput (model + real DP4 runs), failure traces, the planner's profile and the cluster
# simulator, convergence runs, plots. JSON, logs and
# PNGs go to results/. Not run here: the GPU shapes (llama-1b / llama-7b), see benchmarks/README.
BENCH_LOG := results/logs
# The high scenario at the paper's 32 replicas, simulated in one process per run
# (--mecefo-virtual-replicas), every fixed policy and auto. Global batch 32 at micro-batch
# size 1 (one failure is 1/32 of the batch, as in the paper). The recipe (issue 31): peak LR
# 1e-3 after an 80-iteration warm-up, Adam beta2 0.95, clipping at 1, so that failure-free
# runs do not stall or spike at peak LR (3e-3 after 10 did, seed by seed).
# Hidden size 96 and sequence length 64 (the trainer's defaults: 128 and 128) and the gradient
# error on every 10th degraded iteration: what fit the time on the shared 2-core machine.
CONVERGENCE_N32_COMMON = --virtual-replicas 32 --micro-batch-size 1 --hidden-size 96 \
	--train-iters 400 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 80 --adam-beta2 0.95 \
	--clip-grad 1.0 --eval-interval 25 --grad-error-interval 10
CONVERGENCE_N32_RECIPE = $(CONVERGENCE_N32_COMMON) --global-batch-size 32 --seq-length 64
# The study (make bench-convergence): 5 seeds x (failure-free + 5 policies) x 400 iterations,
# 2 runs at once; one run took 167 s on the quiet machine and up to 876 s under load.
CONVERGENCE_N32_STUDY = --scenarios high --policies neighbor spread exact drop auto \
	--seeds 1234 1235 1236 1237 1238 --jobs 2
CONVERGENCE_N32 = $(CONVERGENCE_N32_RECIPE) $(CONVERGENCE_N32_STUDY) --master-port 29571 \
	--output-dir results/convergence_n32
# The same study with 2 micro-batches per replica (global batch 64, sequence length 32: the
# same tokens per step as the first): the regime of a real job, whose global batch is several
# micro-batches per replica. There spread's busiest replica runs its own micro-batches plus one
# absorbed, so spread is the fastest lossless policy as well as within the budget. Its planner
# uses the first configuration's gradient-error calibration (the probes are not rerun).
CONVERGENCE_N32_M2 = $(CONVERGENCE_N32_COMMON) --global-batch-size 64 --seq-length 32 \
	$(CONVERGENCE_N32_STUDY) --order priority --master-port 29621 \
	--output-dir results/convergence_n32_m2
# make bench's short version (not timed here): the same recipe, 2 seeds, 60 iterations,
# neighbor / spread / auto only; not a result (too short to resolve a gap), a check that the
# study runs. Written to results/convergence_n32_quick/ (not committed).
CONVERGENCE_N32_QUICK = $(CONVERGENCE_N32_RECIPE) --quick --scenarios high \
	--policies neighbor spread auto --jobs 2 --master-port 29571 \
	--output-dir results/convergence_n32_quick
bench: data
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install -q -c constraints.txt -e .[plot]
	mkdir -p $(BENCH_LOG)
	set -o pipefail; $(PY) benchmarks/takeover_cost.py --shape demo --output results/takeover_cost.json | tee $(BENCH_LOG)/takeover_cost.txt
	set -o pipefail; $(PY) benchmarks/takeover_cost.py --shape cpu-small --output results/takeover_cost_cpu-small.json | tee $(BENCH_LOG)/takeover_cost_cpu-small.txt
	set -o pipefail; $(PY) benchmarks/degraded_throughput.py | tee $(BENCH_LOG)/degraded_throughput.txt
	set -o pipefail; $(PY) benchmarks/failure_trace.py | tee $(BENCH_LOG)/failure_trace.txt
	$(PY) -m megatron_mecefo.planner.calibration --takeover-cost results/takeover_cost.json --output results/planner_profile.json > $(BENCH_LOG)/planner_profile.txt
	@# The profile --mecefo-policy auto reads when none is given: shipped with the package
	cp results/planner_profile.json megatron_mecefo/planner/default_profile.json
	set -o pipefail; $(PY) benchmarks/planner_accuracy.py | tee $(BENCH_LOG)/planner_accuracy.txt
	set -o pipefail; $(PY) benchmarks/cluster_sim.py | tee $(BENCH_LOG)/cluster_sim.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence.py | tee $(BENCH_LOG)/convergence.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence.py $(CONVERGENCE_N32_QUICK) | tee $(BENCH_LOG)/convergence_n32_quick.txt
	set -o pipefail; $(PY) benchmarks/abft_overhead.py | tee $(BENCH_LOG)/abft_overhead.txt
	set -o pipefail; $(PY) benchmarks/goodput.py | tee $(BENCH_LOG)/goodput.txt
	$(PY) benchmarks/goodput_at_scale.py > $(BENCH_LOG)/goodput_at_scale.txt
	$(PY) benchmarks/plots.py
	@echo "make bench: done; summaries in $(BENCH_LOG)/, plots in results/plots/." \
	    "Not run on CPU: the llama-1b / llama-7b GPU shapes (benchmarks/README.md)."

# The n = 32 convergence study (issue 31; not in make bench; see CONVERGENCE_N32 for the run
# times): CONVERGENCE_N32, then the probes (7 runs: neighbor and spread at r = 16, 32, 64; drop)
# that calibrate the planner's gradient-error model, then the report: results/convergence_n32/
# (convergence.json, grad_error_calibration.json, gaps.json, gaps.md) and
# results/plots/convergence_n32*.png. Then the same study with 2 micro-batches per replica
# (CONVERGENCE_N32_M2) and its report: results/convergence_n32_m2/, convergence_n32_m2*.png.
# A rerun keeps finished runs (--reuse) and, on a fresh clone, the runs and probes recorded in the
# committed convergence.json and grad_error_calibration.json (same recipe); make clean removes
# the run directories.
bench-convergence: data
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install -q -c constraints.txt -e .[plot]
	mkdir -p $(BENCH_LOG)
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence.py $(CONVERGENCE_N32) --reuse | tee $(BENCH_LOG)/convergence_n32.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/grad_error_calibration.py $(CONVERGENCE_N32_RECIPE) --master-port 29581 | tee $(BENCH_LOG)/grad_error_calibration.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence_report.py | tee $(BENCH_LOG)/convergence_n32_report.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence.py $(CONVERGENCE_N32_M2) --reuse | tee $(BENCH_LOG)/convergence_n32_m2.txt
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence_report.py --dir results/convergence_n32_m2 \
	    --calibration results/convergence_n32/grad_error_calibration.json --before '' \
	    --plot results/plots/convergence_n32_m2.png | tee $(BENCH_LOG)/convergence_n32_m2_report.txt

# The goodput comparison alone (benchmarks/goodput.py, about 60 minutes here; GOODPUT_ARGS=--quick
# for the 4-minute smoke run), with torchft 0.2.0 in .venv-tft: a venv of its own that sees
# this venv's packages through a .pth file, so torchft never touches the CPU torch here.
$(TFT)/.installed: constraints.txt
	test -x $(TFT)/bin/python || $(PYTHON) -m venv $(TFT)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	    $$($(TFT)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/main_venv.pth
	$(TFT)/bin/pip install -q --no-deps -c constraints.txt torchft
	$(TFT)/bin/pip install -q -c constraints.txt opentelemetry-api opentelemetry-sdk \
	    opentelemetry-exporter-otlp-proto-http matplotlib
	$(TFT)/bin/python -c "import torch, torchft; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

bench-goodput: data $(TFT)/.installed
	mkdir -p $(BENCH_LOG)
	set -o pipefail; $(PY) benchmarks/goodput.py $(GOODPUT_ARGS) | tee $(BENCH_LOG)/goodput.txt
	@# The at-scale model: published recovery costs and failure rates, no run (seconds)
	$(PY) benchmarks/goodput_at_scale.py > $(BENCH_LOG)/goodput_at_scale.txt

# Not part of make bench (about 11 minutes): the high scenario at 600 iterations, one seed,
# to see whether the convergence gaps last once the validation loss is flatter.
bench-long: data
	mkdir -p $(BENCH_LOG)
	set -o pipefail; $(PY) examples/pretrain_gpt/convergence.py --train-iters 600 \
	    --eval-interval 50 --seeds 1234 --scenarios high --every-seed-scenarios \
	    --output-dir results/convergence_long | tee $(BENCH_LOG)/convergence_long.txt

lint: venv
	$(PIP) install -q -c constraints.txt ruff black
	$(VENV)/bin/ruff check megatron_mecefo examples tests benchmarks patches
	$(VENV)/bin/black --check megatron_mecefo examples tests benchmarks patches
	@if command -v shellcheck > /dev/null; then \
	    shellcheck examples/slurm/*.sh examples/slurm/*.sbatch tests/integration/slurm/*.sh \
	        scripts/*.sh; \
	else echo "make lint: shellcheck not installed; make test-slurm installs it and checks the Slurm scripts"; fi

# results/ holds committed benchmark outputs (see .gitignore); only the run folders go.
clean:
	rm -rf $(VENV) data .pytest_cache results/demo results/demo-snapshot results/demo_abft results/degraded_throughput \
	    results/convergence*/seed* results/convergence*/trace_* results/convergence*/calibration \
	    results/recovery_latency results/recovery_tails

# The docs site (docs/, mkdocs.yml): MkDocs with the Material theme and mkdocstrings, the
# `docs` extra installed into .venv when missing. --strict: a broken link or anchor, a page
# missing from the nav or an API name that no longer resolves fails the build; so does a
# docs/flags.md that differs from the parsers (make flags-doc rewrites it). Output: site/.
.PHONY: docs flags-doc
docs: venv
	$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PIP) install -q -c constraints.txt -e .[docs]
	$(PY) scripts/render_flags.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

flags-doc: venv
	$(PY) scripts/render_flags.py

# The built site in headless Chromium (tests/integration/docs/test_site_render.py): every page
# of the nav renders, and no table or code block on any page is wider than its column at
# 1280 px; then the docs' unit tests (status table, README's first screen, the results
# page's numbers against results/*.json). Installs Debian's chromium with apt when it is
# missing (root), as make test-slurm installs its packages. MECEFO_SCREENSHOT_DIR=DIR keeps
# each page's screenshot.
.PHONY: test-docs
test-docs: docs
	@command -v chromium > /dev/null || command -v chromium-browser > /dev/null || { \
	    if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then \
	        echo "make test-docs: no chromium, and it cannot be installed here (needs root" \
	            "and apt-get): install Debian's chromium package and rerun" >&2; exit 1; fi; \
	    echo "make test-docs: installing chromium with apt-get"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null; }
	MECEFO_SITE_DIR=site MECEFO_REQUIRE_BROWSER=1 $(PY) -m pytest -q \
	    tests/integration/docs/test_site_render.py tests/unit/docs
