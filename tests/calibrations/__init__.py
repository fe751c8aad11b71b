"""Tests of calibrations/: capture, compute, artifacts, registry, command."""
