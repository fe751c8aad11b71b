"""One APIRouter per endpoint."""
