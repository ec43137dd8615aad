"""The one exception type of the config system."""


class ConfigError(ValueError):
    """A config problem found before any heavy work; the message names the key/file and the fix."""
