"""Worked examples of model plugins (``--model shared.examples.<module>:spec``)."""
