"""Worked examples of model plugins (``--model downpour.examples.<module>:spec``)."""
