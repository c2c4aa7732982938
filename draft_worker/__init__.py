"""Draft worker: drives the speculation loop for a session and proposes tokens."""
