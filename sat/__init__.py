"""sat package."""
