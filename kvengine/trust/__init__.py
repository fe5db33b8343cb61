"""Provenance: which weights computed the KV, and namespaces quarantined when it is wrong."""
