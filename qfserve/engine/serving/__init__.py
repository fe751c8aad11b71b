"""Serving: the one thread that owns the model (:mod:`.worker`), the queue between the event
loop and it (:mod:`.intake`), admission by KV memory (:mod:`.admission`), the scheduler that
prefills and decodes every running request in one batch (:mod:`.scheduler`, over
:mod:`qfserve.engine.kv.batch`), kept turns (:mod:`.turns`), each request's record and event
queue (:mod:`.records`, :mod:`.jobs`), what the thread builds at start (:mod:`.startup`), and
the lockstep of several ranks (:mod:`.lockstep`, :mod:`.liveness`). It names no eviction
method: what a method needs beyond a score it asks through :mod:`qfserve.engine.kv.methods`.
"""
