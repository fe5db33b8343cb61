"""Thin integrations of kvengine into inference engines."""
