"""The one exception type of the config system, in a leaf module (imports nothing of llm_training), so any part
of the package can raise it without importing the config package."""


class ConfigError(ValueError):
    """A config problem found before any heavy work; the message names the key/file and the fix."""
