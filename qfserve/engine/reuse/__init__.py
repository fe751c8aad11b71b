"""Multi-turn reuse: finished turns' caches kept by prompt prefix (:mod:`.kept`) and saved
to disk so they survive a restart (:mod:`.disk`).
"""
