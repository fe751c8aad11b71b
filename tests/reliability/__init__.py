"""Reliability under load, faults and bad input, against a real server on 127.0.0.1.

``python3 -m pytest`` runs the CI size; ``python -m tests.reliability --full`` runs the full
sizes and writes ``bench/results/reliability.json``.
"""
