# What CI runs (.ci/run), without the install step.
.PHONY: check lint test sanitize fuzz soak
check: lint test
lint:
	lint-imports
	ruff check .
	ruff format --check .
	mypy
test:
	python3 -m pytest
# Before a release (too long for CI): the native kernels under ASan + UBSan, the model-file
# fuzzers (model, calibration and kept-cache files) at their full size, and an hour of mixed
# traffic.
sanitize:
	tests/kernels/sanitized.sh
fuzz:
	QFSERVE_RELIABILITY=full python3 -m pytest -q -s tests/reliability/test_model_files.py \
		tests/reliability/test_other_files.py
soak:
	python3 -m tests.reliability soak --minutes 60
