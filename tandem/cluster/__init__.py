"""Coordination through Redis: the worker registry and session records."""
