# What CI runs (.ci/run), without the install step.
.PHONY: check lint test
check: lint test
lint:
	lint-imports
	ruff check .
	ruff format --check .
	mypy
test:
	python3 -m pytest
