"""What a request asks for and gets back as text: the request and its events
(:mod:`.requests`), prompts and chat templates (:mod:`.prompts`), sampling (:mod:`.sampling`),
structured output (:mod:`.structured`) and tool calls (:mod:`.tools`).
"""
