"""Where a model's Q-Filters come from: a calibration artifact (:mod:`.artifact`), the
model's filter state for requests (:mod:`.model`), or its own traffic (:mod:`.traffic`).
"""
