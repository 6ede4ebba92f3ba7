# Two commands do everything on a fresh machine (Python 3.8+ with venv, g++):
#   make demo   set up, then fuse + verify + benchmark the bundled example model
#   make test   set up, then run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test bench gpu-check gpu-bundle clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard cuda_kernels/*/*.cc cuda_kernels/*/*.cpp cuda_kernels/*/*.h cuda_kernels/*/*.cu cuda_kernels/common/mxnet_gpu/*.cu)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# With nvcc, the CUDA library's fused_dense is built on cuBLASLt from this wheel (else as stubs)
	if command -v nvcc >/dev/null 2>&1; then $(BIN)/python -m pip install -q nvidia-cublas || \
	    echo "note: nvidia-cublas could not be installed: the CUDA fused_dense is built as stubs"; fi
	# With nvcc, fused_attention's cuDNN path compiles against these headers (libcudnn is opened at run time)
	if command -v nvcc >/dev/null 2>&1; then $(BIN)/python -m pip install -q nvidia-cudnn-cu13 && \
	    $(BIN)/python -m pip install -q --no-deps nvidia-cudnn-frontend || \
	    echo "note: the cuDNN wheels could not be installed: fused_attention is built without its cuDNN path"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m fusion.native.build
	touch $@

demo: setup
	$(BIN)/mxfuse examples/models/mobilenetv2_0.25-symbol.json \
	    --params examples/models/mobilenetv2_0.25-0000.params \
	    -o out/ --shape data=1,3,224,224 --verify --benchmark --report out/report.json

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python benchmarks/bench_cnn.py

# On a GPU machine with PyTorch and nvcc (no MXNet or venv needed): build, the CUDA kernels'
# tests, the op library through MXNet's lib_api entry points (tests/kernels/libapi_harness.py),
# then the benchmark against PyTorch; a summary at the end (tools/gpu_check.py, < 8 minutes).
gpu-check:
	$(PY) tools/gpu_check.py

# Here (MXNet installed): copy MXNet's lib_api sources to build/mxnet_lib_api, which gpu-check
# compiles the op library against on a GPU machine where MXNet is not installed, and the cuDNN
# frontend's headers to build/cudnn_bundle (fused_attention's cuDNN path; the GPU machine's
# PyTorch has cuDNN itself).
gpu-bundle: setup
	$(BIN)/python tools/gpu_check.py --bundle

clean:
	rm -rf $(VENV) out build *.egg-info
