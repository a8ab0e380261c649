"""Built-in passes. Importing this package registers them; each lives in its own file."""
from . import cleanup  # noqa: F401
