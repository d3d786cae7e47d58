"""Paged KV caches with prefix sharing, on the device."""
