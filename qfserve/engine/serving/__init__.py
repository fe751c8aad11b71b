"""Serving: the one thread that owns the model (:mod:`.worker`), the scheduler that admits,
prefills and decodes every running request in one batch (:mod:`.scheduler`, :mod:`.batch`,
:mod:`.packed`), what memory admits (:mod:`.admission`), and each request's record and
event queue (:mod:`.records`, :mod:`.jobs`), what the thread builds at start
(:mod:`.startup`), and the lockstep of several ranks (:mod:`.lockstep`, :mod:`.liveness`).
"""
