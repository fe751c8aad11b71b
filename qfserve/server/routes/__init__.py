"""One APIRouter per endpoint, kept thin: each parses its body, hands a request to the
worker through :mod:`qfserve.server.generation` and formats what comes back."""
