"""The parameter-server service."""
